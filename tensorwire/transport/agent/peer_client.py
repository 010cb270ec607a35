"""The typed client of other agents' control services.

Every call to another agent goes through :class:`PeerClient`: one method per control call,
typed arguments and results, deadlines, and tensorwire errors (never ``grpc.RpcError``). A
call whose connection dropped is retried once on a new connection by one rule,
:meth:`PeerClient._may_retry`; a lost peer that is known to have exited becomes
``OwnerDiedError``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from tensorwire.errors import OwnerDiedError, PeerLostError, TransferTimeoutError
from tensorwire.transport.agent.control import ControlClient, map_rpc_error
from tensorwire.transport.agent.outbox import Outbox
from tensorwire.transport.agent.wire import ObjectState, encode_peer, messages
from tensorwire.transport.config import Config
from tensorwire.transport.contract import FetchRequest, PeerInfo
from tensorwire.transport.hw import topology

__all__ = ["PeerClient"]

logger = logging.getLogger(__name__)

_EXIT_LOOK_S = 0.02  # while a call to a peer on this machine runs, how often to look whether its process exited


class PeerClient:
    """Calls to other agents on behalf of this one (thread-safe).

    Args:
        token: The cluster token every call carries.
        peer: This process's peer description (the sender of connections and transfers).
        config: The agent's current settings.
    """

    def __init__(self, *, token: bytes, peer: Callable[[], PeerInfo], config: Callable[[], Config]) -> None:
        self._client = ControlClient(token=token)
        self._peer = peer
        self._config = config

    def outbox(self) -> Outbox:
        """A new holder-message outbox that sends through this client."""
        return Outbox(
            self._client,
            sender=lambda: encode_peer(self._peer()),
            address=self.address,
            may_be_alive=self.may_be_alive,
            retry_for_s=self._retry_holders_for_s,
            rpc_timeout_s=self._config().rpc_timeout_s,
        )

    def close(self) -> None:
        self._client.close()

    def _retry_holders_for_s(self, owner: PeerInfo) -> float:
        """How long holder messages to a silent owner are retried: on this machine while its
        agent's socket is there (a paused owner gets them when it resumes; a closed agent
        removed it); on another one until its holder check has dropped this process's holds
        too (``holder_lost_after_s``)."""
        if owner.same_machine(self._peer()):
            return math.inf if os.path.exists(owner.unix_address.removeprefix("unix:")) else 0.0
        return self._config().holder_lost_after_s

    # ------------------------------------------------------------------ reaching peers

    def address(self, peer: PeerInfo) -> str:
        """The Unix socket for a peer on this machine and node, else its TCP address."""
        me = self._peer()
        if peer.same_node(me) and peer.same_machine(me) and peer.unix_address:
            return peer.unix_address
        return peer.tcp_address

    def may_be_alive(self, peer: PeerInfo) -> bool:
        """False only when ``peer`` ran on this machine and its process has exited."""
        return not peer.same_machine(self._peer()) or topology.process_alive(peer.pid, peer.start_time)

    def responds(self, peer: PeerInfo, *, timeout_s: float) -> bool:
        """Whether ``peer``'s process can act now: on this machine, alive and not stopped (one
        read of ``/proc``); elsewhere, its agent answers a ping within ``timeout_s``."""
        if peer.same_machine(self._peer()):
            return topology.process_alive(peer.pid, peer.start_time) and not topology.process_stopped(
                peer.pid, peer.start_time
            )
        return self.ping(peer, timeout_s=timeout_s)

    def owner_error(self, owner: PeerInfo, error: Exception) -> Exception:
        """Turn a lost-peer error into ``OwnerDiedError`` when the owner is known to have exited."""
        if isinstance(error, (PeerLostError, TransferTimeoutError)) and not self.may_be_alive(owner):
            self._client.drop(self.address(owner))
            return OwnerDiedError(
                f"the owner of this object (pid {owner.pid} on {owner.hostname}, agent {owner.agent_id}) has exited; "
                "its tensors are gone"
            )
        return error

    def _may_retry(self, attempt: int, error: grpc.RpcError, peer: PeerInfo, left_s: float, what: str) -> bool:
        """The one retry rule: the first attempt of an idempotent call whose connection
        dropped (``UNAVAILABLE``), to a peer that may be alive, with time left, is retried
        once on a new connection (this drops the old one and waits a moment)."""
        if attempt != 1 or error.code() != grpc.StatusCode.UNAVAILABLE or left_s <= 0.1:
            return False
        if not self.may_be_alive(peer):
            return False
        logger.debug("%s: connection dropped, retrying once", what)
        self._client.drop(self.address(peer))
        # a moment (50 ms), cut short by the peer's exit (a process dying drops its connections first)
        for _ in range(5):
            time.sleep(0.01)
            if not self.may_be_alive(peer):
                return False
        return True

    def _ask(self, peer: PeerInfo, method: str, request: Any, reply_type: str, *, timeout_s: float) -> Any:
        """An idempotent unary call to ``peer``'s agent; errors come back as tensorwire errors."""
        deadline = time.monotonic() + timeout_s
        address = self.address(peer)
        what = f"{method} call to agent {peer.agent_id}"
        for attempt in (1, 2):
            try:
                left = max(0.05, deadline - time.monotonic())
                future = self._client.call_async(address, method, request, reply_type, timeout_s=left)
                return self._answer(future, peer, what)
            except grpc.RpcError as e:
                if self._may_retry(attempt, e, peer, deadline - time.monotonic(), what):
                    continue
                raise self.owner_error(peer, map_rpc_error(e, what)) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _answer(self, future: Any, peer: PeerInfo, what: str) -> Any:
        """A call's reply; a peer on this machine whose process exits meanwhile ends the wait
        at once (its sockets close only once its memory is torn down: tens of ms for a large
        process)."""
        if not peer.same_machine(self._peer()):
            return future.result()  # (nothing to look at: its deadline bounds it)
        while True:
            try:
                return future.result(timeout=_EXIT_LOOK_S)
            except grpc.FutureTimeoutError:
                if not self.may_be_alive(peer):
                    future.cancel()
                    raise self.owner_error(peer, PeerLostError(f"{what}: the peer exited")) from None

    # ------------------------------------------------------------------ the calls

    def ping(self, peer: PeerInfo, *, timeout_s: float) -> bool:
        """Whether ``peer``'s agent answers within ``timeout_s`` (one try)."""
        try:
            self._client.call(self.address(peer), "Ping", messages["PingRequest"](), "PingReply", timeout_s=timeout_s)
        except grpc.RpcError:
            return False
        return True

    def status(self, owner: PeerInfo, object_id: bytes, token: bytes, *, timeout_s: float) -> ObjectState:
        """What ``owner`` knows about the object."""
        request = messages["ObjectRequest"](object_id=object_id, token=token)
        state = self._ask(owner, "Status", request, "StatusReply", timeout_s=timeout_s).state
        try:
            return ObjectState(state)
        except ValueError:  # a newer owner's state this process does not know
            return ObjectState.UNKNOWN

    def free(self, owner: PeerInfo, object_id: bytes, token: bytes, *, timeout_s: float) -> None:
        """Ask ``owner`` to free the object now."""
        request = messages["ObjectRequest"](object_id=object_id, token=token)
        self._ask(owner, "Free", request, "StatusReply", timeout_s=timeout_s)

    def export(self, request: FetchRequest, transport: str) -> tuple[bytes, str]:
        """Ask the owner to export the object for ``transport`` for this process now: the
        handle, and the transport's connection info the owner publishes now."""
        message = messages["TransferRequest"](object_id=request.object_id, token=request.token, transport=transport)
        timeout_s = max(0.05, min(request.remaining_s(), self._config().rpc_timeout_s))
        reply = self._ask(request.owner, "Export", message, "ExportReply", timeout_s=timeout_s)
        return reply.handle, reply.info

    def rendezvous(self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float) -> None:
        """Set ``key`` of ``group`` in ``peer``'s rendezvous mailbox."""
        message = messages["RendezvousRequest"](group=group, key=key, value=value)
        self._ask(peer, "Rendezvous", message, "RendezvousReply", timeout_s=timeout_s)

    def rendezvous_async(
        self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float
    ) -> Callable[[], None]:
        """Start :meth:`rendezvous`; the returned function waits for it (a failed first try is
        made again through :meth:`rendezvous`, which retries and maps errors)."""
        message = messages["RendezvousRequest"](group=group, key=key, value=value)
        try:
            future = self._client.call_async(
                self.address(peer), "Rendezvous", message, "RendezvousReply", timeout_s=timeout_s
            )
        except grpc.RpcError:
            future = None

        def wait() -> None:
            try:
                if future is not None:
                    future.result()
                    return
            except grpc.RpcError:
                pass
            self.rendezvous(peer, group, key, value, timeout_s=timeout_s)

        return wait

    def connect(
        self, peer: PeerInfo, transport: str, payload: bytes, *, timeout_s: float, concurrently: Callable[[], None]
    ) -> bytes:
        """Ask ``peer`` to accept a ``transport`` connection while ``concurrently`` runs here."""
        message = messages["ConnectRequest"](transport=transport, sender=encode_peer(self._peer()), payload=payload)
        what = f"{transport} connection to agent {peer.agent_id}"
        try:
            future = self._client.call_async(
                self.address(peer), "Connect", message, "ConnectReply", timeout_s=max(0.05, timeout_s)
            )
        except grpc.RpcError as e:
            raise self.owner_error(peer, map_rpc_error(e, what)) from None
        try:
            concurrently()
        except BaseException:
            future.cancel()
            raise
        try:
            return future.result().payload
        except grpc.RpcError as e:
            raise self.owner_error(peer, map_rpc_error(e, what)) from None

    def stream(self, request: FetchRequest, transport: str, params: bytes) -> Iterator[bytes]:
        """A two-sided transfer's stream. Reading is idempotent, so a connection dropped
        before the first chunk arrived is retried once on a new connection."""
        message = messages["TransferRequest"](
            object_id=request.object_id,
            token=request.token,
            transport=transport,
            params=params,
            sender=encode_peer(self._peer()),
        )
        what = f"{transport} transfer of object {request.object_id.hex()} from agent {request.owner.agent_id}"
        address = self.address(request.owner)
        for attempt in (1, 2):
            received = False
            stream = self._client.stream(address, message, timeout_s=max(0.05, request.remaining_s()))
            try:
                for chunk in stream:
                    received = True
                    yield chunk
                return
            except grpc.RpcError as e:
                if not received and self._may_retry(attempt, e, request.owner, request.remaining_s(), what):
                    continue
                raise self.owner_error(request.owner, map_rpc_error(e, what)) from None
            finally:
                stream.cancel()
