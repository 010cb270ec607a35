"""One try of a push, in the driver: from :meth:`..sync.WeightSync.push` to every member's answer.

:func:`run_try` does it in named steps:

1. **prepare** (:func:`_prepared`): each member's spec, worked out once per set of live
   receivers and kept between pushes (:mod:`.protocol.assign`); whether the receivers write in
   place (``aside="none"`` with a second source for every byte) or assemble aside;
2. **start**: the trainers' ``send`` and the receivers' ``receive`` hooks (:mod:`.members`),
   and the vote of an all-or-none push (:class:`.commit.vote.Vote`);
3. **wait** (:class:`.commit.push_wait.PushWait`): the progress bar, the vote decided while
   they run, stalls reported by receivers (:mod:`.recovery.stalls`);
4. **collect**: the receivers' results into the :class:`.report.summary.SyncReport` (failures by
   kind), then the trainers': a trainer that died or stalled raises ``TrainerLost`` (the caller
   fails over, :mod:`.recovery.failover`), one that failed raises its error.

In an all-or-none push assembled aside, the first trainer lost while the try runs is covered
(:mod:`.recovery.cover`): the others serve its share beside the try, which then commits; the
report names it in ``replaced`` and the caller drops it from the sync.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from tensorwire.collectives.weight_sync.commit.push_wait import PushWait, Waited
from tensorwire.collectives.weight_sync.commit.state import PushState
from tensorwire.collectives.weight_sync.commit.vote import Vote
from tensorwire.collectives.weight_sync.members import receiver, trainer
from tensorwire.collectives.weight_sync.planning import subsets
from tensorwire.collectives.weight_sync.planning.plan import Arrived
from tensorwire.collectives.weight_sync.planning.subsets import Subset
from tensorwire.collectives.weight_sync.protocol.assign import SyncSettings, member_specs
from tensorwire.collectives.weight_sync.protocol.messages import ReceiverFailure
from tensorwire.collectives.weight_sync.protocol.spec import ReceiveResult, Role
from tensorwire.collectives.weight_sync.recovery import cover
from tensorwire.collectives.weight_sync.recovery.failover import two_sources
from tensorwire.collectives.weight_sync.report.summary import SyncReport
from tensorwire.collectives.weight_sync.report.telemetry import merged_pairs, pairs_of, record
from tensorwire.errors import TrainerLost
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.ray import calls
from tensorwire.runtime.ray.hooks import call_hook, call_hook_concurrently

__all__ = ["Prepared", "PushingSync", "abandon", "prepared_for", "run_try"]

logger = logging.getLogger(__name__)


class PushingSync(SyncSettings, Protocol):
    """What a try reads of its :class:`..sync.WeightSync` besides its settings."""

    aside: str
    state: PushState
    prepared: Prepared | None
    overlapped: bool  # push_async: trainers serve beside their own calls (their hook group)
    receiver_actors: dict[int, Any]
    nbytes: int

    def next_channel(self) -> str: ...

    def trainer_name(self, position: int) -> str: ...

    def trainer_stopped(self, position: int) -> bool: ...


class Prepared(NamedTuple):
    """A push's setup, kept between pushes over the same receivers (``key``)."""

    key: Any
    in_place: bool
    blobs: dict[int, bytes]
    roles: dict[int, tuple[Role, ...]]
    buckets: int


class _Started(NamedTuple):
    """The calls of one try: the trainers' (in rank order) and the receivers' (by id)."""

    channel: str
    trainers: list[Any]
    receivers: dict[int, Any]
    vote: Vote | None
    started: float
    start: float


