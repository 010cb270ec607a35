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

__all__ = ["fills_in_place", "finish", "prepare"]

_CPU = torch.device("cpu")


def prepare(
    metas: Sequence[TensorMeta],
    packed_nbytes: int,
    dst: Sequence[torch.Tensor | None] | None,
    targets: Sequence[torch.device] | None,
    caps: Capabilities,
    *,
    pool: HostPool | None = None,
    pooled: bool = False,
    other_node: bool = False,
) -> tuple[list[torch.Tensor], Lease | None]:
    """The tensors a transport fills, and the pool lease they use (None if none).

    Args:
        metas: The object's tensors.
        packed_nbytes: The object's packed size (a pooled buffer holds it in that layout).
        dst: The caller's buffers (None entries, or None: none given).
        targets: Where each tensor should land (default: the host).
        caps: The transport's capabilities (which memory it writes, whether it registers
            its receive buffers).
        pool: This process's host pool; None: never pool (e.g. a view was asked for).
        pooled: The caller asked for pooled memory.
        other_node: The owner is on another node.

    The caller must :meth:`~tensorwire.transport.host_pool.Lease.discard` the lease if the
    transfer fails: a transport that failed may still be writing into it.
    """
    cuda = MemoryKind.CUDA in caps.memory
    result: list[torch.Tensor | None] = [
        given if _writable(given, cuda) else None for given in (dst if dst is not None else [None] * len(metas))
    ]
    targets = targets or [_CPU] * len(metas)
    use_pool = pool is not None and (pooled or (caps.registers_buffers and other_node))
    lease = _pooled(pool, metas, packed_nbytes, result, targets) if use_pool else None
    return [
        chosen if chosen is not None else _new(meta, target, cuda)
        for chosen, meta, target in zip(result, metas, targets, strict=True)
    ], lease


def fills_in_place(caps: Capabilities, dst: Sequence[torch.Tensor | None], count: int) -> bool:
    """Whether :func:`prepare` gives a transport with ``caps`` the caller's own buffer for
    every one of ``count`` tensors (nothing is copied after the transfer)."""
    cuda = MemoryKind.CUDA in caps.memory
    return len(dst) == count and all(_writable(given, cuda) for given in dst)


def _writable(given: torch.Tensor | None, cuda: bool) -> bool:
    """Whether the transport can fill the caller's buffer ``given`` itself."""
    return given is not None and given.is_contiguous() and (given.is_cpu or (cuda and given.is_cuda))


def _new(meta: TensorMeta, target: torch.device, cuda: bool) -> torch.Tensor:
    """A new tensor for ``meta`` on ``target`` where the transport writes that memory, else on the host."""
    device = target if target.type == "cpu" or (cuda and target.type == "cuda") else _CPU
    return torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device)


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
    typed: dict[str, tuple[torch.Tensor, int]] = {}  # dtype -> (the buffer as that dtype, its item size)
    for i in missing:
        meta = metas[i]
        as_dtype = typed.get(meta.dtype)
        if as_dtype is None:  # offsets are ALIGNMENT-aligned, so every tensor starts on a whole item
            dtype = getattr(torch, meta.dtype)
            whole_nbytes = len(buffer) - len(buffer) % dtype.itemsize
            as_dtype = typed[meta.dtype] = (buffer[:whole_nbytes].view(dtype), dtype.itemsize)
        view, itemsize = as_dtype
        start, count = meta.offset // itemsize, meta.nbytes // itemsize
        piece = view[start : start + count]
        if meta.offset % itemsize or count * itemsize != meta.nbytes or len(piece) != count:  # not the packed layout
            piece = buffer[meta.offset : meta.offset + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape)
        elif len(meta.shape) != 1 or meta.shape[0] != count:
            piece = piece.view(meta.shape)  # (the usual 1-D tensor needs no second call)
        result[i] = piece
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
