"""A whole push, in the driver: a liveness look, then tries (:func:`.push.run_try`) until one
completes, failing over between them (:mod:`.recovery.failover`) when a trainer was lost and
the others hold its bytes (or within the try, :mod:`.recovery.cover`: the trainer it replaced is
dropped after it); the version state moved along (:class:`.commit.state.PushState`).
:meth:`..sync.WeightSync.push` runs it in the caller's thread, ``push_async`` on one of its
own (:mod:`.in_flight`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from tensorwire.collectives.weight_sync import unchanged
from tensorwire.collectives.weight_sync.planning import subsets
from tensorwire.collectives.weight_sync.planning.layout import ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import Arrived
from tensorwire.collectives.weight_sync.planning.subsets import Subset
from tensorwire.collectives.weight_sync.push import PushingSync, abandon, prepared_for, run_try
from tensorwire.collectives.weight_sync.recovery import failover
from tensorwire.collectives.weight_sync.report.summary import SyncReport
from tensorwire.collectives.weight_sync.report.telemetry import failover_pairs
from tensorwire.collectives.weight_sync.report.telemetry import record as record_pairs
from tensorwire.errors import TrainerLost

__all__ = ["Pushing", "push_version"]


class Pushing(PushingSync, failover.FailingOver, Protocol):
    """What a whole push reads and changes of its :class:`..sync.WeightSync`."""

    sync_id: str
    commit: str
    skip_unchanged: bool
    committed_buckets: unchanged.Record | None  # the last version every live receiver committed, by bucket

    @property
    def receiver_layouts(self) -> dict[int, tuple[ParamPiece, ...]]: ...

    def live_receivers(self) -> tuple[int, ...]: ...


def push_version(sync: Pushing, only: Subset | None = None) -> SyncReport:
    """Push the trainers' tensors as the next version (see :meth:`..sync.WeightSync.push`;
    ``only``: a subset push's receiver parameters)."""
    version = sync.state.start()
    replaced: dict[str, str] = {}
    lost: dict[tuple[str, str], int] = {}  # (replaced trainer, receiver) -> failovers
    start = time.perf_counter()
    refused = failover.leave_out_unresponsive(sync, version, replaced, lost)  # a look, not a failed try
    if refused is not None:
        sync.state.finish(committed=False)
        raise refused
    record, sync.committed_buckets = sync.committed_buckets, None  # (kept again only if every receiver commits)
    try:
        skipped, sums, key = _unchanged(sync, version, only, record)
    except BaseException:
        sync.state.finish(committed=False)
        raise
    have = skipped
    while True:
        live = sync.live_receivers()
        try:
            try:
                report = run_try(sync, live, version, have, only=only)
                for name, why in list(report.replaced.items()):  # covered while the try ran
                    failover.drop_covered(sync, name, why, replaced, lost)
                break
            except TrainerLost as e:  # complete from the others if they can
                refused = failover.fail_over(sync, e, replaced, lost)
                if refused is not None:
                    raise refused from None
        except BaseException:
            abandon(sync, live)
            sync.state.finish(committed=False)
            raise
        actors: Mapping[int, Any] = {r: sync.receiver_actors[r] for r in live}
        arrived = failover.arrived(sync.sync_id, version, actors, sync.receiver_layouts, timeout_s=sync.timeout_s)
        have = subsets.merged(arrived, skipped)
    report.replaced, report.seconds = replaced, time.perf_counter() - start  # every try
    report.pairs.update(failover_pairs(lost))
    record_pairs(sync.name, failover_pairs(lost))
    sync.state.finish(committed=_committed(sync, report))
    everyone = set(report.receivers) == set(sync.live_receivers())
    if sums is not None and everyone and not replaced and sync.state.committed == version:
        sync.committed_buckets = unchanged.Record(key, sums)  # every live receiver holds this version
    return report


def _unchanged(
    sync: Pushing, version: int, only: Subset | None, record: unchanged.Record | None
) -> tuple[dict[int, Arrived] | None, unchanged.Sums | None, Any]:
    """``skip_unchanged``: the pieces of the buckets that did not change since ``record`` (as
    pieces the receivers hold), this push's bucket checksums and the setup they are of."""
    if not sync.skip_unchanged or only is not None:
        return None, None, None
    live = sync.live_receivers()
    base = prepared_for(sync, live, None, False, None)
    sums = unchanged.checksums(sync, base, version)
    key = (base.key, id(sync.plan), tuple(sync.trainer_name(i) for i in range(len(sync.trainers))))
    return unchanged.held_pieces(sync, live, base, sums, record=record, key=key), sums, key


def _committed(sync: Pushing, report: SyncReport) -> bool:
    """Whether the receivers hold the version of ``report`` (all-or-none: none of them
    failed; in place, once voted, one that failed or died after is torn or gone: the
    others hold it)."""
    if not report.receivers:
        return False
    failed = any(kind.ends_the_version for kind in report.failure_kinds.values())
    return sync.commit == "each" or sync.state.promised or not failed
