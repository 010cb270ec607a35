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
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.transport.contract import Capabilities, CostModel, MemoryKind
from tensorwire.transport.process_groups import CONSUMER_RANK, PRODUCER_RANK, GlooWorks, PairGroupTransport, post_ops
from tensorwire.transport.two_sided import Connection, PostedOps

__all__ = ["GlooTransport"]


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

    @classmethod
    def library_status(cls) -> str:
        return "available" if dist.is_available() and dist.is_gloo_available() else "not built into torch"

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
