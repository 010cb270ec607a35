"""How a two-sided transfer names a failed operation: the owner gone says why, an owner still
serving the object leaves the transport's own error. A fake transport whose receives fail."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from tensorwire.errors import ObjectFreedError, OwnerDiedError, TransferTimeoutError, TransportError
from tensorwire.transport.contract import FetchRequest, PeerInfo, TensorMeta
from tensorwire.transport.two_sided import _POSTED, PostedOps, TwoSidedTransport

ME = PeerInfo(agent_id="me", node_id="n", machine_id="m", hostname="h", pid=1, start_time=1)
OWNER = replace(ME, agent_id="owner", pid=2)


class _Context:
    def __init__(self, owner_error: Exception | None) -> None:
        self.peer = ME
        self.owner_error = owner_error
        self.checks = 0

    def open_stream(self, request, transport, params):
        return iter([_POSTED])

    def check_owner(self, request) -> None:
        self.checks += 1
        if self.owner_error is not None:
            raise self.owner_error

    def peer_may_be_alive(self, peer) -> bool:
        return True


class _Failed(PostedOps):
    def poll(self) -> bool:
        raise TransportError("fake operation failed: Connection reset by remote peer")

    def abort(self) -> None:
        pass


class _FailingReceives(TwoSidedTransport):
    name = "fake-two-sided"
    capabilities = None

    def __init__(self, context) -> None:
        super().__init__(context)
        self.closed: list[str] = []
        self.died: list[str] = []

    def open_connection(self, peer, key, deadline, scope):
        return "state"

    def accept_connection(self, peer, payload):
        raise AssertionError("not used")

    def post_sends(self, connection, tags, buffers):
        raise AssertionError("not used")

    def post_recvs(self, connection, tags, buffers):
        return _Failed()

    def close_connection(self, connection) -> None:
        self.closed.append(connection.peer.agent_id)

    def peer_died_mid_transfer(self, connection) -> None:
        self.died.append(connection.peer.agent_id)


def _fetch(transport: _FailingReceives) -> None:
    meta = TensorMeta(shape=(1024,), dtype="uint8", device="cpu", nbytes=1024, offset=0)
    request = FetchRequest(b"o" * 16, b"t" * 16, OWNER, (meta,), 1024, None, time.monotonic() + 30)
    transport.fetch(request, [torch.empty(1024, dtype=torch.uint8)])


def test_a_failed_receive_from_an_owner_that_died_raises_owner_died_and_drops_the_connection():
    died = OwnerDiedError("the owner of this object has exited")
    context = _Context(died)
    transport = _FailingReceives(context)
    with pytest.raises(OwnerDiedError) as caught:
        _fetch(transport)
    assert caught.value is died and context.checks == 1
    assert "Connection reset" in str(caught.value.__cause__)  # the operation that failed is the cause
    assert transport.closed == ["owner"] and transport.died == ["owner"] and transport.connections() == 0
    transport.close()


def test_a_failed_receive_from_an_owner_that_freed_the_object_raises_object_freed():
    transport = _FailingReceives(_Context(ObjectFreedError("freed by its owner")))
    with pytest.raises(ObjectFreedError):
        _fetch(transport)
    assert transport.died == []  # the owner lives: other transfers with it are not reset
    transport.close()


def test_a_failed_receive_from_a_live_owner_keeps_the_transport_error():
    context = _Context(None)
    transport = _FailingReceives(context)
    with pytest.raises(TransportError, match="Connection reset") as caught:
        _fetch(transport)
    assert type(caught.value) is TransportError and context.checks == 1
    assert transport.closed == ["owner"] and transport.connections() == 0
    transport.close()


def test_an_owner_that_cannot_say_leaves_the_transport_error():
    """The owner's status call timing out (an owner slow to answer) explains nothing."""
    context = _Context(TransferTimeoutError("status of the object: no answer within 0.05 s"))
    transport = _FailingReceives(context)
    with pytest.raises(TransportError, match="Connection reset") as caught:
        _fetch(transport)
    assert type(caught.value) is TransportError and context.checks == 1
    transport.close()
