"""Where a fetched object's bytes land: the one place that decides it.

A fetch names, per tensor, the caller's buffer (``out=``, a parameter) or the device it wants
the tensor on. Before a transport runs, :func:`prepare` picks what it fills:

1. the caller's buffer, where it is contiguous and in memory the transport writes (host, or
   CUDA for transports that read and write CUDA memory);
2. else, for a tensor that lands on the host, a pooled buffer when the fetch asked for pooled
   memory (:mod:`tensorwire.transport.host_pool`: pages already faulted in, reused once the
   tensors on them are gone) or when the transport registers its receive buffers
   (``Capabilities.registers_buffers``) and the owner is on another node: a reused buffer is
   registered once;
3. else a new tensor on the target device where the transport writes that memory, else on
   the host.

After the transfer, :func:`finish` puts every tensor where it was asked for: copied into the
caller's buffer if the transport wrote elsewhere, moved to the target device if it landed on
another one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorwire.transport.contract import Capabilities, MemoryKind, TensorMeta
from tensorwire.transport.host_pool import HostPool, Lease

__all__ = ["finish", "prepare"]

_CPU = torch.device("cpu")


def prepare(
    metas: Sequence[TensorMeta],
    packed_nbytes: int,
    dst: Sequence[torch.Tensor | None] | None,
    targets: Sequence[torch.device] | None,
    caps: Capabilities,
    *,
    pool: HostPool | None = None,
) -> tuple[list[torch.Tensor], Lease | None]:
    """The tensors a transport fills, and the pool lease they use (None if none).

    Args:
        metas: The object's tensors.
        packed_nbytes: The object's packed size (a pooled buffer holds it in that layout).
        dst: The caller's buffers (None entries, or None: none given).
        targets: Where each tensor should land (default: the host).
        caps: The transport's capabilities (which memory it writes).
        pool: Take host tensors from this pool (see the module docstring for when).

    The caller must :meth:`~tensorwire.transport.host_pool.Lease.discard` the lease if the
    transfer fails: a transport that failed may still be writing into it.
    """
    cuda = MemoryKind.CUDA in caps.memory
    result: list[torch.Tensor | None] = []
    for i in range(len(metas)):
        given = dst[i] if dst is not None else None
        writable = given is not None and given.is_contiguous() and (given.is_cpu or (cuda and given.is_cuda))
        result.append(given if writable else None)
    targets = targets or [_CPU] * len(metas)
    lease = _pooled(pool, metas, packed_nbytes, result, targets) if pool is not None else None
    for i, meta in enumerate(metas):
        if result[i] is None:
            target = targets[i]
            device = target if target.type == "cpu" or (cuda and target.type == "cuda") else _CPU
            result[i] = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device)
    return result, lease  # type: ignore[return-value]  # every entry filled above


def _pooled(
    pool: HostPool,
    metas: Sequence[TensorMeta],
    packed_nbytes: int,
    result: list[torch.Tensor | None],
    targets: Sequence[torch.device],
) -> Lease | None:
    """Fill the empty entries of ``result`` that land on the host with tensors on one pooled
    buffer, in the object's packed layout; the lease, or None when nothing was pooled."""
    missing = [i for i, r in enumerate(result) if r is None and targets[i].type == "cpu" and metas[i].nbytes]
    if not missing:
        return None
    lease = pool.lease(packed_nbytes)
    if lease is None:
        return None
    buffer = torch.from_numpy(lease.array)
    for i in missing:
        meta = metas[i]
        piece = buffer[meta.offset : meta.offset + meta.nbytes]
        result[i] = piece.view(getattr(torch, meta.dtype)).view(meta.shape)
    return lease


def finish(
    tensors: list[torch.Tensor],
    dst: Sequence[torch.Tensor | None] | None,
    targets: Sequence[torch.device] | None,
) -> list[torch.Tensor]:
    """Every fetched tensor where it was asked for: the caller's own buffer (copied into it
    when the transport wrote elsewhere), else on its target device (moved when it landed on
    another one). Zero-copy views stay views when they are already in place."""
    for i, tensor in enumerate(tensors):
        given = dst[i] if dst is not None else None
        if given is not None:
            if given is not tensor:
                given.copy_(tensor)
                tensors[i] = given
        elif targets and tensor.device != targets[i]:
            tensors[i] = tensor.to(targets[i])
    return tensors
