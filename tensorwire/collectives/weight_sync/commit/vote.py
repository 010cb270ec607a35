"""All-or-none commit of a weight-sync version: the receivers vote, the driver decides.

With ``commit="all"`` every receiver assembles the version aside (its shadows) and, once all
its streams completed, tells the driver (``ready/<rank>`` in the driver's mailbox for the push's
channel) and waits for the decision in its own mailbox: ``commit``, or ``abort: <why>``. The
driver commits when every receiver of the push is ready; a receiver or trainer that failed or
died first makes it abort them all, so every receiver keeps the version it had, bit for bit. A
receiver that hears nothing within its deadline (the driver gone) keeps its version too.

While they read, receivers look for an abort (:func:`abort_check`: they stop at once instead of
waiting for buckets that will not come). An abort because a trainer was lost (it died, or
stalled: :mod:`..recovery.stalls`) stops only the waits on that trainer: the failover
(:mod:`..recovery.failover`) reads what is missing from the others. Keys and decisions:
:mod:`..protocol.messages`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from tensorwire.collectives.weight_sync.protocol import messages
from tensorwire.collectives.weight_sync.protocol.messages import COMMIT, DECISION_KEY
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.errors import TensorwireError, TrainerLost
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.ray import calls
from tensorwire.transport.agent.wire import peer_from_bytes

__all__ = ["Vote", "abort_check", "any_abort_check", "ended_early", "first_failure", "vote"]

_POLL_S = 0.02  # how long the driver waits for one message before it looks at the calls again


def vote(spec: PushSpec) -> str | None:
    """Receiver: tell the driver this version is assembled; None when told to commit it, else
    why not."""
    agent = runtime_agent()
    try:
        agent.rendezvous_push(
            peer_from_bytes(spec.driver), spec.channel, messages.ready_key(spec.rank), b"", timeout_s=spec.timeout_s
        )
        # (in place the receiver holds its fence meanwhile, and every receiver votes at once: not the whole push)
        wait_s = 2 * spec.timeout_s if spec.in_place else max(spec.deadline_s, spec.timeout_s)
        decision = agent.rendezvous_take(spec.channel, DECISION_KEY, timeout_s=wait_s)
    except TensorwireError as e:
        return f"no decision from the driver: {e}"
    return None if decision == COMMIT else decision.decode(errors="replace")


def abort_check(spec: PushSpec) -> Callable[[int], None] | None:
    """Receiver of an all-or-none push: ``check(parent)`` raises once the driver aborted the
    push (for waits on a bucket from channel rank ``parent``; None when there is no vote). An
    abort because a trainer was lost stops only the waits on that trainer (``TrainerLost``: on
    another node its death shows only here): what the others send is kept for the next try."""
    if spec.commit != "all" or not spec.driver:
        return None
    agent = runtime_agent()

    def check(parent: int) -> None:
        try:
            decision = agent.rendezvous_get(spec.channel, DECISION_KEY, timeout_s=0.0)
        except TensorwireError:
            return  # no decision yet
        if decision == COMMIT:
            return
        lost = messages.parse_lost_trainer(decision)
        if lost is not None:
            rank, why = lost
            if rank == parent:
                raise TrainerLost(parent, f"trainer member {parent} was lost: {why}")
            return
        raise TensorwireError(f"the push was aborted: {decision.decode(errors='replace')}")

    return check


def any_abort_check(spec: PushSpec) -> Callable[[], None]:
    """Receiver: ``check()`` raises once the driver decided anything but commit (a receiver that
    waits for a cover of a trainer it lost, :mod:`..recovery.covered`, stops on any abort)."""
    agent = runtime_agent()

    def check() -> None:
        if spec.commit != "all" or not spec.driver:
            return
        try:
            decision = agent.rendezvous_get(spec.channel, DECISION_KEY, timeout_s=0.0)
        except TensorwireError:
            return  # no decision yet
        if decision != COMMIT:
            raise TensorwireError(f"the push was aborted: {decision.decode(errors='replace')}")

    return check


class Vote:
    """The driver's side of one push's vote.

    ``receivers``: channel rank -> the receiver's agent (peer bytes), for every receiver of
    the push.
    """

    def __init__(self, channel: str, receivers: dict[int, bytes], *, timeout_s: float) -> None:
        self.channel = channel
        self.receivers = receivers
        self.timeout_s = timeout_s
        self.ready: set[int] = set()
        self.decision: bytes | None = None

    def collect(self) -> None:
        """Take the ready messages that came (waits at most a moment for the next one)."""
        agent = runtime_agent()
        for rank in self.receivers:
            if rank in self.ready:
                continue
            try:
                agent.rendezvous_take(self.channel, messages.ready_key(rank), timeout_s=_POLL_S)
            except TensorwireError:
                return  # not yet: the caller looks at the calls first
            self.ready.add(rank)

    def decide(self, failure: str | None, *, lost_trainer: int | None = None) -> None:
        """Commit when no ``failure`` and every receiver is ready; abort on a failure
        (``lost_trainer``: the channel rank of a trainer that died or stalled, -1 unknown)."""
        if self.decision is not None:
            return
        if failure is None and len(self.ready) < len(self.receivers):
            return
        if failure is None:
            self.decision = COMMIT
        elif lost_trainer is None:
            self.decision = (messages.ABORT_PREFIX + failure.encode())[: messages.MAX_REASON_NBYTES]
        else:
            self.decision = messages.lost_trainer_decision(lost_trainer, failure)
        agent = runtime_agent()
        waits: list[Callable[[], None]] = []
        for peer in self.receivers.values():
            with contextlib.suppress(TensorwireError):  # a dead receiver: its call shows it
                waits.append(
                    agent.rendezvous_push_async(
                        peer_from_bytes(peer), self.channel, DECISION_KEY, self.decision, timeout_s=self.timeout_s
                    )
                )
        for wait in waits:
            with contextlib.suppress(TensorwireError):
                wait()

    @property
    def committed(self) -> bool:
        return self.decision == COMMIT


def first_failure(outcomes: Sequence[tuple[str, calls.Outcome]]) -> str | None:
    """The first (who, outcome) that failed or died, as text; None when none did."""
    for who, outcome in outcomes:
        if not outcome.ok:
            return f"{who} {'died' if outcome.failure is calls.CallFailure.ACTOR_DIED else 'failed'}: {outcome.reason}"
    return None


def ended_early(
    members: dict[Any, str], done: Sequence[Any], trainers: Sequence[Any], *, timeout_s: float
) -> tuple[str | None, int | None]:
    """Why a push cannot commit, from the calls (``members``: call -> who; ``trainers``: the
    trainers' calls in rank order) that ended before the decision: a member that failed or
    died, or a receiver that ended without committing; and the rank of the trainer that was
    lost, if that is why (-1: a receiver lost one, which is not known here; None: not that)."""
    outcomes = [(ref, members[ref], calls.settle(ref, timeout_s=timeout_s)) for ref in done]
    for ref, who, outcome in outcomes:
        if outcome.ok:
            continue
        lost = None
        if outcome.failure is calls.CallFailure.ACTOR_DIED and ref in trainers:
            lost = trainers.index(ref)
        elif isinstance(outcome.error, TrainerLost):  # (Ray's error is also an instance of the call's own)
            lost = -1
        return first_failure([(who, outcome)]), lost
    for _ref, who, outcome in outcomes:
        if who.startswith("receiver") and not outcome.value.committed:
            return f"{who} ended without committing: {outcome.value.refused}", None
    return None, None