def run_try(
    sync: PushingSync,
    live: tuple[int, ...],
    version: int,
    have: Mapping[int, Arrived] | None = None,
    *,
    catch_up: bool = False,
    rehearsal: bool = False,
    only: Subset | None = None,
) -> SyncReport:
    """Push the trainers' tensors into the ``live`` receivers as ``version`` (``have``: pieces
    they hold already, after a failover: not kept for the next push; ``catch_up``: to a
    newcomer alone, which serves nothing yet: in place even from a single source;
    ``rehearsal``: every receiver reads aside and commits nothing, no vote; ``only``: the
    receiver parameters of a subset push, :mod:`.planning.subsets`).

    Raises:
        TrainerLost: A trainer died or stalled (its position; ``.report``).
        Exception: A trainer failed (Ray's error carrying it, with ``.report``), or a wait timed out.
    """
    if have is None:
        sync.state.first_try()  # (in place, it votes)
    prepared = prepared_for(sync, live, have, catch_up, only)
    m = len(sync.trainers)
    running = _start(sync, live, version, prepared, rehearsal=rehearsal)
    waited, covers = _wait(sync, live, version, prepared, running, have=have, only=only)
    report = SyncReport(version, sync.nbytes, prepared.buckets, time.perf_counter() - running.start, 0.0, 0.0, 0.0, 0.0)
    _collect_receivers(sync, report, running.receivers, only)
    names = {i: sync.trainer_name(i) for i in range(m)} | {m + i: f"receiver {r}" for i, r in enumerate(live)}
    failed = [f"receiver {r}" for r, kind in report.failure_kinds.items() if kind.fault_of_its_own]
    report.kept_nbytes = report.plan_nbytes - report.moved_nbytes if have is not None else 0
    _raise_stalled(sync, report, waited, names=names, failed=failed, started=running.started)
    wrote_all = all(r in report.receivers or r in sync.state.dead for r in live)
    committed = wrote_all if prepared.in_place else running.vote is not None and running.vote.committed
    for i, why in waited.covered.items():
        if not committed:  # the cover did not complete it: fail over between two tries
            _telemetry(sync, report, names, running.started, [*failed, sync.trainer_name(i)])
            raise _trainer_lost(sync, report, i, why)
        failed.append(sync.trainer_name(i))
        report.replaced[sync.trainer_name(i)] = why
    _collect_trainers(sync, report, running, waited, committed=committed, failed=failed, names=names)
    if not rehearsal:
        _telemetry(sync, report, names, running.started, failed, retry=have is not None)
    for started in covers:
        _collect_cover(sync, report, started, live, running.started)
    return report


def _wait(
    sync: PushingSync,
    live: tuple[int, ...],
    version: int,
    prepared: Prepared,
    running: _Started,
    *,
    have: Mapping[int, Arrived] | None,
    only: Subset | None,
) -> tuple[Waited, list[cover.Cover]]:
    """:meth:`PushWait.wait` for the try ``running``, covering a lost trainer where it can
    (all-or-none aside, more than one trainer); what it did not wait for, and the covers."""
    m = len(sync.trainers)
    members = {ref: sync.trainer_name(i) for i, ref in enumerate(running.trainers)}
    members.update({ref: f"receiver {rid}" for rid, ref in running.receivers.items()})
    trainer_roles = [role for rank in range(m) for role in prepared.roles[rank]]
    waiting = PushWait(version, prepared.buckets, sync.plan.nbytes, progress=sync.progress, timeout_s=sync.timeout_s)
    covers: list[cover.Cover] = []
    coverable = running.vote is not None and not prepared.in_place and m > 1
    starter = _cover_starter(sync, live, version, running.channel, have, only, covers=covers) if coverable else None
    try:
        waited = waiting.wait(
            members,
            running.channel,
            trainer_roles,
            vote=running.vote,
            trainers=running.trainers,
            stopped=sync.trainer_stopped,
            cover=starter,
        )
    finally:
        if prepared.in_place and running.vote is not None and running.vote.committed:
            sync.state.promise()  # the receivers write it: from here on, only forward
        for started in covers:
            runtime_agent().rendezvous_forget(started.channel)
    return waited, covers


def _raise_stalled(
    sync: PushingSync, report: SyncReport, waited: Waited, *, names: dict[int, str], failed: list[str], started: float
) -> None:
    """``TrainerLost`` for the first trainer reported stalled and not covered (after the try's telemetry)."""
    for i, reporter in waited.stalls.items():
        _telemetry(sync, report, names, started, [*failed, sync.trainer_name(i)])
        why = f"stalled: {names.get(int(reporter), reporter)} got no bucket from it in time"
        if sync.stall_s:
            why = f"stalled: {names.get(int(reporter), reporter)} got no bucket from it in {sync.stall_s:g} s"
        raise _trainer_lost(sync, report, i, why)


def _cover_starter(  # noqa: PLR0917 (the try's setup, passed on)
    sync: PushingSync,
    live: tuple[int, ...],
    version: int,
    of_try: str,
    have: Mapping[int, Arrived] | None,
    only: Subset | None,
    *,
    covers: list[cover.Cover],
) -> Callable[[int, str], dict[Any, str] | None]:
    """``start(rank, why)``: the cover of trainer ``rank`` of the try on channel ``of_try``
    (:func:`.recovery.cover.start`), kept in ``covers``; its calls, or None when there is none
    (each trainer asked about once: a replan of a large push takes seconds; a cover that cannot
    be started leaves the try to abort and fail over as before)."""
    asked: set[int] = set()

    def start(rank: int, why: str) -> dict[Any, str] | None:
        if rank in asked:
            return None
        asked.add(rank)
        try:
            started = cover.start(
                sync,
                live,
                version,
                rank,
                why,
                actors=sync.receiver_actors,
                channel=sync.next_channel(),
                of_try=of_try,
                have=have,
                only=only,
            )
        except Exception:  # (the push goes on: the failover between two tries)
            logger.warning("weight sync %s: the cover of trainer %d could not start", sync.name, rank, exc_info=True)
            return None
        if started is None:
            return None
        covers.append(started)
        return started.calls

    return start


