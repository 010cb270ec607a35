"""Where a bucket's bytes wait for its readers, in the server and in the readers.

* :func:`stage`: pieces that cannot be read in place (strided, or converted to another dtype)
  gathered into a slot of a per-stream pool (:func:`pool`), on their device;
* same-node host readers: a staging ring of :data:`~..planning.buckets.IN_FLIGHT` slots that
  they keep mapped (:func:`ring`, from a transport with ``Capabilities.staging_rings``),
  packed with :func:`write_slot` and unpacked with :func:`read_slot` (:func:`ring_reader`);
* :func:`checksum` of a bucket's bytes (``verify=True``), where they are.

Everything is kept per (sync id, rank, stream) across pushes and dropped by :func:`release`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tensorwire.collectives.weight_sync.planning.buckets import IN_FLIGHT
from tensorwire.errors import TensorwireError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.transport.packing import byte_view, packed_layout

__all__ = [
    "Piece",
    "as_wire",
    "checksum",
    "in_place",
    "pool",
    "read_slot",
    "release",
    "ring",
    "ring_reader",
    "stage",
    "staged_nbytes",
    "write_slot",
]

_MASK = (1 << 64) - 1

# A bucket's pieces on the sending side: (a view of the sender's tensor, the dtype to send as).
Piece = tuple[torch.Tensor, torch.dtype]
StreamKey = tuple[str, int, int]  # (sync id, the server's channel rank, stream)

_rings: dict[StreamKey, Any] = {}  # a staging transport's rings (Transport.staging_ring)
_pools: dict[StreamKey, list[torch.Tensor]] = {}  # per stream: a buffer per slot (staged pieces)
_readers: dict[str, tuple[str, Any]] = {}  # sync id -> (its transport, a ring reader)


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """A 64-bit checksum of the tensors' bytes, in order, computed where they are (GPU or
    host) without a copy of contiguous ones: position-weighted sums of 64-bit words (or bytes)."""
    total = 0
    for position, tensor in enumerate(tensors, start=1):
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        words = flat.view(torch.uint8)
        if words.numel() % 8 == 0:
            value = int(words.view(torch.int64).sum().item())
        else:
            value = int(words.sum(dtype=torch.int64).item())
        total = (total + position * (value & _MASK) + words.numel()) & _MASK
    return total


def as_wire(piece: Piece) -> torch.Tensor:
    """A piece as a contiguous tensor of its wire dtype (a view when it already is one)."""
    view, dtype = piece
    if view.dtype != dtype:
        return view.to(dtype)
    return view if view.is_contiguous() else view.contiguous()


def _direct(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and not tensor.is_cuda and tensor.is_contiguous()


def in_place(view: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a piece can be published as it is: contiguous, already in its wire dtype."""
    return view.dtype == dtype and view.is_contiguous()


def stage(pieces: Sequence[Piece], buffers: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
    """Pieces (on one device) as tensors to publish: views of the sender's tensors where
    they can be read in place, else copies (gathered, converted) into ``buffers[slot]``, which
    grows to the largest need, follows the pieces' device and is reused."""
    staged = [i for i, (view, dtype) in enumerate(pieces) if not in_place(view, dtype)]
    if not staged:
        return [view for view, _dtype in pieces]
    offsets, total = packed_layout(pieces[i][0].numel() * pieces[i][1].itemsize for i in staged)
    device = pieces[staged[0]][0].device
    if buffers[slot].numel() < total or buffers[slot].device != device:
        buffers[slot] = torch.empty(total, dtype=torch.uint8, device=device)
    result = [view for view, _dtype in pieces]
    for i, offset in zip(staged, offsets, strict=True):
        view, dtype = pieces[i]
        target = buffers[slot][offset : offset + view.numel() * dtype.itemsize].view(dtype).view(view.shape)
        target.copy_(view)
        result[i] = target
    return result


def write_slot(array: np.ndarray, pieces: Sequence[Piece]) -> None:
    """Pack host pieces into a slot's bytes at their packed-layout offsets, converting dtypes
    and gathering strided views in the one copy."""
    offsets, total = packed_layout(v.numel() * d.itemsize for v, d in pieces)
    if total > array.size:
        raise ValueError(f"a bucket of {total} bytes does not fit a {array.size}-byte slot")
    for (view, dtype), offset in zip(pieces, offsets, strict=True):
        nbytes = view.numel() * dtype.itemsize
        if _direct(view, dtype):
            np.copyto(array[offset : offset + nbytes], byte_view(view).numpy())
        elif nbytes:
            target = torch.from_numpy(array[offset : offset + nbytes]).view(dtype).view(view.shape)
            target.copy_(view)


def read_slot(array: np.ndarray, dst: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> float:
    """Copy a bucket out of a slot into ``dst`` (views of the reader's tensors; the slot holds
    each as ``dtypes[i]``). Returns the seconds spent on strided or converted targets."""
    offsets, total = packed_layout(t.numel() * d.itemsize for t, d in zip(dst, dtypes, strict=True))
    if total > array.size:
        raise ValueError(f"a bucket of {total} bytes does not fit a {array.size}-byte slot")
    slow_s = 0.0
    for tensor, dtype, offset in zip(dst, dtypes, offsets, strict=True):
        nbytes = tensor.numel() * dtype.itemsize
        if _direct(tensor, dtype):
            np.copyto(byte_view(tensor).numpy(), array[offset : offset + nbytes])
            continue
        if not nbytes:
            continue
        start = time.perf_counter()
        with warnings.catch_warnings():  # a read-only mapping: only read here
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(array[offset : offset + nbytes])
        tensor.copy_(flat.view(dtype).view(tensor.shape))
        slow_s += time.perf_counter() - start
    return slow_s


def ring_reader(sync_id: str) -> tuple[str, Any]:
    """This process's reader of sync ``sync_id``'s rings, and the transport that made it."""
    found = _readers.get(sync_id)
    if found is None:
        staging = runtime_agent().staging()
        if staging is None:
            raise TensorwireError("a bucket came in a staging ring, but no transport here offers staging rings")
        found = _readers[sync_id] = (staging.name, staging.ring_reader())
    return found


def release(sync_id: str) -> None:
    """Drop the staging rings and ring mappings of sync ``sync_id`` in this process."""
    for key in [key for key in _rings if key[0] == sync_id]:
        _rings.pop(key).close()
    for key in [key for key in _pools if key[0] == sync_id]:
        del _pools[key]
    found = _readers.pop(sync_id, None)
    if found is not None:
        found[1].close()


def ring(key: StreamKey, staging: Any, slot_nbytes: int) -> Any:
    """The staging ring of stream ``key`` (made by transport ``staging``), with slots of at
    least ``slot_nbytes``; kept across pushes."""
    found = _rings.get(key)
    if found is None or found.slot_nbytes < slot_nbytes:
        if found is not None:
            found.close()
        found = _rings[key] = staging.staging_ring(slot_nbytes)
    return found


def pool(key: StreamKey) -> list[torch.Tensor]:
    """The staging pool of stream ``key``: a buffer per slot, grown by :func:`stage`."""
    found = _pools.get(key)
    if found is None:
        found = _pools[key] = [torch.empty(0, dtype=torch.uint8) for _ in range(IN_FLIGHT)]
    return found


def staged_nbytes(key: StreamKey) -> int:
    """Bytes stream ``key`` keeps staged: its ring and its pool."""
    found = _rings.get(key)
    return (found.nbytes if found is not None else 0) + sum(b.numel() for b in _pools.get(key, ()))
