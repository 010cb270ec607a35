"""The driver's wait for one weight-sync push: bounded, drawing the progress bar from the
trainers' messages, deciding an all-or-none vote (:mod:`.vote`) while the members run, giving
up on a trainer that receivers report stalled (:mod:`..recovery.stalls`) or that died, and
covering it while the push runs where it can (:mod:`..recovery.cover`), and not waiting for a
trainer that stopped after every receiver had its bytes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from tensorwire.collectives.weight_sync.commit.vote import Vote, ended_early
from tensorwire.collectives.weight_sync.planning.buckets import push_deadline_s
from tensorwire.collectives.weight_sync.protocol.messages import progress_key
from tensorwire.collectives.weight_sync.protocol.spec import Role
from tensorwire.collectives.weight_sync.recovery.stalls import reported_dead, stalled
from tensorwire.errors import TensorwireError
from tensorwire.progress import ProgressBar
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.ray import calls

__all__ = ["PushWait", "Waited"]


@dataclass(frozen=True)
class PushWait:
    """How to wait for push ``version`` of ``buckets`` buckets (``nbytes`` in all)."""

    version: int
    buckets: int
    nbytes: int
    progress: bool
    timeout_s: float

    def wait(
        self,
        members: dict[Any, str],
        channel: str,
        trainer_roles: Sequence[Role],
        *,
        vote: Vote | None,
        trainers: Sequence[Any],
        stopped: Callable[[int], bool] = lambda _rank: False,
        cover: Callable[[int, str], dict[Any, str] | None] | None = None,
    ) -> Waited:
        """Wait until every member's call (``members``: call -> who; ``trainers``: the trainers'
        calls in rank order) ended, within the push's deadline, or was reported stalled by a
        receiver (:class:`Waited`: their ranks -> the receiver rank that reported it), or is a
        trainer's whose process is stopped (``stopped(rank)``) once every receiver committed:
        its bytes all arrived (``Waited.unfinished``). Calls not waited for are left running.
        With a ``vote``: commit once every receiver is ready, abort as soon as a member failed
        or stalled or a receiver ended without committing; but the first trainer that died or
        stalled is covered instead where ``cover(rank, why)`` starts a cover (its calls, call ->
        who: waited for, and ``Waited.covered``)."""
        pending = list(members)
        waited = Waited({}, [], {})
        deadline = time.monotonic() + push_deadline_s(self.timeout_s, self.buckets)
        progress = _Progress(self, channel, trainer_roles)
        committed: list[bool] = []  # once only trainers' calls are pending: did every receiver commit
        try:
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weight sync v{self.version} did not finish in time")
                if vote is not None and vote.decision is None:
                    vote.collect()
                    done, pending = calls.wait_all(pending, timeout_s=0.0)
                    if cover is not None and not waited.covered and len(vote.ready) < len(vote.receivers):
                        pending = _cover_lost(channel, members, trainers, pending, done, waited, cover)
                    pending = _take_stalls(channel, trainers, waited, pending)
                    covered = [trainers[rank] for rank in waited.covered]
                    done = [ref for ref in done if all(ref is not c for c in covered)]  # (it died: covered)
                    failure, lost = ended_early(members, done, trainers, timeout_s=self.timeout_s)
                    if failure is None and waited.stalls:
                        lost, reporter = next(iter(waited.stalls.items()))
                        failure = f"{members[trainers[lost]]} stalled (reported by channel rank {reporter})"
                    if failure is None:  # a receiver saw it exit: no need to wait for Ray to say so
                        failure, lost = _seen_dead(channel, members, trainers, waited)
                    vote.decide(failure, lost_trainer=lost)
                else:
                    pending = _take_stalls(channel, trainers, waited, pending)
                    _done, pending = calls.wait_all(pending, timeout_s=0.1)
                    pending = _take_stalls(channel, trainers, waited, pending)  # (reported while it waited)
                    pending = self._left_behind(
                        members, pending, trainers, stopped=stopped, waited=waited, committed=committed
                    )
                progress.advance()
        finally:
            runtime_agent().rendezvous_forget(channel)
            progress.close()
        return waited

    def _left_behind(
        self,
        members: dict[Any, str],
        pending: list[Any],
        trainers: Sequence[Any],
        *,
        stopped: Callable[[int], bool],
        waited: Waited,
        committed: list[bool],
    ) -> list[Any]:
        """``pending`` without the calls of trainers whose process is stopped, once only
        trainers' calls are pending and every receiver committed (nothing is left to read from
        them, and no receiver lost them); those go to ``waited.unfinished``."""
        ranks = {id(ref): rank for rank, ref in enumerate(trainers)}
        if not pending or any(id(ref) not in ranks for ref in pending):
            return pending
        if not committed:
            receivers = [ref for ref, who in members.items() if who.startswith("receiver")]  # (not a cover's calls)
            outcomes = [calls.settle(ref, timeout_s=self.timeout_s) for ref in receivers]
            committed.append(bool(receivers) and all(o.ok and o.value.committed for o in outcomes))
        if not committed[0]:
            return pending
        gone = [ref for ref in pending if stopped(ranks[id(ref)])]
        waited.unfinished.extend(gone)
        return [ref for ref in pending if all(ref is not g for g in gone)]


class Waited(NamedTuple):
    """What :meth:`PushWait.wait` did not wait for: trainers reported stalled (rank -> the
    reporting receiver's rank), the calls of trainers that stopped after every receiver
    committed, and the trainer covered while the push ran (rank -> why it was lost)."""

    stalls: dict[int, str]
    unfinished: list[Any]
    covered: dict[int, str]


def _cover_lost(  # noqa: PLR0917 (the wait's state, passed on)
    channel: str,
    members: dict[Any, str],
    trainers: Sequence[Any],
    pending: list[Any],
    done: list[Any],
    waited: Waited,
    cover: Callable[[int, str], dict[Any, str] | None],
) -> list[Any]:
    """The first trainer found lost (reported stalled or dead by a receiver, or its call in
    ``done`` ended because its actor died), covered: its call no longer waited for, the
    cover's calls are (``pending`` with them)."""
    lost: dict[int, str] = {}
    for rank, reporter in stalled(channel, len(trainers)).items():
        lost[rank] = f"stalled: channel rank {reporter} got no bucket from it in time"
    for rank, reporter in reported_dead(channel, len(trainers)).items():
        lost.setdefault(rank, f"died during the push (its process exited, seen by channel rank {reporter})")
    for ref in done:
        if all(ref is not t for t in trainers):
            continue
        outcome = calls.settle(ref, timeout_s=1.0)
        if outcome.failure is calls.CallFailure.ACTOR_DIED:
            lost.setdefault(trainers.index(ref), f"died during the push: {outcome.reason}")
    for rank, why in lost.items():
        started = cover(rank, why)
        if started is None:
            return pending
        members.update(started)
        waited.covered[rank] = why
        return [ref for ref in pending if ref is not trainers[rank]] + list(started)
    return pending


def _seen_dead(
    channel: str, members: dict[Any, str], trainers: Sequence[Any], waited: Waited
) -> tuple[str | None, int | None]:
    """A trainer a receiver saw exit and no cover reads for: why the vote aborts, and its rank."""
    for rank, reporter in reported_dead(channel, len(trainers)).items():
        if rank not in waited.covered:
            return f"{members[trainers[rank]]} died (its process exited, seen by channel rank {reporter})", rank
    return None, None


def _take_stalls(channel: str, trainers: Sequence[Any], waited: Waited, pending: list[Any]) -> list[Any]:
    """Note the trainers receivers reported stalled; ``pending`` without their calls."""
    for rank, reporter in stalled(channel, len(trainers)).items():
        if rank not in waited.stalls and rank not in waited.covered:
            waited.stalls[rank] = reporter
            pending = [ref for ref in pending if ref is not trainers[rank]]
    return pending


class _Progress:
    """The push's progress bar, advanced by the trainers' progress messages."""

    def __init__(self, wait: PushWait, channel: str, trainer_roles: Sequence[Role]) -> None:
        self.enabled = wait.progress
        self.channel = channel
        self.expected = [(role.stream, len(role.buckets)) for role in trainer_roles]
        self.settled = dict.fromkeys((s for s, _n in self.expected), 0)
        self.bar = ProgressBar(wait.buckets, desc=f"weight sync v{wait.version}", unit="bucket", enabled=wait.progress)
        self.bar.step(f"{wait.nbytes / 2**20:.0f} MiB in all", 0)

    def advance(self) -> None:
        if not self.enabled:
            return
        agent = runtime_agent()
        for stream, count in self.expected:
            while self.settled[stream] < count:
                try:
                    agent.rendezvous_take(self.channel, progress_key(stream, self.settled[stream]), timeout_s=0.0)
                except TensorwireError:
                    break
                self.settled[stream] += 1
        self.bar.advance_to(sum(self.settled.values()))

    def close(self) -> None:
        self.bar.close()
