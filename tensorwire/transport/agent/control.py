"""The control service: a small gRPC server per agent, and the client other agents use.

The server listens on a Unix socket (mode 0600, in a per-user 0700 directory) for peers on
the same node and on TCP (``Config.host``, never 0.0.0.0 by default) for other nodes. Every
call must carry the cluster token in its metadata; requests are protobuf messages
(:mod:`tensorwire.transport.agent.wire`) and nothing received is unpickled. Every client call has
a deadline.

Errors cross the wire in one place, :data:`STATUS_OF`: a handler (or a transport serving a
request) raises a tensorwire error; the server answers with that error's status and names its
class in the trailing metadata; the client raises the same class again
(:func:`map_rpc_error`). Statuses that gRPC itself makes (unreachable, deadline, cancelled)
map to the tensorwire error of what happened.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Protocol

import grpc

from tensorwire.errors import (
    InvalidRequestError,
    ObjectFreedError,
    PeerLostError,
    PermissionDeniedError,
    TensorwireError,
    TransferAbortedError,
    TransferTimeoutError,
    TransportError,
    UnknownConnectionError,
)
from tensorwire.transport.agent.wire import messages

__all__ = [
    "STATUS_OF",
    "ControlClient",
    "ControlHandler",
    "ControlServer",
    "cluster_token",
    "map_rpc_error",
    "status_of",
]

logger = logging.getLogger(__name__)

CLUSTER_TOKEN_ENV = "TENSORWIRE_CLUSTER_TOKEN"
_TOKEN_METADATA = "tw-cluster-token"
_ERROR_METADATA = "tw-error"  # the class (of STATUS_OF) of the error a handler raised
_SERVICE = "tensorwire.control.v1.Control"
_MAX_MESSAGE_NBYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_NBYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_NBYTES),
    ("grpc.enable_retries", 1),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]
# A client channel has its own connections: channels to one address share them otherwise, and
# the new channel ``drop`` leads to would share the old one's failed connection (and its
# reconnect back-off) while calls still run on the old one.
_CLIENT_CHANNEL_OPTIONS = [*_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


def cluster_token() -> bytes:
    """The secret that gates every connection between agents.

    ``TENSORWIRE_CLUSTER_TOKEN`` if set (the Ray runtime sets it for its workers; standalone
    processes on several machines must share it), else a per-user token kept in
    ``$XDG_CONFIG_HOME/tensorwire/cluster_token`` (mode 0600), created on first use.
    """
    from_env = os.environ.get(CLUSTER_TOKEN_ENV, "").strip()
    if from_env:
        return from_env.encode()
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    directory = os.path.join(config_home, "tensorwire")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, "cluster_token")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=directory)  # created 0600
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.close(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # atomic: the first process wins, the others read its token
        finally:
            os.unlink(tmp)
    with open(path, "rb") as f:
        return f.read().strip()


class ControlHandler(Protocol):
    """What the agent implements; called on the server's threads."""

    def handle_ping(self, request: Any) -> Any: ...
    def handle_status(self, request: Any) -> Any: ...
    def handle_holders(self, request: Any) -> Any: ...
    def handle_free(self, request: Any) -> Any: ...
    def handle_export(self, request: Any) -> Any: ...
    def handle_transfer(self, request: Any) -> Iterator[bytes]: ...
    def handle_connect(self, request: Any) -> Any: ...
    def handle_rendezvous(self, request: Any) -> Any: ...


# The one mapping of tensorwire errors to gRPC statuses, most specific first: a handler raises
# the error, the server answers with its status, the client raises that class again.
STATUS_OF: tuple[tuple[type[TensorwireError], grpc.StatusCode], ...] = (
    (UnknownConnectionError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ObjectFreedError, grpc.StatusCode.NOT_FOUND),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (TransferAbortedError, grpc.StatusCode.ABORTED),
    (TensorwireError, grpc.StatusCode.FAILED_PRECONDITION),  # any other: the request could not be served
)
_NAMED = {cls.__name__: cls for cls, _code in STATUS_OF if cls is not TensorwireError}


def status_of(error: TensorwireError) -> tuple[grpc.StatusCode, str]:
    """The status a handler's ``error`` is answered with, and the class name the client sees."""
    for cls, code in STATUS_OF:
        if isinstance(error, cls):
            return code, cls.__name__
    raise AssertionError("unreachable: TensorwireError is the last entry")  # pragma: no cover


