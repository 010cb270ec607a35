"""The holder outbox against scripted owners: order, numbering, retries, giving up."""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future

import grpc
import pytest

from tensorwire.transport.agent.outbox import Outbox
from tensorwire.transport.agent.wire import HolderOpKind
from tensorwire.transport.contract import PeerInfo


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _Owners:
    """Owners that apply numbered batches as ``Holders.receive`` does. Each answers after a
    moment on another thread, the way set by ``mode[name]``: "answer"; "silent" (nothing
    applied, the call times out); "lost" (applied, but the answer is lost: the call times out);
    "refuse" (``PERMISSION_DENIED``); "closed" (``UNAVAILABLE``: nobody listens)."""

    def __init__(self, **modes: str) -> None:
        self.mode = dict(modes)
        self.applied: dict[str, list[bytes]] = {name: [] for name in modes}
        self.tried: dict[str, list[int]] = {name: [] for name in modes}  # batch numbers, per call
        self.most_in_flight = dict.fromkeys(modes, 0)
        self._in_flight = dict.fromkeys(modes, 0)
        self._last_seq = dict.fromkeys(modes, 0)
        self._lock = threading.Lock()

    def calls(self, name: str) -> int:
        with self._lock:
            return len(self.tried[name])

    def call_async(self, address, method, message, reply_type, *, timeout_s):
        assert (method, reply_type) == ("Holders", "HolderReply") and timeout_s > 0
        with self._lock:
            self.tried[address].append(message.seq)
            self._in_flight[address] += 1
            self.most_in_flight[address] = max(self.most_in_flight[address], self._in_flight[address])
        future: Future = Future()
        threading.Timer(0.005, self._answer, (address, message, future)).start()
        return future

    def _answer(self, name, message, future: Future) -> None:
        with self._lock:
            self._in_flight[name] -= 1
            mode = self.mode[name]
            if mode in ("answer", "lost") and message.seq > self._last_seq[name]:
                self._last_seq[name] = message.seq
                self.applied[name].extend(op.object_id for op in message.ops)
        if mode == "answer":
            future.set_result(None)
        elif mode == "refuse":
            future.set_exception(_Failed(grpc.StatusCode.PERMISSION_DENIED))
        elif mode == "closed":
            future.set_exception(_Failed(grpc.StatusCode.UNAVAILABLE))
        else:
            future.set_exception(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED))


def _peer(name: str) -> PeerInfo:
    return PeerInfo(agent_id=name, node_id="n", machine_id="m", hostname="h", pid=1, start_time=0)


def _outbox(owners: _Owners, *, alive=lambda peer: True, retry_for_s=lambda peer: 60.0, sender=lambda: None):
    return Outbox(
        owners,
        sender=sender,
        address=lambda peer: peer.agent_id,
        may_be_alive=alive,
        retry_for_s=retry_for_s,
        rpc_timeout_s=10.0,
    )


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _ops(outbox: Outbox, owner: str, ids: range) -> list[bytes]:
    sent = [i.to_bytes(4, "big") for i in ids]
    for object_id in sent:
        outbox.send(_peer(owner), HolderOpKind.RELEASE, object_id, b"t")
    return sent


def _given_up(caplog, owner: str) -> int:
    pattern = re.compile(rf"could not deliver (\d+) holder messages to agent {owner}:")
    return sum(int(m.group(1)) for r in caplog.records if (m := pattern.match(r.getMessage())))


def test_a_silent_owner_gets_every_message_once_in_order_when_it_answers_and_others_go_on():
    owners = _Owners(slow="silent", fast="answer")
    outbox = _outbox(owners)
    try:
        first = _ops(outbox, "slow", range(0, 5))
        _wait_for(lambda: owners.calls("slow") >= 3)  # tried and tried again
        later = _ops(outbox, "slow", range(5, 9))  # they wait behind the unanswered batch
        fast = _ops(outbox, "fast", range(100, 103))
        _wait_for(lambda: owners.applied["fast"] == fast)  # not held up by the silent owner
        assert owners.applied["slow"] == [] and not outbox.flush(timeout_s=0.2)
        owners.mode["slow"] = "answer"
        assert outbox.flush(timeout_s=60)
        assert owners.applied["slow"] == first + later
        assert owners.most_in_flight["slow"] == 1  # one batch on its way at a time
        assert owners.tried["slow"] == sorted(owners.tried["slow"])  # a retry keeps its number
    finally:
        outbox.close()


