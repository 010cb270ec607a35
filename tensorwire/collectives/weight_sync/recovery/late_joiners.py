"""Late joiners: a receiver added between pushes gets the last committed version before
``WeightSync.add_receiver`` returns.

From a live receiver with the same layout that holds that version when there is one (a replica:
its tensors are exactly that version, and the trainers are spared), through a one-off sync from
that replica to the newcomer (the same names, so the identity plan; layouts with float8
parameters go from the trainers, whose plan quantises); else pushed from the trainers to the
newcomer alone, as that version (their tensors as they are now: the committed version while
they did not change since the last push).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from tensorwire.errors import TensorwireError

__all__ = ["catch_up"]


def catch_up(sync: Any, rid: int, push_to: Callable[[tuple[int, ...], int], Any], dead: Collection[int]) -> str:
    """Bring receiver ``rid`` of ``sync`` (a :class:`..sync.WeightSync`) to its last
    committed version; returns where it came from ("receiver <id>" or "trainers").
    ``push_to(receivers, version)`` pushes from the trainers; ``dead``: receivers known dead."""
    version = sync.committed
    layout = sync.receiver_layouts[rid]
    # float8 layouts go from the trainers, whose plan quantises; a loader's receivers hold
    # their weights where the sync cannot read them
    copyable = sync.load is None and not any("float8" in p.dtype for p in layout)
    replicas = [
        r for r, theirs in sync.receiver_layouts.items() if copyable and r != rid and theirs == layout and r not in dead
    ]
    held = dict(zip(sync.receiver_ids, sync.versions(), strict=True)) if replicas else {}
    source = next((r for r in replicas if held.get(r) == version), None)
    if source is None:
        report = push_to((rid,), version)
        done, why = rid in report.receivers, report.failed.get(rid, "no result")  # (others: left out, if dead)
        where = "trainers"
    else:
        actors = dict(zip(sync.receiver_ids, sync.receivers, strict=True))
        one_off = type(sync)(
            actors[source],
            [actors[rid]],
            source=sync.target,
            target=sync.target,
            commit="each",
            on_commit=sync.on_commit,
            fence=sync.fence,
            name=sync.name,
            progress=False,
            bucket_bytes=sync.bucket_bytes,
            timeout_s=sync.timeout_s,
        )
        try:
            one_off.version = version - 1
            report = one_off.push()
            done, why = report.ok, str(report.failed)
        finally:
            one_off.close()
        where = f"receiver {source}"
    if not done:
        raise TensorwireError(
            f"weight sync {sync.name}: receiver {rid} could not catch up to v{version} from {where}: {why}"
        )
    return where
