"""Standalone two-rank torch.distributed process groups per pair of agents (gloo, nccl).

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
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.errors import PeerLostError, TransferTimeoutError, TransportError
from tensorwire.transport.contract import PeerInfo
from tensorwire.transport.two_sided import Connection, PostedOps, TwoSidedTransport

__all__ = [
    "CONSUMER_RANK",
    "PRODUCER_RANK",
    "ControlStore",
    "GroupOps",
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
        self._context.rendezvous_set(self._peers[0], self._group, key, data, timeout_s=self._timeout_s)
        for peer in self._peers[1:]:
            self._context.rendezvous_push(peer, self._group, key, data, timeout_s=self._timeout_s)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:  # in slices, to notice a peer that exited meanwhile
            try:
                return self._context.rendezvous_get(self._group, key, timeout_s=min(0.25, self._timeout_s))
            except TransferTimeoutError:
                if time.monotonic() >= deadline:
                    raise
                for peer in self._peers:
                    if not self._context.peer_may_be_alive(peer):
                        raise PeerLostError(f"rendezvous with agent {peer.agent_id}: its process exited") from None

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