def test_an_answer_lost_after_the_owner_applied_is_retried_and_counts_once():
    owners = _Owners(owner="lost")
    outbox = _outbox(owners)
    try:
        sent = _ops(outbox, "owner", range(6))
        _wait_for(lambda: owners.calls("owner") >= 3)
        owners.mode["owner"] = "answer"
        assert outbox.flush(timeout_s=60)
        assert owners.applied["owner"] == sent  # applied by the first call, the retries dropped
        assert len(set(owners.tried["owner"])) < len(owners.tried["owner"])  # it was retried
    finally:
        outbox.close()


def test_an_owner_on_another_machine_is_given_up_after_its_time(caplog):
    owners = _Owners(gone="silent")
    outbox = _outbox(owners, retry_for_s=lambda peer: 0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="tensorwire.transport.agent.outbox"):
            _ops(outbox, "gone", range(3))
            assert outbox.flush(timeout_s=60)
        assert owners.calls("gone") >= 2 and owners.applied["gone"] == []
        assert _given_up(caplog, "gone") == 3
        assert "no answer for" in caplog.text
        owners.mode["gone"] = "answer"  # it comes back: later messages are delivered, numbered anew
        again = _ops(outbox, "gone", range(10, 12))
        assert outbox.flush(timeout_s=60) and owners.applied["gone"] == again
    finally:
        outbox.close()


@pytest.mark.parametrize("case", ["exited", "refused"])
def test_an_exited_or_refusing_owner_is_not_retried(case, caplog):
    owners = _Owners(owner="refuse" if case == "refused" else "silent")
    outbox = _outbox(owners, alive=lambda peer: case != "exited")
    try:
        with caplog.at_level(logging.WARNING, logger="tensorwire.transport.agent.outbox"):
            _ops(outbox, "owner", range(4))
            assert outbox.flush(timeout_s=60)
        tried = owners.tried["owner"]
        assert 1 <= len(tried) <= 4  # no batch tried again (the 4 may have gone in up to 4 batches)
        if case == "refused":
            assert len(set(tried)) == len(tried)
        assert _given_up(caplog, "owner") == (4 if case == "refused" else 0)  # an exited owner needs none
    finally:
        outbox.close()


def test_a_failing_step_gives_up_that_batch_and_the_sender_lives_on(caplog):
    owners = _Owners(owner="answer")
    failures = [RuntimeError("a bug")]

    def sender():
        if failures:
            raise failures.pop()

    outbox = _outbox(owners, sender=sender)
    try:
        with caplog.at_level(logging.WARNING, logger="tensorwire.transport.agent.outbox"):
            _ops(outbox, "owner", range(3))
            assert outbox.flush(timeout_s=60)
        assert "holder messages to agent owner failed; giving them up" in caplog.text
        later = _ops(outbox, "owner", range(3, 5))
        assert outbox.flush(timeout_s=60) and owners.applied["owner"][-2:] == later
    finally:
        outbox.close()


def test_close_stops_the_sender_gives_up_what_is_left_and_sends_nothing_after():
    owners = _Owners(owner="silent")
    outbox = _outbox(owners)
    _ops(outbox, "owner", range(3))
    _wait_for(lambda: owners.calls("owner") >= 1)
    outbox.close()
    outbox._thread.join(30)
    assert not outbox._thread.is_alive()
    assert outbox.flush(timeout_s=5)  # nothing counted as pending any more
    calls = owners.calls("owner")
    owners.mode["owner"] = "answer"
    _ops(outbox, "owner", range(3, 5))
    assert outbox.flush(timeout_s=5)
    time.sleep(0.1)
    assert owners.calls("owner") == calls and owners.applied["owner"] == []


def test_an_owner_whose_socket_refuses_connections_is_given_up_though_its_pid_lives(monkeypatch, caplog):
    """A SIGKILLed agent leaves its socket file and, until reaped, its pid: retrying it for ever
    made every flush wait its whole timeout (a Ray actor's ``wait_tensor_freed`` stalled)."""
    import tensorwire.transport.agent.outbox as outbox_module

    monkeypatch.setattr(outbox_module, "_REFUSED_S", 0.5)
    owners = _Owners(dead="closed")
    outbox = _outbox(owners, retry_for_s=lambda peer: float("inf"))
    try:
        with caplog.at_level(logging.WARNING, logger="tensorwire.transport.agent.outbox"):
            _ops(outbox, "dead", range(3))
            assert outbox.flush(timeout_s=60)
        assert owners.calls("dead") >= 2 and _given_up(caplog, "dead") == 3
    finally:
        outbox.close()
