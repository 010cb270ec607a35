"""Stall detection: a trainer that makes no progress for a receiver stalled, and is replaced.

A stalled trainer is a process that stopped (``SIGSTOP``, a debugger, a swapped-out host, a
hang), not only one that stopped sending. A receiver waiting for a trainer's next bucket
(:func:`..members.intake.next_message`, counting the time it spends waiting, not copying other
streams' buckets) waits at most the trainer's *patience* (:meth:`StallWatch.patience_s`), then:

* with an explicit ``stall_s``: the trainer stalled (no next bucket within ``stall_s``);
* by default (adaptive): it looks whether the trainer's process can act
  (:meth:`~tensorwire.collectives.groups.channel.Channel.responds`: on this machine alive and
  not stopped; on another node its agent answers a ping). One that cannot stalled; one that can
  is slow, not stalled, and the receiver waits on, up to :data:`RESPONSIVE_LIMIT_FRACTION` of
  ``timeout_s`` for one bucket (a process that runs but never sends: a stuck collective).

The adaptive patience is :data:`PATIENCE_BUCKETS` times the longest gap between two of the
trainer's buckets seen so far in this push, and at least :data:`PATIENCE_FLOOR_S` for a trainer
on another node (a ping answered late is not proof), :data:`PATIENCE_FLOOR_SAME_MACHINE_S` for one
on this machine (whether it is stopped is read exactly from ``/proc``): a stopped trainer is found
within that plus one bucket time, a trainer slowed down by a loaded machine is not declared
stalled.

The receiver then tells the driver (:func:`report_stall`) and goes on reading its other
trainers; the driver, polling while the push runs (:func:`stalled`), treats the trainer as
lost and replaces it like a dead one (:mod:`.failover`). A stalled trainer's call is left
running (Ray cannot interrupt it); whatever it does later goes to a push that is over and is
dropped. The driver does not wait for a trainer whose bytes every receiver has
(:mod:`..commit.push_wait`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from tensorwire.collectives.weight_sync.protocol.messages import died_key, stalled_key
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.errors import TensorwireError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.transport.agent.wire import peer_from_bytes

__all__ = [
    "PATIENCE_BUCKETS",
    "PATIENCE_FLOOR_S",
    "PATIENCE_FLOOR_SAME_MACHINE_S",
    "RESPONSIVE_LIMIT_FRACTION",
    "StallWatch",
    "report_death",
    "report_stall",
    "reported_dead",
    "stalled",
]

PATIENCE_FLOOR_S = 3.0  # adaptive: the least time a receiver waits before it looks at a trainer on another node
PATIENCE_FLOOR_SAME_MACHINE_S = 0.5  # adaptive: the same for a trainer on this machine (an exact look)
PATIENCE_BUCKETS = 4  # adaptive: the patience in gaps between the trainer's buckets (the longest seen)
RESPONSIVE_LIMIT_FRACTION = 0.5  # adaptive: a trainer that can act but sends nothing stalls after this x timeout_s


class StallWatch:
    """A receiver's view of one trainer's progress in one push (see the module doc)."""

    def __init__(self, spec: PushSpec, *, same_machine: bool = False) -> None:
        self.explicit_s = spec.stall_s  # 0: adaptive
        self.floor_s = PATIENCE_FLOOR_SAME_MACHINE_S if same_machine else PATIENCE_FLOOR_S
        self.limit_s = RESPONSIVE_LIMIT_FRACTION * spec.timeout_s
        self._last = time.monotonic()
        self._longest_gap_s = 0.0

    def patience_s(self) -> float:
        """How long to wait for the next bucket before deciding."""
        if self.explicit_s:
            return self.explicit_s
        return max(self.floor_s, PATIENCE_BUCKETS * self._longest_gap_s)

    def arrived(self) -> None:
        """A bucket from the trainer came now."""
        now = time.monotonic()
        self._longest_gap_s = max(self._longest_gap_s, now - self._last)
        self._last = now

    def stalled(self, waited_s: float, responds: bool) -> bool:
        """Whether the trainer stalled, after ``waited_s`` with no bucket (``responds``: its
        process can act)."""
        return bool(self.explicit_s) or not responds or waited_s >= self.limit_s


def report_stall(spec: PushSpec, trainer: int) -> None:
    """Receiver: tell the driver that trainer rank ``trainer`` stalled."""
    _tell_driver(spec, stalled_key(trainer))


def report_death(spec: PushSpec, trainer: int) -> None:
    """Receiver: tell the driver that trainer rank ``trainer``'s process exited."""
    _tell_driver(spec, died_key(trainer))


def _tell_driver(spec: PushSpec, key: str) -> None:
    if not spec.driver:
        return
    with contextlib.suppress(TensorwireError):  # the driver gone: the push is over anyway
        runtime_agent().rendezvous_push(
            peer_from_bytes(spec.driver), spec.channel, key, str(spec.rank).encode(), timeout_s=5.0
        )


def stalled(channel: str, trainers: int) -> dict[int, str]:
    """Driver: the trainer ranks (below ``trainers``) a receiver reported stalled -> that receiver's rank."""
    return _reported(channel, trainers, stalled_key)


def reported_dead(channel: str, trainers: int) -> dict[int, str]:
    """Driver: the trainer ranks a receiver saw exit -> that receiver's rank."""
    return _reported(channel, trainers, died_key)


def _reported(channel: str, trainers: int, key: Callable[[int], str]) -> dict[int, str]:
    agent = runtime_agent()
    found = {}
    for rank in range(trainers):
        with contextlib.suppress(TensorwireError):
            found[rank] = agent.rendezvous_get(channel, key(rank), timeout_s=0.0).decode(errors="replace")
    return found
