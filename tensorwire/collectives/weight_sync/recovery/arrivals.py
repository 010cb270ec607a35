"""What arrived of a push in this receiver: the pieces of the version being pushed that are
in place (in the shadows, the staging or the tensors themselves), so that a failover's second
try reads only the rest (:func:`..recovery.failover.arrived` asks for them).
"""

from __future__ import annotations

import threading

from tensorwire.collectives.weight_sync.planning.layout import Box
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.runtime.ray.hooks import actor_hook

__all__ = ["Received", "arrived_hook", "holds", "note_received", "received", "release", "start_receiving"]

Received = tuple[str, str, tuple[int, ...], tuple[int, ...]]  # (parameter, wire dtype, box offsets, box sizes)

_lock = threading.Lock()
_arrived: dict[str, tuple[int, set[Received]]] = {}  # sync id -> (version, the pieces of it that arrived)


def start_receiving(spec: PushSpec) -> None:
    """A push of ``spec.version`` starts here: forget the pieces of any other version."""
    with _lock:
        kept = _arrived.get(spec.sync_id)
        if kept is None or kept[0] != spec.version:
            _arrived[spec.sync_id] = (spec.version, set())


def note_received(spec: PushSpec, pieces: list[Received]) -> None:
    """These pieces of ``spec.version`` are in place (in the shadows, the staging or the
    tensors themselves, wherever :func:`..commit.aside.destinations` put them)."""
    with _lock:
        kept = _arrived.get(spec.sync_id)
        if kept is not None and kept[0] == spec.version:
            kept[1].update(pieces)


def holds(spec: PushSpec, pieces: list[Received]) -> bool:
    """Whether every one of ``pieces`` of ``spec.version`` is in place here, each within one
    piece that arrived (a cover skips the buckets the try delivered before its trainer was lost)."""
    with _lock:
        kept = _arrived.get(spec.sync_id)
        if kept is None or kept[0] != spec.version:
            return False
        boxes: dict[tuple[str, str], list[Box]] = {}
        for name, wire, offsets, sizes in kept[1]:
            boxes.setdefault((name, wire), []).append(Box(offsets, sizes))
    return all(
        any(box.contains(Box(offsets, sizes)) for box in boxes.get((name, wire), ()))
        for name, wire, offsets, sizes in pieces
    )


def received(sync_id: str, version: int) -> list[Received]:
    """The pieces of ``version`` of sync ``sync_id`` that arrived here (empty for another version)."""
    with _lock:
        kept = _arrived.get(sync_id)
        return sorted(kept[1]) if kept is not None and kept[0] == version else []


@actor_hook
def arrived_hook(_actor: object, sync_id: str, version: int) -> list[Received]:
    """Hook, receiver: the pieces of ``version`` that arrived here (for a failover's second try)."""
    return received(sync_id, version)


def release(sync_id: str) -> None:
    """Forget what arrived of sync ``sync_id`` in this process."""
    with _lock:
        _arrived.pop(sync_id, None)
