"""The holder outbox against a scripted owner: order, numbering, retries, giving up."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import grpc
import pytest

from tensorwire.transport.base import PeerInfo
from tensorwire.transport.outbox import Outbox
from tensorwire.transport.wire import HolderOpKind


class _Silence(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED


class _Owners:
    """Owners that apply numbered batches as ``Holders.receive`` does, each answering only
    while its ``answers`` event is set (else the call fails as if it timed out)."""

    def __init__(self, *names: str) -> None:
        self.answers = {name: threading.Event() for name in names}
        self.applied: dict[str, list[bytes]] = {name: [] for name in names}
        self.calls: dict[str, int] = dict.fromkeys(names, 0)
        self._last_seq = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def call_async(self, address, method, message, reply_type, *, timeout_s):
        assert (method, reply_type) == ("Holders", "HolderReply") and timeout_s > 0
        future: Future = Future()
        with self._lock:
            self.calls[address] += 1
            if not self.answers[address].is_set():
                future.set_exception(_Silence())
                return future
            if message.seq > self._last_seq[address]:
                self._last_seq[address] = message.seq
                self.applied[address].extend(op.object_id for op in message.ops)
        future.set_result(None)
        return future


def _peer(name: str) -> PeerInfo:
    return PeerInfo(agent_id=name, node_id="n", machine_id="m", hostname="h", pid=1, start_time=0)


def _outbox(owners: _Owners, *, alive=lambda peer: True, retry_for_s=lambda peer: 60.0) -> Outbox:
    return Outbox(
        owners, sender=lambda: None, address=lambda peer: peer.agent_id, may_be_alive=alive,
        retry_for_s=retry_for_s, rpc_timeout_s=10.0,
    )  # fmt: skip


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _ops(outbox: Outbox, owner: str, ids: range) -> list[bytes]:
    sent = [i.to_bytes(4, "big") for i in ids]
    for object_id in sent:
        outbox.send(_peer(owner), HolderOpKind.RELEASE, object_id, b"t")
    return sent


def test_a_silent_owner_gets_every_message_once_in_order_when_it_answers_and_others_go_on():
    owners = _Owners("slow", "fast")
    owners.answers["fast"].set()
    outbox = _outbox(owners)
    try:
        first = _ops(outbox, "slow", range(0, 5))
        _wait_for(lambda: owners.calls["slow"] >= 3)  # tried and retried
        later = _ops(outbox, "slow", range(5, 9))  # they wait behind the unanswered batch
        fast = _ops(outbox, "fast", range(100, 103))
        _wait_for(lambda: owners.applied["fast"] == fast)  # not held up by the silent owner
        assert owners.applied["slow"] == [] and not outbox.flush(timeout_s=0.2)
        owners.answers["slow"].set()
        assert outbox.flush(timeout_s=30)
        assert owners.applied["slow"] == first + later
    finally:
        outbox.close()


def test_an_owner_on_another_machine_is_given_up_after_its_time(caplog):
    owners = _Owners("gone")
    outbox = _outbox(owners, retry_for_s=lambda peer: 0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="tensorwire.transport.outbox"):
            _ops(outbox, "gone", range(3))
            assert outbox.flush(timeout_s=30)
        assert owners.calls["gone"] >= 2 and owners.applied["gone"] == []
        assert "could not deliver 3 holder messages to agent gone: no answer for" in caplog.text
        owners.answers["gone"].set()  # it comes back: later messages are delivered, numbered anew
        again = _ops(outbox, "gone", range(10, 12))
        assert outbox.flush(timeout_s=30) and owners.applied["gone"] == again
    finally:
        outbox.close()


def test_an_exited_owner_is_not_retried():
    owners = _Owners("exited")
    outbox = _outbox(owners, alive=lambda peer: False)
    try:
        _ops(outbox, "exited", range(4))
        assert outbox.flush(timeout_s=30)
        assert owners.calls["exited"] == 1
    finally:
        outbox.close()


@pytest.mark.parametrize("queued_after_close", [False, True])
def test_close_gives_up_what_is_left_and_flush_returns(queued_after_close):
    owners = _Owners("silent")
    outbox = _outbox(owners)
    _ops(outbox, "silent", range(3))
    _wait_for(lambda: owners.calls["silent"] >= 1)
    outbox.close()
    if queued_after_close:
        _ops(outbox, "silent", range(3, 5))
    assert outbox.flush(timeout_s=30)
    assert owners.applied["silent"] == []