def _collect_cover(
    sync: PushingSync, report: SyncReport, started: cover.Cover, live: tuple[int, ...], began: float
) -> None:
    """What a cover moved, into ``report`` (after the try committed with it): its bytes, the
    trainers' staging and its pairs (each bucket a retry)."""
    m = len(started.survivors)
    names = {j: sync.trainer_name(position) for j, position in enumerate(started.survivors)}
    names.update({m + i: f"receiver {r}" for i, r in enumerate(live)})
    results: dict[int, ReceiveResult] = {}
    for ref in started.calls:
        outcome = calls.settle(ref, timeout_s=sync.timeout_s)
        if not outcome.ok:
            continue
        if isinstance(outcome.value, ReceiveResult):
            results[live[outcome.value.rank - m]] = outcome.value
            report.moved_nbytes += outcome.value.nbytes
            report.covered_nbytes += outcome.value.nbytes
        else:  # (beside the try's: its staging is on top of the try's)
            report.peak_staging_nbytes += outcome.value.peak_nbytes
            report.in_place_nbytes += outcome.value.in_place_nbytes
    pairs, timeline = pairs_of(results, names, began, retry=True)
    report.pairs = merged_pairs(report.pairs, pairs)
    report.timeline = sorted([*report.timeline, *timeline], key=lambda s: (s.source, s.destination, s.start_s))
    record(sync.name, pairs)


def prepared_for(
    sync: PushingSync, live: tuple[int, ...], have: Mapping[int, Arrived] | None, catch_up: bool, only: Subset | None
) -> Prepared:
    """Each member's spec for this try (kept between pushes over the same receivers and subset;
    a failover's try, with ``have``, is not kept)."""
    subset_key = None if only is None else tuple(sorted(only.items()))
    key = (live, sync.progress, catch_up, subset_key) if have is None else None
    if have is None and sync.prepared is not None and sync.prepared.key == key:
        return sync.prepared
    voted = sync.state.promised
    in_place = voted or (sync.aside == "none" and (catch_up or two_sources(sync, live)))
    if sync.aside == "none" and not in_place:
        logger.warning("weight sync %s: some bytes have one trainer left: assembled aside", sync.name)
    if only is not None:  # what the subset leaves out, as pieces the receivers hold
        have = subsets.merged(have, subsets.left_out(sync.plan, only))
    blobs, roles, buckets = member_specs(sync, live, have, in_place=in_place, voted=voted, only=only)
    sync.prepared = Prepared(key, in_place, blobs, roles, buckets)
    return sync.prepared


def _start(
    sync: PushingSync, live: tuple[int, ...], version: int, prepared: Prepared, *, rehearsal: bool = False
) -> _Started:
    """Start every member's hook, and the vote of an all-or-none push (not of a rehearsal)."""
    channel = sync.next_channel()
    m = len(sync.trainers)
    started, start = time.time(), time.perf_counter()
    blobs = prepared.blobs
    call = call_hook_concurrently if sync.overlapped else call_hook  # push_async: beside the training
    trainer_refs = [call(t, trainer.send, blobs[i], version, channel) for i, t in enumerate(sync.trainers)]
    receiver_refs = {
        r: call_hook(sync.receiver_actors[r], receiver.receive, blobs[m + i], version, channel, rehearsal=rehearsal)
        for i, r in enumerate(live)
    }
    vote = None
    if (
        sync.commit == "all" and not sync.state.promised and not rehearsal
    ):  # (in place, a failover's next try: voted already)
        ranks = {m + i: sync.receiver_descriptions[r][0] for i, r in enumerate(live)}
        vote = Vote(channel, ranks, timeout_s=sync.timeout_s)
    return _Started(channel, trainer_refs, receiver_refs, vote, started, start)


