"""The control service: cluster token, socket permissions, malformed input, no unpickling."""

from __future__ import annotations

import os
import pathlib
import stat

import grpc
import pytest

from tensorwire.transport.agent.control import _SERVICE, _TOKEN_METADATA, cluster_token
from tensorwire.transport.agent.wire import messages
from tensorwire.transport.config import socket_dir
from tests.helpers.observe import wait_until


def _raw_call(address: str, method: str, payload: bytes, token: bytes | None):
    channel = grpc.insecure_channel(address)
    try:
        stub = channel.unary_unary(f"/{_SERVICE}/{method}", request_serializer=None, response_deserializer=None)
        metadata = ((_TOKEN_METADATA, token.decode()),) if token is not None else ()
        return stub(payload, timeout=5, metadata=metadata)
    finally:
        channel.close()


def _ping(agent, token: bytes | None):
    return messages["PingReply"].FromString(
        _raw_call(agent.peer.unix_address, "Ping", messages["PingRequest"]().SerializeToString(), token)
    )


def test_cluster_token_gates_every_call(agent):
    assert _ping(agent, cluster_token()).peer.agent_id == agent.peer.agent_id
    for token in (None, b"wrong-token"):
        with pytest.raises(grpc.RpcError) as info:
            _ping(agent, token)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


METHODS = ("Holders", "Status", "Free", "Export", "Ping", "Connect", "Rendezvous", "Transfer")


