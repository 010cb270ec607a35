"""``gloo``: host memory between any two processes over torch.distributed gloo, two-sided.

Each pair of agents gets its own standalone two-rank ``ProcessGroupGloo`` on first use
(the torch.distributed default process group is never touched, so user code may own it).
Its store is the agents' control service: keys set by one side are pushed to the other over
the authenticated ``Rendezvous`` call, so no extra port is opened for rendezvous. The
consumer is rank 1 and the producer rank 0 of the group it asked for; transfers use the
consumer's tags, so concurrent transfers on one group in both directions never cross.
A group is destroyed when a transfer on it fails or its peer is lost, and made again on the
next transfer.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.errors import PeerLostError, TransferTimeoutError, TransportError
from tensorwire.transport.base import Capabilities, MemoryKind, PeerInfo
from tensorwire.transport.two_sided import Connection, PostedOps, TwoSidedTransport, check_alive

__all__ = ["GlooTransport"]

logger = logging.getLogger(__name__)

_PRODUCER_RANK = 0
_CONSUMER_RANK = 1


class _ControlStore(dist.Store):
    """A c10d store for one two-rank group, backed by the agents' control services."""

    def __init__(self, context: Any, peer: PeerInfo, group: str, timeout_s: float) -> None:
        super().__init__()
        self._context = context
        self._peer = peer
        self._group = group
        self._timeout_s = timeout_s

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._context.rendezvous_set(self._peer, self._group, key, data, timeout_s=self._timeout_s)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:  # in slices, to notice a peer that exited meanwhile
            try:
                return self._context.rendezvous_get(self._group, key, timeout_s=min(0.25, self._timeout_s))
            except TransferTimeoutError:
                if time.monotonic() >= deadline:
                    raise
                check_alive(self._peer, f"gloo rendezvous with agent {self._peer.agent_id}")

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


class _Works(PostedOps):
    """Gloo send/recv works learn of their completion only inside a blocking ``wait`` (and a
    wait that times out fails the work for good), and a wait does not always return when the
    peer dies. So a helper thread waits for the works once, with the remaining time, while
    the caller runs ``check`` every quarter second and gives up as soon as it fails (the
    transport then aborts the group, so nothing more is written into the buffers)."""

    def __init__(self, group: Any, works: list[Any], buffers: Sequence[torch.Tensor]) -> None:
        self._group = group
        self._works = works
        self._buffers = buffers  # alive until the works completed

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
        threading.Thread(
            target=self._wait_all, args=(deadline, outcome, done), name="tensorwire-gloo-wait", daemon=True
        ).start()
        while not done.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(f"{what}: not complete before the deadline")
            check()
        error = outcome[0]
        if error is None:
            return
        if "timed out" in str(error).lower() or "timeout" in str(error).lower():
            raise TransferTimeoutError(f"{what}: not complete before the deadline")
        raise PeerLostError(f"{what}: gloo operation failed: {error}")

    def abort(self) -> None:
        _abort_group(self._group)


def _abort_group(group: Any) -> None:
    try:
        group.abort()  # pending sends and receives of the group fail; the group is unusable
    except Exception:
        logger.debug("gloo group abort failed", exc_info=True)


def _post(connection: Connection, post: Any, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> _Works:
    works: list[Any] = []
    try:
        for tag, buffer in zip(tags, buffers, strict=True):
            works.append(post(tag, buffer))
    except RuntimeError as e:  # the group's connection is closed: its peer is gone
        raise PeerLostError(f"gloo: the group with agent {connection.peer.agent_id} is broken: {e}") from None
    return _Works(connection.state, works, buffers)


class GlooTransport(TwoSidedTransport):
    """Two-rank gloo process groups per pair of agents; host memory, any node."""

    name = "gloo"
    capabilities = Capabilities(
        one_sided=False,
        same_process=False,
        same_node=True,
        cross_node=True,
        memory=frozenset({MemoryKind.HOST}),
        can_abort=True,
    )

    def unavailable_reason(self) -> str | None:
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no torch.distributed gloo backend"
        return None

    def _make_group(self, peer: PeerInfo, group: str, rank: int, timeout_s: float) -> Any:
        timeout_s = max(timeout_s, 1.0)
        store = _ControlStore(self.context, peer, group, timeout_s)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.context.config.host)]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        try:
            return dist.ProcessGroupGloo(store, rank, 2, options)
        except RuntimeError as e:
            raise TransportError(f"gloo: could not form a group with agent {peer.agent_id}: {e}") from None
        finally:
            self.context.rendezvous_forget(group)

    def open_connection(self, peer: PeerInfo, key: bytes, deadline: float) -> Any:
        group = f"gloo-{secrets.token_hex(8)}"
        made: list[Any] = []
        self.context.connect(
            peer,
            self.name,
            key + group.encode(),
            timeout_s=deadline - time.monotonic(),
            concurrently=lambda: made.append(
                self._make_group(peer, group, _CONSUMER_RANK, deadline - time.monotonic())
            ),
        )
        return made[0]

    def accept_connection(self, peer: PeerInfo, payload: bytes) -> tuple[Any, bytes]:
        group = payload.decode()
        if not group.startswith("gloo-"):
            raise TransportError("gloo: malformed group name")
        return self._make_group(peer, group, _PRODUCER_RANK, self.context.config.rpc_timeout_s), b""

    def post_sends(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        group = connection.state
        return _post(connection, lambda t, b: group.send([b], _CONSUMER_RANK, t), tags, buffers)

    def post_recvs(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        group = connection.state
        return _post(connection, lambda t, b: group.recv([b], _PRODUCER_RANK, t), tags, buffers)

    def close_connection(self, connection: Connection) -> None:
        _abort_group(connection.state)