def _collect_receivers(sync: PushingSync, report: SyncReport, refs: dict[int, Any], only: Subset | None) -> None:
    """Each receiver's result into ``report``: committed, or in ``failed`` by kind (its plan's
    bytes: those of the subset ``only`` when given)."""
    for rid in sync.state.dead:
        report.fail(rid, ReceiverFailure.LEFT_OUT, "left out: it died in an earlier push")
    for rid, ref in refs.items():
        outcome = calls.settle(ref, timeout_s=sync.timeout_s)
        if outcome.failure is calls.CallFailure.ACTOR_DIED:
            sync.state.dead.add(rid)
            report.fail(rid, ReceiverFailure.DIED, f"the receiver died: {outcome.reason}")
            continue
        if outcome.failure is calls.CallFailure.FAILED:
            report.fail(rid, ReceiverFailure.FAILED, outcome.reason)
            continue
        if outcome.error is not None:  # timed out
            raise outcome.error
        result: ReceiveResult = outcome.value
        if not result.committed:
            report.fail(rid, ReceiverFailure.NOT_COMMITTED, f"not committed: {result.refused}")
            continue
        report.receivers[rid] = result
        report.moved_nbytes += result.nbytes
        report.plan_nbytes += sync.plan.receiver_nbytes_of(rid, None if only is None else only.get(rid, frozenset()))
        report.transfer_s = max(report.transfer_s, result.transfer_s)
        report.unpack_s = max(report.unpack_s, result.unpack_s)
        report.verify_s = max(report.verify_s, result.verify_s)
        report.aside_nbytes = max(report.aside_nbytes, result.aside_nbytes)


def _collect_trainers(
    sync: PushingSync,
    report: SyncReport,
    started: _Started,
    waited: Waited,
    *,
    committed: bool,
    failed: list[str],
    names: dict[int, str],
) -> None:
    """Each trainer's result into ``report``; a trainer lost before the receivers committed
    raises ``TrainerLost``, one that failed its own error (after the telemetry of the try).
    One that died after they committed is only named, one that stopped after every receiver
    had its bytes (``waited.unfinished``) is left running: the next push replaces them; one a
    cover replaced (``waited.covered``) is left as it is."""
    for i, ref in enumerate(started.trainers):
        if i in waited.covered:
            continue
        if any(ref is call for call in waited.unfinished):
            logger.warning(
                "weight sync %s: %s stopped after sending everything: left running", sync.name, sync.trainer_name(i)
            )
            continue
        outcome = calls.settle(ref, timeout_s=sync.timeout_s)
        if outcome.failure is calls.CallFailure.ACTOR_DIED and committed:
            failed.append(sync.trainer_name(i))
            continue
        if not outcome.ok:
            _telemetry(sync, report, names, started.started, [*failed, sync.trainer_name(i)])
        if outcome.failure is calls.CallFailure.ACTOR_DIED:
            raise _trainer_lost(sync, report, i, f"died during the push: {outcome.reason}") from None
        if outcome.failure is calls.CallFailure.FAILED and sync.state.promised:  # in place: only forward
            raise _trainer_lost(sync, report, i, f"failed during the push: {outcome.reason}") from None
        if outcome.error is not None:  # the trainer failed (Ray's error carrying it), or timed out
            outcome.error.report = report  # type: ignore[attr-defined]
            raise outcome.error
        report.pack_s = max(report.pack_s, outcome.value.pack_s)
        report.peak_staging_nbytes = max(report.peak_staging_nbytes, outcome.value.peak_nbytes)
        report.in_place_nbytes += outcome.value.in_place_nbytes


def _trainer_lost(sync: PushingSync, report: SyncReport, i: int, what: str) -> TrainerLost:
    """The error of a try whose trainer ``i`` died or stalled (a failover may replace it)."""
    why = f"weight sync v{report.version}: {sync.trainer_name(i)} ({sync.trainers[i]!r}) {what}"
    return TrainerLost(i, why, report=report)


def _telemetry(
    sync: PushingSync,
    report: SyncReport,
    names: dict[int, str],
    started: float,
    failed: list[str],
    *,
    retry: bool = False,
) -> None:
    """The try's per-pair view (report.pairs, report.timeline), added to the Prometheus totals."""
    report.pairs, report.timeline = pairs_of(report.receivers, names, started, failed, retry=retry)
    record(sync.name, report.pairs)


def abandon(sync: PushingSync, live: tuple[int, ...]) -> None:
    """A push that fails after in-place receivers voted: they let go of their fences (those
    that wrote part of the version are ``TORN``: the next push mends them)."""
    if not sync.state.promised:
        return
    refs = [
        call_hook(sync.receiver_actors[r], receiver.abandon, sync.sync_id) for r in live if r not in sync.state.dead
    ]
    done, _late = calls.wait_all(refs, timeout_s=sync.timeout_s)
    for ref in done:
        calls.settle(ref, timeout_s=1.0)  # (one that died or failed let go by itself)