def _code_and_details(agent, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """The status a call ends with (a ``Transfer`` stream is read to its end)."""
    channel = grpc.insecure_channel(agent.peer.unix_address)
    try:
        kind = channel.unary_stream if method == "Transfer" else channel.unary_unary
        stub = kind(f"/{_SERVICE}/{method}", request_serializer=None, response_deserializer=None)
        answer = stub(payload, timeout=5, metadata=((_TOKEN_METADATA, cluster_token().decode()),))
        if method == "Transfer":
            list(answer)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()
    finally:
        channel.close()


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\xff", b"\x0a\x10short"])
def test_unparsable_requests_are_rejected_before_any_handler_and_the_agent_lives(agent, payload):
    for method in METHODS:
        assert _code_and_details(agent, method, payload) == (
            grpc.StatusCode.INTERNAL,
            "Exception deserializing request!",
        ), method
    assert _ping(agent, cluster_token()).peer.agent_id == agent.peer.agent_id


def test_well_formed_but_invalid_requests_get_their_named_status(agent):
    import torch

    import tensorwire as tw

    ref = tw.put(torch.arange(100_000))
    unknown = messages["TransferRequest"](object_id=b"\x01" * 16, token=b"\x02" * 16, transport="host")
    wrong_token = messages["TransferRequest"](object_id=ref._desc.object_id, token=b"\x02" * 16, transport="host")
    cases = {
        ("Export", unknown.SerializeToString()): grpc.StatusCode.NOT_FOUND,
        ("Transfer", unknown.SerializeToString()): grpc.StatusCode.NOT_FOUND,
        ("Export", wrong_token.SerializeToString()): grpc.StatusCode.PERMISSION_DENIED,
        ("Transfer", wrong_token.SerializeToString()): grpc.StatusCode.PERMISSION_DENIED,
        ("Connect", messages["ConnectRequest"]().SerializeToString()): grpc.StatusCode.INVALID_ARGUMENT,
        ("Rendezvous", messages["RendezvousRequest"]().SerializeToString()): grpc.StatusCode.INVALID_ARGUMENT,
    }
    got = {case: _code_and_details(agent, *case)[0] for case in cases}
    assert got == cases
    assert tw.get(ref).sum() == sum(range(100_000))  # the object and the agent are fine


def test_holder_ops_with_wrong_tokens_are_rejected(agent):
    import torch

    import tensorwire as tw

    ref = tw.put(torch.ones(10))
    op = messages["HolderOp"](kind=2, object_id=ref._desc.object_id, token=b"x" * 16)
    batch = messages["HolderBatch"](ops=[op]).SerializeToString()
    reply = messages["HolderReply"].FromString(_raw_call(agent.peer.unix_address, "Holders", batch, cluster_token()))
    assert (reply.applied, reply.rejected) == (0, 1)
    assert tw.get(ref).sum() == 10


def test_socket_is_private_and_tcp_not_on_all_interfaces(agent):
    path = agent.peer.unix_address.removeprefix("unix:")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert not agent.peer.tcp_address.startswith(("0.0.0.0", "[::]"))


def test_socket_dir_refuses_a_shared_directory_made_once_checked_always(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    shared = tmp_path / f"tensorwire-{os.getuid()}"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        socket_dir()
    shared.chmod(0o700)
    assert socket_dir() == str(shared)
    monkeypatch.setattr(os, "makedirs", lambda *a, **k: pytest.fail("made again"))
    assert socket_dir() == str(shared)  # every export asks: made once per process
    shared.chmod(0o755)  # changed (or replaced) since: refused again
    with pytest.raises(PermissionError, match="mode 0700"):
        socket_dir()


def test_transport_layer_never_unpickles():
    root = pathlib.Path(__file__).resolve().parents[3] / "tensorwire" / "transport"
    offenders = [
        f"{p.name}:{i}"
        for p in root.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if any(
            word in line for word in ("pickle.load", "pickle.loads", "cloudpickle.load", "Unpickler", "marshal.load")
        )
    ]
    assert offenders == []


def test_call_on_a_channel_closed_by_another_thread_reconnects(agent):
    """``close`` may close a channel another thread is about to use."""
    from tensorwire.transport.agent.control import ControlClient

    client = ControlClient(token=cluster_token())
    try:
        address = agent.peer.unix_address
        ping = messages["PingRequest"]()
        assert client.call(address, "Ping", ping, "PingReply", timeout_s=5).peer.agent_id == agent.peer.agent_id
        client._channels[address].close()  # closed, but still cached for that thread, as in the race
        reply = client.call(address, "Ping", ping, "PingReply", timeout_s=5)
        assert reply.peer.agent_id == agent.peer.agent_id
        client._channels[address].close()
        future = client.call_async(address, "Ping", messages["PingRequest"](), "PingReply", timeout_s=5)
        assert future.result().peer.agent_id == agent.peer.agent_id
    finally:
        client.close()


def _transfer_error(agent, request) -> grpc.RpcError:
    from tensorwire.transport.agent.control import ControlClient

    client = ControlClient(token=cluster_token())
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(client.stream(agent.peer.unix_address, request, timeout_s=10))
        return info.value
    finally:
        client.close()


def test_handler_errors_cross_the_wire_as_the_same_tensorwire_class(agent):
    """A transport raises a tensorwire error; the server answers with the status of
    ``STATUS_OF``, and the client raises that class again (no text matching)."""
    import struct

    import torch

    import tensorwire as tw
    from tensorwire.errors import InvalidRequestError, TransportError, UnknownConnectionError
    from tensorwire.transport.agent.control import map_rpc_error

    ref = tw.put(torch.arange(100_000))
    desc = ref._desc
    stale = struct.pack("!16sIQ", b"\x07" * 16, 1, 5_000)  # a connection key this producer never made
    request = messages["TransferRequest"](object_id=desc.object_id, token=desc.token, transport="gloo", params=stale)
    error = _transfer_error(agent, request)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    mapped = map_rpc_error(error, "the transfer")
    assert type(mapped) is UnknownConnectionError
    assert str(mapped).startswith("the transfer: gloo: unknown connection 0707")

    request.params = b"short"
    mapped = map_rpc_error(_transfer_error(agent, request), "the transfer")
    assert type(mapped) is InvalidRequestError and isinstance(mapped, TransportError)
    assert "malformed transfer parameters (5 bytes, expected 28)" in str(mapped)
    assert tw.get(ref).sum() == sum(range(100_000))  # the object and the agent are fine


def test_a_late_or_repeated_holder_batch_is_dropped(agent):
    """A batch that timed out at its sender is retried under the same number, and the first
    call may still arrive, late, after the sender's later batches (seen under load: it
    registered a holder again after its release, and the object was never freed)."""
    import torch

    import tensorwire as tw
    from tensorwire.transport.agent.wire import HolderOpKind

    ref = tw.put(torch.arange(1000))
    object_id, token = ref._desc.object_id, ref._desc.token
    me = agent.peer
    sender = messages["Peer"](
        agent_id="late-sender",
        node_id=me.node_id,
        machine_id=me.machine_id,
        hostname=me.hostname,
        pid=os.getpid(),
        start_time=me.start_time,
    )

    def batch(kind: HolderOpKind, seq: int) -> tuple[int, int]:
        op = messages["HolderOp"](kind=int(kind), object_id=object_id, token=token)
        data = messages["HolderBatch"](sender=sender, ops=[op], seq=seq).SerializeToString()
        reply = messages["HolderReply"].FromString(_raw_call(me.unix_address, "Holders", data, cluster_token()))
        return reply.applied, reply.rejected

    entry = agent._store.get(object_id)
    assert batch(HolderOpKind.REGISTER, 1) == (1, 0) and "late-sender" in entry.holders
    assert batch(HolderOpKind.REGISTER, 1) == (0, 0)  # a retry of a batch that did arrive
    assert batch(HolderOpKind.RELEASE, 2) == (1, 0) and "late-sender" not in entry.holders
    assert batch(HolderOpKind.REGISTER, 1) == (0, 0)  # the first call, arriving last
    assert "late-sender" not in entry.holders
    assert batch(HolderOpKind.REGISTER, 0) == (1, 0) and "late-sender" in entry.holders  # unnumbered: applied
    assert batch(HolderOpKind.RELEASE, 0) == (1, 0)
    del ref
    assert agent._store.get(object_id) is None  # freed: nobody holds it


def test_a_dropped_channel_leaves_the_calls_still_on_it_running(agent):
    """A fetch whose connection dropped is retried on a new channel; the other fetches and
    holder messages still running on the old one must finish (closing it cancelled them all:
    ``CANCELLED`` seen under load)."""
    import zlib

    import torch

    import tensorwire as tw
    from tensorwire.transport.agent.control import ControlClient

    data = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    ref = tw.put(data)
    request = messages["TransferRequest"](object_id=ref._desc.object_id, token=ref._desc.token, transport="host")
    client = ControlClient(token=cluster_token())
    try:
        address = agent.peer.unix_address
        stream = client.stream(address, request, timeout_s=30)
        chunks = [next(stream)]
        old = client._channels[address]
        client.drop(address)  # as a retry on another thread does
        reply = client.call(address, "Ping", messages["PingRequest"](), "PingReply", timeout_s=5)
        assert not _closed(old)
        chunks.extend(stream)
        assert wait_until(lambda: _closed(old))  # closed once its last call ended, not left to the collector
        idle = client._channels[address]  # the new one, nothing running on it: closed at once
        client.drop(address)
        assert _closed(idle)
    finally:
        client.close()
    assert reply.peer.agent_id == agent.peer.agent_id
    assert len(chunks) > 1  # the drop came mid-stream
    received = b"".join(chunks)
    assert zlib.crc32(received) == zlib.crc32(data.numpy().tobytes())


def _closed(channel: grpc.Channel) -> bool:
    try:
        channel.unary_unary(f"/{_SERVICE}/NoSuchMethod")(b"", timeout=5)
    except ValueError:  # "Cannot invoke RPC on closed channel!"
        return True
    except grpc.RpcError:
        return False
    return False
