"""torch.distributed process groups over the agents: two-rank ones per pair of agents (the
gloo and nccl transports), and what groups of any size share with them (the collectives' gloo
and nccl backends): the c10d store over the control service, waiting for works, abort.

The torch.distributed default process group is never touched, so user code may own it. A
group's c10d store is the agents' control service: keys set by one side are pushed to the
other over the authenticated ``Rendezvous`` call, so no extra port is opened for rendezvous.
The consumer asks for a group with ``Connect`` (rank 1) while the producer builds its side
(rank 0) in the call; both construct the group at the same time.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.errors import PeerLostError, TransferTimeoutError, TransportError
from tensorwire.transport.contract import PeerInfo
from tensorwire.transport.two_sided import Connection, PostedOps, TwoSidedTransport
from tensorwire.transport.waiting import wait_until

__all__ = [
    "CONSUMER_RANK",
    "PRODUCER_RANK",
    "ControlStore",
    "GlooWorks",
    "GroupOps",
    "NcclWorks",
    "PairGroupTransport",
    "abort_group",
    "post_ops",
]

PRODUCER_RANK = 0
CONSUMER_RANK = 1


class ControlStore(dist.Store):
    """A c10d store for one group, backed by the agents' control services: a key set by one
    member is pushed to every other member (``peers``) and read from the local table."""

    def __init__(self, context: Any, peers: Sequence[PeerInfo], group: str, timeout_s: float) -> None:
        super().__init__()
        self._context = context
        self._peers = tuple(peers)
        self._group = group
        self._timeout_s = timeout_s

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        for peer in (self._context.peer, *self._peers):  # here first, then every other member
            self._context.rendezvous_push(peer, self._group, key, data, timeout_s=self._timeout_s)

    def get(self, key: str) -> bytes:
        return wait_until(
            lambda slice_s: self._value(key, slice_s),
            deadline=time.monotonic() + self._timeout_s,
            what=f"rendezvous {self._group}: key {key!r}",
            check=self._check_peers,
        )

    def _value(self, key: str, slice_s: float) -> bytes | None:
        try:
            return self._context.rendezvous_get(self._group, key, timeout_s=slice_s)
        except TransferTimeoutError:
            return None

    def _check_peers(self) -> None:
        for peer in self._peers:
            if not self._context.peer_may_be_alive(peer):
                raise PeerLostError(f"rendezvous with agent {peer.agent_id}: its process exited")

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys: Sequence[str]) -> bool:
        try:
            for key in keys:
                self._context.rendezvous_get(self._group, key, timeout_s=0.0)
        except TransportError:
            return False
        return True


class PairGroupTransport(TwoSidedTransport):
    """Connections are two-rank process groups; subclasses build the group and post ops."""

    @abstractmethod
    def new_group(self, store: dist.Store, rank: int, timeout_s: float, scope: str) -> Any:
        """A connected two-rank process group of this transport's backend on ``store``."""

    def _make_group(self, peer: PeerInfo, group: str, rank: int, timeout_s: float, scope: str) -> Any:
        timeout_s = max(timeout_s, 1.0)
        try:
            return self.new_group(ControlStore(self.context, [peer], group, timeout_s), rank, timeout_s, scope)
        except RuntimeError as e:
            raise TransportError(f"{self.name}: could not form a group with agent {peer.agent_id}: {e}") from None
        finally:
            self.context.rendezvous_forget(group)

    def open_connection(self, peer: PeerInfo, key: bytes, deadline: float, scope: str) -> Any:
        group = f"{self.name}-{secrets.token_hex(8)}"
        made: list[Any] = []

        def build() -> None:
            made.append(self._make_group(peer, group, CONSUMER_RANK, deadline - time.monotonic(), scope))

        payload = key + f"{group}\n{scope}".encode()
        self.context.connect(peer, self.name, payload, timeout_s=deadline - time.monotonic(), concurrently=build)
        return made[0]

    def accept_connection(self, peer: PeerInfo, payload: bytes) -> tuple[Any, bytes]:
        group, _, scope = payload.decode(errors="replace").partition("\n")
        if not group.startswith(f"{self.name}-") or len(group) > 64 or len(scope) > 256:
            raise TransportError(f"{self.name}: malformed group name")
        return self._make_group(peer, group, PRODUCER_RANK, self.context.config.rpc_timeout_s, scope), b""

    def close_connection(self, connection: Any) -> None:
        abort_group(connection.state)


class GroupOps(PostedOps):
    """Works posted on one pair group for one transfer; aborting them aborts the group."""

    def __init__(self, group: Any, works: list[Any], buffers: Sequence[torch.Tensor]) -> None:
        self._group = group
        self._works = works
        self._buffers = buffers  # alive until the works completed

    def abort(self) -> None:
        abort_group(self._group)


def post_ops(
    name: str,
    connection: Connection,
    post: Callable[[int, torch.Tensor], Any],
    tags: Sequence[int],
    buffers: Sequence[torch.Tensor],
) -> list[Any]:
    """``post(tag, buffer)`` for each message; a closed group (its peer is gone) is ``PeerLostError``."""
    try:
        return [post(tag, buffer) for tag, buffer in zip(tags, buffers, strict=True)]
    except RuntimeError as e:
        raise PeerLostError(f"{name}: the group with agent {connection.peer.agent_id} is broken: {e}") from None


def abort_group(group: Any) -> None:
    """Abort a group: its pending operations fail and it is unusable. Never raises."""
    with contextlib.suppress(Exception):
        group.abort()


class GlooWorks(GroupOps):
    """Gloo send/recv works learn of their completion only inside a blocking ``wait`` (and a
    wait that times out fails the work for good), and a wait does not always return when the
    peer dies. So a helper thread waits for the works once, with the remaining time, while
    the caller runs ``check`` every quarter second and gives up as soon as it fails. The
    helper's own wait ends by the same deadline, and a timed-out gloo wait closes the pair,
    so nothing is written into the buffers after the deadline."""

    def poll(self) -> bool:
        raise NotImplementedError  # wait() is overridden

    def _wait_all(self, deadline: float, outcome: list[BaseException | None], done: threading.Event) -> None:
        try:
            for work in self._works:
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.append(e)
        finally:
            done.set()

    def wait(self, deadline: float, check: Callable[[], None], what: str) -> None:
        outcome: list[BaseException | None] = []
        done = threading.Event()
        # Not a daemon: a gloo wait cannot be interrupted (aborting the group does not wake it),
        # and a daemon thread that returns from it while the interpreter shuts down aborts the
        # process. It ends by the request's deadline at the latest; exit waits for it.
        threading.Thread(target=self._wait_all, args=(deadline, outcome, done), name="tensorwire-gloo-wait").start()
        wait_until(lambda slice_s: done.wait(slice_s) or None, deadline=deadline, what=what, check=check)
        error = outcome[0]
        if error is None:
            return
        if "timed out" in str(error).lower() or "timeout" in str(error).lower():
            raise TransferTimeoutError(f"{what}: not complete before the deadline")
        raise PeerLostError(f"{what}: gloo operation failed: {error}")


class NcclWorks(GroupOps):
    """NCCL works complete on the GPU; ``poll`` asks each without blocking."""

    def poll(self) -> bool:
        try:
            return all(work.is_completed() for work in self._works)
        except RuntimeError as e:
            raise TransportError(f"nccl operation failed: {e}") from None
