"""Stall detection: a trainer that sends a receiver no next bucket within ``stall_s`` stalled.

A receiver waiting for a trainer's next bucket gives up after ``stall_s`` (the wait in
:func:`..members.intake.next_bucket`), tells the driver (:func:`report_stall`) and goes on
reading its other trainers; the driver, polling while the push runs (:func:`stalled`), treats
the trainer as lost and replaces it like a dead one (:mod:`.failover`). A stalled trainer's
call is left running (Ray cannot interrupt it); whatever it does later goes to a push that is
over and is dropped.
"""

from __future__ import annotations

import contextlib

from tensorwire.collectives.weight_sync.protocol.messages import stalled_key
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.errors import TensorwireError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.transport.agent.wire import peer_from_bytes

__all__ = ["report_stall", "stalled"]


def report_stall(spec: PushSpec, trainer: int) -> None:
    """Receiver: tell the driver that trainer rank ``trainer`` sent no next bucket for ``stall_s``."""
    if not spec.driver:
        return
    with contextlib.suppress(TensorwireError):  # the driver gone: the push is over anyway
        runtime_agent().rendezvous_push(
            peer_from_bytes(spec.driver), spec.channel, stalled_key(trainer), str(spec.rank).encode(), timeout_s=5.0
        )


def stalled(channel: str, trainers: int) -> dict[int, str]:
    """Driver: the trainer ranks (below ``trainers``) a receiver reported stalled -> that receiver's rank."""
    agent = runtime_agent()
    found = {}
    for rank in range(trainers):
        with contextlib.suppress(TensorwireError):
            found[rank] = agent.rendezvous_get(channel, stalled_key(rank), timeout_s=0.0).decode(errors="replace")
    return found
