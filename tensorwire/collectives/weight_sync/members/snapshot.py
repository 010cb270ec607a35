"""A trainer's copy of its tensors for a push that runs while it trains (``push_async``).

``sync.push_async()`` fixes the trainers' bytes of a version when it starts: each trainer
copies the tensors it serves the sync from (:func:`take`: one copy of each, on their device:
the trainer's synced bytes, held until the push ends) before ``push_async`` returns, so the
optimizer may change its tensors from then on. The push's ``send`` serves the copy
(:func:`taken`), a failover's next try too (it holds every piece the trainer has, whichever
the new plan reads). The driver lets go of it when the push ends (:func:`drop`); a newer copy
of the same sync replaces it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from tensorwire.collectives.weight_sync.members.common import checked_tensors, layout_key
from tensorwire.collectives.weight_sync.planning.layout import ParamPiece
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.runtime.ray.hooks import actor_hook

__all__ = ["drop", "take", "taken"]

_copies: dict[str, tuple[int, list[torch.Tensor]]] = {}  # sync id -> (version, the copies)
_lock = threading.Lock()


@actor_hook
def take(
    actor: object, sync_id: str, version: int, where: str | None, layout: Sequence[ParamPiece]
) -> tuple[int, float]:
    """Hook, trainer: copy the tensors it serves sync ``sync_id`` from, for ``version``;
    returns (bytes copied, seconds)."""
    start = time.perf_counter()
    with _lock:
        _copies.pop(sync_id, None)  # the last push's copy, if its drop did not come
    tensors = checked_tensors(actor, where, layout_key(layout), "source")
    with torch.no_grad():
        copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    for device in {c.device for c in copies if c.is_cuda}:  # copied before the optimizer may write
        torch.cuda.current_stream(device).synchronize()
    with _lock:
        _copies[sync_id] = (version, copies)
    return sum(c.numel() * c.element_size() for c in copies), time.perf_counter() - start


def taken(spec: PushSpec) -> list[torch.Tensor] | None:
    """The copy taken for this push's sync and version, in the order of ``spec.layout``, or None."""
    with _lock:
        kept = _copies.get(spec.sync_id)
    return kept[1] if kept is not None and kept[0] == spec.version else None


@actor_hook
def drop(_actor: object, sync_id: str, version: int) -> bool:
    """Hook, trainer: let go of the copy of ``version`` of sync ``sync_id``; whether there was one."""
    with _lock:
        kept = _copies.get(sync_id)
        if kept is None or kept[0] != version:
            return False
        del _copies[sync_id]
        return True
