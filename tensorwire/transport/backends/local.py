"""``local``: producer and consumer are one process; the consumer gets the producer's tensors."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from tensorwire.errors import TransferTimeoutError
from tensorwire.transport.contract import Capabilities, CostModel, FetchRequest, MemoryKind, Transport
from tensorwire.transport.packing import byte_view, copy_before

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    """Same process: no copy. ``view`` returns the stored tensors themselves.

    ``fetch`` (used when the caller gave ``out=`` buffers) copies into them.
    """

    name = "local"
    capabilities = Capabilities(
        one_sided=True,
        same_process=True,
        same_node=False,
        cross_node=False,
        memory=frozenset({MemoryKind.HOST, MemoryKind.CUDA}),
        zero_copy_view=True,
    )
    cost_model = CostModel.uniform(fixed_us=2, bandwidth_gbps=1e6)  # measured on the 2-core build VM

    def fetch(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
        """Consumer (= owner process): copy the stored tensors into ``dst``; blocks for the copy."""
        stored = self.context.local_object(request.object_id, request.token)
        what = f"local copy of {request!r}"
        for src, out in zip(stored.tensors, dst, strict=True):
            if _plain_host(src) and _plain_host(out) and src.dtype == out.dtype and src.shape == out.shape:
                copy_before(byte_view(out).numpy(), byte_view(src).numpy(), request.deadline, what)
            else:
                if time.monotonic() >= request.deadline:
                    raise TransferTimeoutError(f"{what}: not complete before the deadline")
                out.copy_(src)

    def view(self, request: FetchRequest) -> list[torch.Tensor]:
        """Consumer (= owner process): the producer's own tensors, shared, no copy."""
        return list(self.context.local_object(request.object_id, request.token).tensors)


def _plain_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
