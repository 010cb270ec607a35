"""``nccl``: CUDA memory between GPUs of any nodes over NCCL, two-sided.

UNVERIFIED on this project's build machines (no GPU); it needs two GPUs (one per process:
NCCL refuses two ranks on one GPU, and the selector knows it).

Connections are standalone two-rank ``ProcessGroupNCCL`` groups
(:mod:`~tensorwire.transport.process_groups`: rendezvous through the control service, never the
default process group), one per pair of agents and pair of GPUs, made on first use. NCCL
matches point-to-point messages by order, not by tag, so the consumer runs one transfer at a
time per connection (transfers to other GPUs or peers run in parallel) and both sides post
in the same order. Many tensors of one value go as few messages (small ones packed).

Streams: the producer's serving thread makes its current stream wait for the events
recorded at ``put``, and the group orders its NCCL stream after the current stream, so no
send reads a tensor before the work that produced it. The consumer polls the receive's
completion, after which the tensors are usable on any stream.

The group's own timeout is set far beyond any request deadline: tensorwire aborts a group
(``ncclCommAbort``) itself when a transfer fails or passes its deadline, before torch's
watchdog would (by default it ends the process on a timeout).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.errors import TransferTimeoutError, TransportError
from tensorwire.transport.contract import Capabilities, CostModel, FetchRequest, MemoryKind
from tensorwire.transport.hw import topology
from tensorwire.transport.process_groups import (
    CONSUMER_RANK,
    PRODUCER_RANK,
    NcclWorks,
    PairGroupTransport,
    abort_group,
    post_ops,
)
from tensorwire.transport.two_sided import Connection, PostedOps
from tensorwire.transport.waiting import wait_until

__all__ = ["NcclTransport"]

_GROUP_TIMEOUT = datetime.timedelta(hours=6)  # tensorwire aborts long before


class NcclTransport(PairGroupTransport):
    """Two-rank NCCL groups per pair of agents and GPUs; CUDA memory, any node."""

    name = "nccl"
    capabilities = Capabilities(
        one_sided=False,
        same_process=False,
        same_node=True,
        cross_node=True,
        memory=frozenset({MemoryKind.CUDA}),
        can_abort=True,
        distinct_devices=True,
    )
    cost_model = CostModel.uniform(fixed_us=1500, bandwidth_gbps=200.0)  # unverified until measured on GPUs
    ordered = True

    @classmethod
    def library_status(cls) -> str:
        try:
            if not torch.cuda.is_available():
                return "no CUDA device"
            version = torch.cuda.nccl.version()
        except Exception as e:  # noqa: BLE001 - discovery never fails the caller
            return f"unavailable: {type(e).__name__}: {e}"
        return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device visible to this process"
        if not dist.is_available() or not dist.is_nccl_available():
            return "this torch build has no NCCL backend"
        return None

    def new_group(self, store: dist.Store, rank: int, timeout_s: float, scope: str) -> Any:
        """The group, connected on this side's GPU of ``scope`` ("producer UUID->consumer UUID")
        with one small message, so that NCCL's communicator is made while both sides are in
        the ``Connect`` call (a first receive would otherwise wait for a producer that only
        sends after it)."""
        src, _, dst = scope.partition("->")
        index = topology.local_cuda_index(src if rank == PRODUCER_RANK else dst)
        if index is None:
            raise TransportError(f"nccl: this process cannot see GPU {src if rank == PRODUCER_RANK else dst}")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _GROUP_TIMEOUT
        group = dist.ProcessGroupNCCL(store, rank, 2, options)
        device = torch.device("cuda", index)
        probe = torch.zeros(1, device=device)
        with torch.cuda.device(device):
            work = (
                group.send([probe], CONSUMER_RANK, 0)
                if rank == PRODUCER_RANK
                else group.recv([probe], PRODUCER_RANK, 0)
            )
        try:
            wait_until(
                lambda _s: work.is_completed() or None,
                deadline=time.monotonic() + timeout_s,
                what="nccl: the peer's connection",
                pause=lambda _polls, _elapsed_s: 1e-3,
            )
        except TransferTimeoutError:
            abort_group(group)
            raise TransportError("nccl: the peer did not connect before the deadline") from None
        return group

    def connection_scope(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> str:
        """One group per pair of GPUs: (producer GPU, consumer GPU), by UUID."""
        src = sorted({m.device_uuid for m in request.metas if m.device_uuid})
        dst_devices = sorted({topology.cuda_uuid(t.device.index or 0) for t in dst if t.device.type == "cuda"})
        if len(src) != 1 or len(dst_devices) != 1 or any(t.device.type != "cuda" for t in dst):
            raise TransportError("nccl: serves values whose tensors are on one GPU, into one GPU of the consumer")
        if src == dst_devices:
            raise TransportError(
                f"nccl: producer and consumer on one GPU ({src[0]}); NCCL refuses two ranks on one GPU"
            )
        return f"{src[0]}->{dst_devices[0]}"

    def post_sends(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        group = connection.state
        with torch.cuda.device(buffers[0].device if buffers else None):  # NCCL ignores tags: order matches
            works = post_ops(self.name, connection, lambda _t, b: group.send([b], CONSUMER_RANK, 0), tags, buffers)
        return NcclWorks(group, works, buffers)

    def post_recvs(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        group = connection.state
        with torch.cuda.device(buffers[0].device if buffers else None):
            works = post_ops(self.name, connection, lambda _t, b: group.recv([b], PRODUCER_RANK, 0), tags, buffers)
        return NcclWorks(group, works, buffers)
