"""The driver's wait for one weight-sync push: bounded, drawing the progress bar from the
trainers' messages, deciding an all-or-none vote (:mod:`.vote`) while the members run, and
giving up on a trainer that receivers report stalled (:mod:`..recovery.stalls`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorwire.collectives.weight_sync.commit.vote import Vote, ended_early
from tensorwire.collectives.weight_sync.planning.buckets import push_deadline_s
from tensorwire.collectives.weight_sync.protocol.messages import progress_key
from tensorwire.collectives.weight_sync.protocol.spec import Role
from tensorwire.collectives.weight_sync.recovery.stalls import stalled
from tensorwire.errors import TensorwireError
from tensorwire.progress import ProgressBar
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.ray import calls

__all__ = ["PushWait"]


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
        vote: Vote | None,
        trainers: Sequence[Any],
    ) -> dict[int, str]:
        """Wait until every member's call (``members``: call -> who; ``trainers``: the trainers'
        calls in rank order) ended, within the push's deadline, or was reported stalled by a
        receiver: returns those trainers' ranks -> the receiver rank that reported it (their
        calls are left running). With a ``vote``: commit once every receiver is ready, abort as
        soon as a member failed or stalled or a receiver ended without committing."""
        pending = list(members)
        stalls: dict[int, str] = {}
        deadline = time.monotonic() + push_deadline_s(self.timeout_s, self.buckets)
        agent = runtime_agent()
        expected = [(role.stream, len(role.buckets)) for role in trainer_roles]
        settled = dict.fromkeys((s for s, _n in expected), 0)
        bar = ProgressBar(self.buckets, desc=f"weight sync v{self.version}", unit="bucket", enabled=self.progress)
        bar.step(f"{self.nbytes / 2**20:.0f} MiB in all", 0)
        try:
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weight sync v{self.version} did not finish in time")
                for rank, reporter in stalled(channel, len(trainers)).items():
                    if rank not in stalls:
                        stalls[rank] = reporter
                        pending = [ref for ref in pending if ref is not trainers[rank]]
                if vote is not None and vote.decision is None:
                    vote.collect()
                    done, pending = calls.wait_all(pending, timeout_s=0.0)
                    failure, lost = ended_early(members, done, trainers, timeout_s=self.timeout_s)
                    if failure is None and stalls:
                        lost, reporter = next(iter(stalls.items()))
                        failure = f"{members[trainers[lost]]} stalled (reported by channel rank {reporter})"
                    vote.decide(failure, lost_trainer=lost)
                else:
                    _done, pending = calls.wait_all(pending, timeout_s=0.1)
                if not self.progress:
                    continue
                for stream, count in expected:
                    while settled[stream] < count:
                        try:
                            agent.rendezvous_take(channel, progress_key(stream, settled[stream]), timeout_s=0.0)
                        except TensorwireError:
                            break
                        settled[stream] += 1
                bar.advance_to(sum(settled.values()))
        finally:
            agent.rendezvous_forget(channel)
            bar.close()
        return stalls
