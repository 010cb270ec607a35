"""``gloo``: host memory between any two processes over torch.distributed gloo, two-sided.

Each pair of agents gets its own standalone two-rank ``ProcessGroupGloo`` on first use
(:mod:`~tensorwire.transport.process_groups`: rendezvous through the control service, never the
default process group). Transfers use the consumer's tags, so concurrent transfers on one
group in both directions never cross.
A group is destroyed when a transfer on it fails or its peer is lost, and made again on the
next transfer.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.errors import PeerLostError, TransferTimeoutError
from tensorwire.transport.contract import Capabilities, CostModel, MemoryKind
from tensorwire.transport.process_groups import CONSUMER_RANK, PRODUCER_RANK, GroupOps, PairGroupTransport, post_ops
from tensorwire.transport.two_sided import Connection, PostedOps

__all__ = ["GlooTransport", "GlooWorks"]


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


class GlooTransport(PairGroupTransport):
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
    cost_model = CostModel.uniform(fixed_us=1700, bandwidth_gbps=2.0)  # measured on the 2-core build VM

    def unavailable_reason(self) -> str | None:
        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no torch.distributed gloo backend"
        return None

    def new_group(self, store: dist.Store, rank: int, timeout_s: float, scope: str) -> Any:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.context.config.host)]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupGloo(store, rank, 2, options)

    def post_sends(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        group = connection.state
        works = post_ops(self.name, connection, lambda t, b: group.send([b], CONSUMER_RANK, t), tags, buffers)
        return GlooWorks(group, works, buffers)

    def post_recvs(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        group = connection.state
        works = post_ops(self.name, connection, lambda t, b: group.recv([b], PRODUCER_RANK, t), tags, buffers)
        return GlooWorks(group, works, buffers)