def _abort(context: grpc.ServicerContext, error: TensorwireError) -> None:
    """Answer the call with ``error``'s status (raises, as ``context.abort`` does)."""
    code, name = status_of(error)
    context.set_trailing_metadata(((_ERROR_METADATA, name),))
    context.abort(code, str(error))


def _identity(data: bytes) -> bytes:
    return data


class ControlServer:
    """The gRPC server of one agent. ``start()`` binds; ``stop()`` closes and removes the socket."""

    def __init__(self, handler: ControlHandler, *, token: bytes, unix_path: str, tcp_host: str) -> None:
        self._handler = handler
        self._token = token
        self._unix_path = unix_path
        self._tcp_host = tcp_host
        self._server: grpc.Server | None = None
        self.unix_address = ""
        self.tcp_address = ""

    def start(self) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="tensorwire-control"),
            options=_CHANNEL_OPTIONS,
        )
        unary = {
            "Ping": (self._handler.handle_ping, "PingRequest", "PingReply"),
            "Status": (self._handler.handle_status, "ObjectRequest", "StatusReply"),
            "Holders": (self._handler.handle_holders, "HolderBatch", "HolderReply"),
            "Free": (self._handler.handle_free, "ObjectRequest", "StatusReply"),
            "Export": (self._handler.handle_export, "TransferRequest", "ExportReply"),
            "Connect": (self._handler.handle_connect, "ConnectRequest", "ConnectReply"),
            "Rendezvous": (self._handler.handle_rendezvous, "RendezvousRequest", "RendezvousReply"),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self._guard_unary(fn),
                request_deserializer=messages[req].FromString,
                response_serializer=messages[rep].SerializeToString,
            )
            for name, (fn, req, rep) in unary.items()
        }
        handlers["Transfer"] = grpc.unary_stream_rpc_method_handler(
            self._guard_stream(self._handler.handle_transfer),
            request_deserializer=messages["TransferRequest"].FromString,
            response_serializer=_identity,  # raw data chunks: copied, never interpreted
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._unix_path)
        if server.add_insecure_port(f"unix:{self._unix_path}") == 0:
            raise OSError(f"could not bind the control service to unix socket {self._unix_path}")
        port = server.add_insecure_port(f"{self._tcp_host}:0")
        if port == 0:
            raise OSError(f"could not bind the control service to TCP {self._tcp_host}:0; set TENSORWIRE_HOST")
        server.start()
        os.chmod(self._unix_path, 0o600)
        self._server = server
        self.unix_address = f"unix:{self._unix_path}"
        self.tcp_address = f"{self._tcp_host}:{port}"

    def stop(self, grace_s: float = 0.5) -> None:
        if self._server is not None:
            self._server.stop(grace_s)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._unix_path)

    def _authorized(self, context: grpc.ServicerContext) -> bool:
        for key, value in context.invocation_metadata():
            if key == _TOKEN_METADATA:
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._token)
        return False

    def _guard_unary(self, fn: Callable[[Any], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def method(request: Any, context: grpc.ServicerContext) -> Any:
            if not self._authorized(context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing cluster token")
            try:
                return fn(request)
            except TensorwireError as e:
                _abort(context, e)

        return method

    def _guard_stream(self, fn: Callable[[Any], Iterator[bytes]]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def method(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
            if not self._authorized(context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing cluster token")
            try:
                for chunk in fn(request):
                    if not context.is_active():
                        return
                    yield chunk
            except TensorwireError as e:
                _abort(context, e)
            except Exception as e:
                logger.warning("serving a transfer failed: %s", e, exc_info=True)
                context.abort(grpc.StatusCode.INTERNAL, f"producer failed while serving: {type(e).__name__}: {e}")

        return method


def map_rpc_error(error: grpc.RpcError, what: str) -> Exception:
    """The tensorwire error for a failed control call (``what`` names the call for the message)."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    named = _NAMED.get(_error_name(error))
    if named is not None:  # raised by the peer's handler: the same class here
        return named(f"{what}: {details}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return PermissionDeniedError(f"{what}: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return ObjectFreedError(f"{what}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeoutError(f"{what}: no answer before the deadline ({details})")
    if code == grpc.StatusCode.UNAVAILABLE:
        return PeerLostError(f"{what}: peer unreachable ({details})")
    if code == grpc.StatusCode.CANCELLED:
        return TransferAbortedError(f"{what}: cancelled ({details})")
    return TransportError(f"{what}: {code.name if code else 'error'}: {details}")


def _error_name(error: grpc.RpcError) -> str:
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == _ERROR_METADATA:
            return value if isinstance(value, str) else value.decode()
    return ""


class ControlClient:
    """Calls other agents' control services; one cached channel per address."""

    def __init__(self, *, token: bytes) -> None:
        self._metadata = ((_TOKEN_METADATA, token.decode()),)
        self._channels: dict[str, grpc.Channel] = {}
        self._running: dict[grpc.Channel, int] = {}  # calls not ended yet, per channel
        self._retired: set[grpc.Channel] = set()  # dropped, closed when their last call ends
        self._lock = threading.Lock()

    def _acquire(self, address: str) -> grpc.Channel:
        """The channel to ``address`` (made on first use), counted for one more running call."""
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=_CLIENT_CHANNEL_OPTIONS)
                self._channels[address] = channel
            self._running[channel] = self._running.get(channel, 0) + 1
            return channel

    def _ended(self, channel: grpc.Channel) -> None:
        with self._lock:
            left = self._running.pop(channel) - 1
            if left:
                self._running[channel] = left
                return
            if channel not in self._retired:
                return
            self._retired.discard(channel)
        # not on the gRPC thread that ran this callback
        threading.Thread(target=channel.close, name="tensorwire-channel-close", daemon=True).start()

    def drop(self, address: str) -> None:
        """Forget the channel to ``address`` (after a lost connection): the next call connects
        afresh. The channel is closed when the last call still on it ends: closing cancels
        every call on a channel, and other threads' fetches and holder messages to the same
        peer ended ``CANCELLED`` (seen under load). Nor is it left open to the garbage
        collector."""
        with self._lock:
            channel = self._channels.pop(address, None)
            if channel is None:
                return
            if channel in self._running:
                self._retired.add(channel)
                return
        channel.close()

    def _invoke(self, address: str, start: Callable[[grpc.Channel], Any]) -> Any:
        """``start(channel)``, a call counted on its channel until it ends (its future is
        returned); if :meth:`close` closed that channel meanwhile (another thread), once more
        on a fresh one."""
        for attempt in (1, 2):
            channel = self._acquire(address)
            try:
                call = start(channel)
            except ValueError:  # "Cannot invoke RPC: Channel closed!"
                self._ended(channel)
                with self._lock:
                    if self._channels.get(address) is channel:
                        del self._channels[address]
                if attempt == 2:
                    raise
                continue
            except BaseException:
                self._ended(channel)
                raise
            call.add_done_callback(lambda _call, channel=channel: self._ended(channel))
            return call
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _unary(channel: grpc.Channel, method: str, request: Any, reply_type: str) -> Any:
        return channel.unary_unary(
            f"/{_SERVICE}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=messages[reply_type].FromString,
        )

    def call(self, address: str, method: str, request: Any, reply_type: str, *, timeout_s: float) -> Any:
        """One unary call; raises ``grpc.RpcError`` (callers map it with :func:`map_rpc_error`)."""
        return self.call_async(address, method, request, reply_type, timeout_s=timeout_s).result()

    def call_async(self, address: str, method: str, request: Any, reply_type: str, *, timeout_s: float) -> Any:
        """Start one unary call; ``.result()`` on the returned future blocks (and raises) like :meth:`call`."""
        return self._invoke(
            address,
            lambda channel: self._unary(channel, method, request, reply_type).future(
                request, timeout=timeout_s, metadata=self._metadata, wait_for_ready=False
            ),
        )

    def stream(self, address: str, request: Any, *, timeout_s: float) -> Any:
        """Start a ``Transfer`` stream; the returned iterator yields raw chunks (``cancel()`` aborts)."""

        def start(channel: grpc.Channel) -> Any:
            stub = channel.unary_stream(
                f"/{_SERVICE}/Transfer",
                request_serializer=type(request).SerializeToString,
                response_deserializer=_identity,
            )
            return stub(request, timeout=timeout_s, metadata=self._metadata)

        return self._invoke(address, start)

    def close(self) -> None:
        with self._lock:
            channels = [*self._channels.values(), *self._retired]
            self._channels, self._retired = {}, set()
        for channel in channels:
            channel.close()
