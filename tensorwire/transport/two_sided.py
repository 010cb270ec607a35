"""The two-sided transfer protocol, one implementation shared by ucx, gloo and nccl.

Both sides take part in a two-sided transfer. Per pair of agents a transport first makes a
*connection* (an endpoint, a process group): the consumer calls ``Connect`` on the owner's
control service, which runs :meth:`TwoSidedTransport.accept_connection` there while the
consumer builds its side. Connections are cached, dropped when a transfer on them fails, and
made again on the next transfer. Then, per transfer:

1. the consumer picks a tag (unique in its process) and posts its receives into its own
   buffers: one message per large tensor, small tensors packed into shared messages;
2. it calls ``Transfer`` with (connection key, tag, deadline); the producer posts the
   matching sends, answers ``posted`` and ends the call; a completion thread of the
   producer waits for the sends (and drops the connection if they fail or time out);
3. the consumer waits for its receives, checking every quarter second that the owner is
   alive and still has the object, and unpacks the packed messages.

Every wait is bounded by the request's deadline. A failure or abort on either side aborts
the posted operations and drops that connection on that side, so both agents stay usable
and the next transfer reconnects; other transfers in flight on other connections are not
affected. Many transfers can be in flight per connection: tags keep them apart, so neither
side ever waits for a slow transfer to post the next one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire.errors import (
    InvalidRequestError,
    ObjectFreedError,
    OwnerDiedError,
    PeerLostError,
    TensorwireError,
    TransferAbortedError,
    TransportError,
    UnknownConnectionError,
)
from tensorwire.transport.contract import FetchRequest, PeerInfo, StoredObject, Transport
from tensorwire.transport.packing import byte_view, message_plan
from tensorwire.transport.waiting import backoff, wait_until

__all__ = ["Connection", "PostedOps", "TwoSidedTransport"]

logger = logging.getLogger(__name__)

_PARAMS = struct.Struct("!16sIQ")  # connection key, tag base, deadline in ms from now
_POSTED = b"posted"
_POLL_PAUSE = backoff(20e-6, 200e-6)  # between polls of posted operations
_KEY_NBYTES = 16
_TAG_SHIFT = 16  # low bits: message index within a transfer
_MAX_MESSAGES = 1 << _TAG_SHIFT
_TAG_SPACE = 1 << 15  # tag bases wrap here, so tags fit in 31 bits (gloo's limit)


@dataclass
class Connection:
    """One side of a connection between two agents; ``state`` belongs to the transport."""

    key: bytes
    peer: PeerInfo
    state: Any
    scope: str = ""  # what else the connection is for (nccl: the pair of GPUs)
    lock: threading.Lock = field(default_factory=threading.Lock)  # serialises transfers where needed
    closed: bool = False  # set once dropped: transfers still waiting on it try a new connection


class _Reconnect(Exception):
    """Internal: the attempt failed on a stale or broken connection; try a new one."""


class PostedOps(ABC):
    """Sends or receives posted by a transport for one transfer.

    Subclasses implement :meth:`poll` and :meth:`abort`; :meth:`wait` is shared.
    """

    @abstractmethod
    def poll(self) -> bool:
        """True once every operation completed; raises ``TransportError`` if one failed."""

    @abstractmethod
    def abort(self) -> None:
        """Stop waiting; after this the buffers may no longer be written. Must not raise."""

    def wait(self, deadline: float, check: Callable[[], None], what: str) -> None:
        """Poll until done or the deadline (``TransferTimeoutError``); every quarter second
        ``check()`` may raise to stop early (the peer exited or dropped the transfer)."""
        wait_until(lambda _s: self.poll() or None, deadline=deadline, what=what, check=check, pause=_POLL_PAUSE)


class TwoSidedTransport(Transport):
    """Base of two-sided transports: connections, tags, packing, deadlines and abort.

    Subclasses implement :meth:`open_connection` (consumer), :meth:`accept_connection`
    (producer), :meth:`post_sends`, :meth:`post_recvs` and :meth:`close_connection`.
    """

    small_message_nbytes = 64 * 1024
    pack_nbytes = 4 * 1024 * 1024
    # True when the transport matches messages by order, not by tag (NCCL): the consumer then
    # runs one transfer at a time per connection, so both sides post in the same order.
    ordered = False

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._lock = threading.Lock()
        self._outgoing: dict[tuple[str, str], Connection] = {}  # consumer side, by (owner agent id, scope)
        self._incoming: dict[bytes, Connection] = {}  # producer side, by connection key
        self._connecting: dict[tuple[str, str], threading.Lock] = {}  # gates, keyed like _outgoing
        self._tags = itertools.count(1)
        self._completions = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"tensorwire-{self.name}-sends")

    # ------------------------------------------------------------------ transport hooks

    def connection_scope(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> str:
        """Consumer: what besides the peer a connection is for ("" by default)."""
        return ""

    @abstractmethod
    def open_connection(self, peer: PeerInfo, key: bytes, deadline: float, scope: str) -> Any:
        """Consumer: make this side of a connection to ``peer`` (for ``scope``) and have the
        peer accept it (through ``self.context.connect(peer, self.name, key + payload, ...)``)."""

    @abstractmethod
    def accept_connection(self, peer: PeerInfo, payload: bytes) -> tuple[Any, bytes]:
        """Producer: make this side of the connection ``peer`` asked for; returns
        (state, answer for the peer)."""

    @abstractmethod
    def post_sends(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        """Producer: post one send per buffer (flat ``uint8`` tensors) under the matching tag."""

    @abstractmethod
    def post_recvs(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        """Consumer: post one receive per buffer (flat ``uint8`` tensors) under the matching tag."""

    def close_connection(self, connection: Connection) -> None:
        """Either side: free the connection's state. Must not raise."""

    def prepare_send(self, buffers: Sequence[torch.Tensor]) -> None:
        """Producer: make pending device work on the send buffers visible to the sends (CUDA)."""

    def prepare_recv(self, buffers: Sequence[torch.Tensor]) -> None:
        """Consumer: make earlier device work on the receive buffers finish first (CUDA)."""

    def peer_died_mid_transfer(self, connection: Connection) -> None:
        """Either side: the peer of ``connection`` died while a transfer with it was in flight
        (after the connection was dropped). Transports whose other connections a half-done
        transfer can spoil reset them here (ucx). Must not raise."""

    # ------------------------------------------------------------------ connections

    def check_alive(self, peer: PeerInfo, what: str) -> None:
        """Raise ``PeerLostError`` if ``peer`` ran on this machine and its process exited."""
        if not self.context.peer_may_be_alive(peer):
            raise PeerLostError(f"{what}: peer process {peer.pid} exited")

    def _connection_to(self, owner: PeerInfo, deadline: float, scope: str) -> Connection:
        cache_key = (owner.agent_id, scope)
        with self._lock:
            connection = self._outgoing.get(cache_key)
            if connection is not None:
                return connection
            gate = self._connecting.setdefault(cache_key, threading.Lock())
        with gate:  # one connect per peer and scope at a time; the others wait and reuse it
            with self._lock:
                connection = self._outgoing.get(cache_key)
            if connection is not None:
                return connection
            key = secrets.token_bytes(_KEY_NBYTES)
            connection = Connection(key, owner, self.open_connection(owner, key, deadline, scope), scope)
            with self._lock:
                self._outgoing[cache_key] = connection
            logger.debug("%s: connected to agent %s %s", self.name, owner.agent_id, scope)
            return connection

    def accept(self, peer: PeerInfo, payload: bytes) -> bytes:
        if len(payload) < _KEY_NBYTES:
            raise TransportError(f"{self.name}: malformed connection request")
        key = payload[:_KEY_NBYTES]
        state, answer = self.accept_connection(peer, payload[_KEY_NBYTES:])
        with self._lock:
            self._incoming[key] = Connection(key, peer, state)
        return answer

    def _drop(self, connection: Connection) -> None:
        with self._lock:
            dropped = False
            cache_key = (connection.peer.agent_id, connection.scope)
            if self._outgoing.get(cache_key) is connection:
                del self._outgoing[cache_key]
                dropped = True
            if self._incoming.get(connection.key) is connection:
                del self._incoming[connection.key]
                dropped = True
        if dropped:
            logger.debug("%s: dropped connection with agent %s", self.name, connection.peer.agent_id)
            self.close_connection(connection)
        connection.closed = True

    def _take_connections(self) -> list[Connection]:
        """Remove every connection (both directions) without closing them."""
        with self._lock:
            connections = [*self._outgoing.values(), *self._incoming.values()]
            self._outgoing.clear()
            self._incoming.clear()
        return connections

    def forget_peer(self, agent_id: str) -> None:
        with self._lock:
            connections = [
                c for c in (*self._outgoing.values(), *self._incoming.values()) if c.peer.agent_id == agent_id
            ]
            for gate in [k for k in self._connecting if k[0] == agent_id]:
                del self._connecting[gate]
        for connection in connections:
            self._drop(connection)

    def connections(self) -> int:
        """Connections this process holds (both directions)."""
        with self._lock:
            return len(self._outgoing) + len(self._incoming)

    def close(self) -> None:
        self._completions.shutdown(wait=False, cancel_futures=True)
        for connection in self._take_connections():
            self.close_connection(connection)
            connection.closed = True

    # ------------------------------------------------------------------ messages

    def _plan(self, nbytes: Sequence[int]) -> list[list[int]]:
        plan = message_plan(nbytes, small_nbytes=self.small_message_nbytes, pack_nbytes=self.pack_nbytes)
        if len(plan) > _MAX_MESSAGES:
            raise TransportError(f"{self.name}: {len(plan)} messages in one transfer (at most {_MAX_MESSAGES})")
        return plan

    def _next_tags(self, count: int) -> list[int]:
        base = (next(self._tags) % _TAG_SPACE) << _TAG_SHIFT
        return [base | i for i in range(count)]

    @staticmethod
    def _send_buffers(plan: list[list[int]], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        buffers = []
        for message in plan:
            views = [byte_view(tensors[i]) for i in message]
            buffers.append(views[0] if len(views) == 1 else torch.cat(views))
        return buffers

    @staticmethod
    def _recv_buffers(plan: list[list[int]], dst: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        buffers = []
        for message in plan:
            if len(message) == 1:
                buffers.append(byte_view(dst[message[0]]))
            else:
                nbytes = sum(dst[i].numel() * dst[i].element_size() for i in message)
                buffers.append(torch.empty(nbytes, dtype=torch.uint8, device=dst[message[0]].device))
        return buffers

    @staticmethod
    def _unpack(plan: list[list[int]], buffers: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
        for message, buffer in zip(plan, buffers, strict=True):
            if len(message) == 1:
                continue
            start = 0
            for i in message:
                view = byte_view(dst[i])
                view.copy_(buffer[start : start + view.numel()])
                start += view.numel()

    # ------------------------------------------------------------------ the protocol

    def fetch(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
        """Consumer: post receives into ``dst``, ask the owner to send, wait for them."""
        plan = self._plan([m.nbytes for m in request.metas])
        scope = self.connection_scope(request, dst)
        for attempt in (1, 2):
            connection = self._connection_to(request.owner, request.deadline, scope)
            try:
                with connection.lock if self.ordered else contextlib.nullcontext():
                    self._transfer(request, dst, plan, connection)
                return
            except _Reconnect:
                if attempt == 2 or request.remaining_s() <= 0.1:
                    raise TransferAbortedError(
                        f"{self.name}: the connection to agent {request.owner.agent_id} broke twice"
                    ) from None

    def _transfer(
        self, request: FetchRequest, dst: Sequence[torch.Tensor], plan: list[list[int]], connection: Connection
    ) -> None:
        """One attempt on one connection; raises ``_Reconnect`` when a new connection may help."""
        tags = self._next_tags(len(plan))
        buffers = self._recv_buffers(plan, dst)
        self.prepare_recv(buffers)
        try:
            posted = self.post_recvs(connection, tags, buffers)
        except TransportError:
            self._drop(connection)  # broken (its peer went away): the next attempt reconnects
            raise _Reconnect from None
        deadline_ms = int(request.remaining_s() * 1000)
        params = _PARAMS.pack(connection.key, tags[0] >> _TAG_SHIFT if tags else 0, deadline_ms)
        what = f"{self.name} transfer of object {request.object_id.hex()} from agent {request.owner.agent_id}"

        def check() -> None:
            self.context.check_owner(request)
            if connection.closed:  # dropped under us (by another transfer, or a reset): try anew
                raise _Reconnect

        try:
            answer = list(self.context.open_stream(request, self.name, params))
            if answer != [_POSTED]:
                raise TransferAbortedError(f"{what}: the owner did not post its sends")
            try:
                posted.wait(request.deadline, check, what)
            except TransportError as e:
                if type(e) is TransportError:  # an operation failed: the owner or object gone says why
                    self._explain(request, e)
                raise
        except BaseException as e:
            posted.abort()
            self._drop(connection)
            if isinstance(e, (OwnerDiedError, PeerLostError)):
                self.peer_died_mid_transfer(connection)
            if isinstance(e, UnknownConnectionError):
                logger.debug("%s: the owner no longer knows the connection; reconnecting", what)
                raise _Reconnect from None
            raise
        self._unpack(plan, buffers, dst)

    def _explain(self, request: FetchRequest, error: TransportError) -> None:
        """Consumer: raise the owner's death or the object's free, chained to ``error`` (the
        operation that failed), if that is what happened; else return (``error`` stands)."""
        try:
            self.context.check_owner(request)
        except (OwnerDiedError, PeerLostError, ObjectFreedError) as gone:
            raise gone from error
        except TensorwireError:  # the owner could not say (its status call timed out, ...)
            return

    def serve(self, obj: StoredObject, params: bytes) -> Iterator[bytes]:
        """Producer, on an agent service thread: post the sends the consumer asked for (after
        the work that produced device tensors, see ``StoredObject.wait_ready``)."""
        if len(params) != _PARAMS.size:
            raise InvalidRequestError(
                f"{self.name}: malformed transfer parameters ({len(params)} bytes, expected {_PARAMS.size})"
            )
        key, tag_base, deadline_ms = _PARAMS.unpack(params)
        deadline = time.monotonic() + deadline_ms / 1000
        with self._lock:
            connection = self._incoming.get(key)
        if connection is None:
            raise UnknownConnectionError(
                f"{self.name}: unknown connection {key.hex()}: this producer dropped it (after a failure) "
                "or never made it; the consumer reconnects"
            )
        plan = self._plan([m.nbytes for m in obj.metas])
        tags = [(tag_base << _TAG_SHIFT) | i for i in range(len(plan))]
        obj.wait_ready()
        return self._serve(connection, plan, tags, obj.tensors, deadline)

    def _serve(
        self,
        connection: Connection,
        plan: list[list[int]],
        tags: list[int],
        tensors: Sequence[torch.Tensor],
        deadline: float,
    ) -> Iterator[bytes]:
        buffers = self._send_buffers(plan, tensors)
        self.prepare_send(buffers)
        posted = self.post_sends(connection, tags, buffers)
        self._completions.submit(self._complete, posted, connection, deadline)
        yield _POSTED

    def _complete(self, posted: PostedOps, connection: Connection, deadline: float) -> None:
        """Producer, on a completion thread: wait for posted sends; drop the connection if
        they fail or outlive the consumer's deadline (the consumer then reconnects)."""
        what = f"{self.name} send to agent {connection.peer.agent_id}"

        def check() -> None:
            self.check_alive(connection.peer, what)
            if connection.closed:
                raise TransferAbortedError(f"{what}: the connection was dropped")

        try:
            posted.wait(deadline, check, what)
        except Exception as e:  # noqa: BLE001 - reported, and the connection is dropped
            logger.info("%s failed: %s", what, e)
            posted.abort()
            self._drop(connection)
            if isinstance(e, PeerLostError):
                self.peer_died_mid_transfer(connection)
