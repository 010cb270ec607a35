"""The agent's side of the control service: what it answers other agents.

:class:`ControlService` implements :class:`~tensorwire.transport.agent.control.ControlHandler`;
its methods run on the control server's threads. Handlers raise tensorwire errors; the
control server answers each with its status (one table,
:data:`~tensorwire.transport.agent.control.STATUS_OF`) and clients raise the same class again
(:func:`~tensorwire.transport.agent.control.map_rpc_error`). Malformed requests raise
``InvalidRequestError`` where they are checked.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from tensorwire.errors import (
    InvalidRequestError,
    ObjectFreedError,
    PermissionDeniedError,
    TensorwireError,
    TransferAbortedError,
    TransportError,
)
from tensorwire.transport.agent.holders import Holders
from tensorwire.transport.agent.instances import LoadedTransports
from tensorwire.transport.agent.rendezvous import MAX_VALUE_NBYTES, Mailbox
from tensorwire.transport.agent.store import Entry, ObjectStore
from tensorwire.transport.agent.wire import ObjectState, decode_peer, encode_peer, messages
from tensorwire.transport.contract import PeerInfo

__all__ = ["ControlService", "statuses"]


@contextlib.contextmanager
def statuses(failed: type[TensorwireError] = TransportError, prefix: str = "") -> Iterator[None]:
    """Errors of a step that serves a peer: a freed object or a denied token pass as they are;
    any other tensorwire error becomes ``failed`` with ``prefix`` before its message (the
    control server maps the class to a status)."""
    try:
        yield
    except (ObjectFreedError, PermissionDeniedError):
        raise
    except TensorwireError as e:
        raise failed(f"{prefix}{e}") from None


class ControlService:
    """Answers the control calls of other agents for one agent.

    Args:
        lock: The agent's lock.
        store: The objects this process owns.
        holders: The holder bookkeeping (``Holders`` calls).
        transports: The agent's transports (exports, transfers, connections).
        mailbox: The rendezvous mailbox (``Rendezvous`` calls).
        peer: This process's peer description (``Ping``).
    """

    def __init__(
        self,
        *,
        lock: threading.RLock,
        store: ObjectStore,
        holders: Holders,
        transports: LoadedTransports,
        mailbox: Mailbox,
        peer: Callable[[], PeerInfo],
    ) -> None:
        self._lock = lock
        self._store = store
        self._holders = holders
        self._transports = transports
        self._mailbox = mailbox
        self._peer = peer
        self._serving_now = 0

    @property
    def serving_now(self) -> int:
        """Two-sided transfers this process is serving right now."""
        with self._lock:
            return self._serving_now

    def _lookup(self, request: Any) -> Entry:
        with statuses():
            return self._store.lookup(request.object_id, request.token)

    def handle_ping(self, request: Any) -> Any:
        return messages["PingReply"](peer=encode_peer(self._peer()))

    def handle_status(self, request: Any) -> Any:
        with statuses():
            try:
                self._store.lookup(request.object_id, request.token)
                state = ObjectState.LIVE
            except ObjectFreedError:
                state = ObjectState.FREED
        return messages["StatusReply"](state=int(state))

    def handle_free(self, request: Any) -> Any:
        with statuses():
            try:
                entry = self._store.lookup(request.object_id, request.token)
            except ObjectFreedError:
                return messages["StatusReply"](state=int(ObjectState.FREED))
        self._store.free(entry)
        return messages["StatusReply"](state=int(ObjectState.FREED))

    def handle_holders(self, request: Any) -> Any:
        applied, rejected = self._holders.receive(decode_peer(request.sender), request.ops, request.seq)
        return messages["HolderReply"](applied=applied, rejected=rejected)

    def handle_export(self, request: Any) -> Any:
        entry = self._lookup(request)
        if not self._store.can_export(request.transport):
            raise InvalidRequestError(f"transport {request.transport!r} cannot export here")
        with statuses():
            handle = self._store.export_for(entry, request.transport)
        info = dict(self._peer().transport_info).get(request.transport, "")  # published since the reference left
        return messages["ExportReply"](handle=handle, info=info)

    def handle_transfer(self, request: Any) -> Iterator[bytes]:
        entry = self._lookup(request)
        transport = self._transports.get(request.transport)
        if transport is None or transport.capabilities.one_sided:
            raise InvalidRequestError(f"transport {request.transport!r} cannot serve two-sided transfers here")
        return self._serving(transport.serve(entry.stored, request.params))

    def handle_connect(self, request: Any) -> Any:
        transport = self._transports.get(request.transport)
        if transport is None or transport.capabilities.one_sided:
            raise InvalidRequestError(f"transport {request.transport!r} takes no connections here")
        with statuses(TransferAbortedError, prefix=f"{request.transport}: accepting a connection failed: "):
            answer = transport.accept(decode_peer(request.sender), request.payload)
        return messages["ConnectReply"](payload=answer)

    def handle_rendezvous(self, request: Any) -> Any:
        if len(request.value) > MAX_VALUE_NBYTES or not request.group or not request.key:
            raise InvalidRequestError("malformed rendezvous key")
        self._mailbox.put(request.group, request.key, request.value)
        return messages["RendezvousReply"]()

    def _serving(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """Count a served stream while it runs (it ends when done, failed, or cancelled)."""
        with self._lock:
            self._serving_now += 1
        try:
            yield from chunks
        finally:
            with self._lock:
                self._serving_now -= 1
