"""Reusable host memory for fetched values: pages already faulted in, recycled when the last
tensor on them dies.

Writing into memory a process has just allocated costs a page fault per 4 KiB page (about
2.5 GB/s on the 2-core build VM, against 7-13 GB/s into memory already mapped), so a consumer
that receives a value of the same size again and again (an actor's weights, every step) pays
most of each fetch in faults. A :class:`HostPool` keeps the memory of values whose tensors are
gone and hands it to the next fetch of that size.

Safety: a lease's memory goes back to the pool only when the numpy array over it is
collected, which happens only when no tensor, view or numpy array on it is left (torch keeps
the array alive through every storage made from it). A lease whose fetch failed is dropped
(:meth:`Lease.discard`), never recycled, so a transfer that may still be writing cannot reach
the next value.
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from tensorwire.transport.base import TensorMeta

__all__ = ["HostPool", "Lease", "fill_from_pool"]

_PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Lease:
    """One buffer of a :class:`HostPool`: ``array`` (uint8, ``nbytes`` long) until it is collected."""

    def __init__(self, array: np.ndarray, finalizer: weakref.finalize) -> None:
        self.array = array
        self._finalizer = finalizer

    def discard(self) -> None:
        """Never give this memory back to the pool (its fetch failed); it is unmapped when the
        array goes."""
        self._finalizer.detach()


class HostPool:
    """Idle host buffers by size, at most ``max_idle_nbytes`` of them (least recently idle go
    first; 0 keeps nothing). Thread-safe.

    Args:
        max_idle_nbytes: Bytes of idle memory kept for later fetches.
        min_nbytes: Smaller requests are not pooled (``lease`` returns None): malloc is cheap
            for them.
    """

    def __init__(self, max_idle_nbytes: int, min_nbytes: int = 1 << 20) -> None:
        self.max_idle_nbytes = max_idle_nbytes
        self.min_nbytes = min_nbytes
        self._idle: collections.OrderedDict[int, list[mmap.mmap]] = collections.OrderedDict()
        self._idle_nbytes = 0
        self._lock = threading.RLock()  # finalizers may run inside ``lease`` (garbage collection)
        self._reused = 0
        self._made = 0

    def lease(self, nbytes: int) -> Lease | None:
        """A buffer of ``nbytes`` bytes (reused when one of that size is idle), or None when
        the request is too small to pool or the pool keeps nothing."""
        if nbytes < self.min_nbytes or self.max_idle_nbytes <= 0 or nbytes > self.max_idle_nbytes:
            return None
        size = -(-nbytes // _PAGE) * _PAGE
        with self._lock:
            free = self._idle.get(size)
            memory = free.pop() if free else None
            if free is not None and not free:
                del self._idle[size]
            if memory is not None:
                self._idle_nbytes -= size
                self._reused += 1
            else:
                self._made += 1
        if memory is None:
            try:
                memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
            except OSError:
                return None  # no memory for it now: the caller allocates as usual
        array = np.frombuffer(memory, dtype=np.uint8, count=nbytes)
        finalizer = weakref.finalize(array, self._give_back, memory)
        finalizer.atexit = False
        return Lease(array, finalizer)

    def _give_back(self, memory: mmap.mmap) -> None:
        size = len(memory)
        dropped: list[mmap.mmap] = []
        with self._lock:
            self._idle.setdefault(size, []).append(memory)
            self._idle.move_to_end(size)
            self._idle_nbytes += size
            while self._idle_nbytes > self.max_idle_nbytes and self._idle:
                oldest_size, buffers = next(iter(self._idle.items()))
                dropped.append(buffers.pop(0))
                self._idle_nbytes -= oldest_size
                if not buffers:
                    del self._idle[oldest_size]
        for old in dropped:
            old.close()

    def close(self) -> None:
        """Unmap every idle buffer and keep none from now on (leased ones are unmapped when
        their tensors go)."""
        with self._lock:
            self.max_idle_nbytes = 0
            idle = [m for buffers in self._idle.values() for m in buffers]
            self._idle.clear()
            self._idle_nbytes = 0
        for memory in idle:
            memory.close()

    def stats(self) -> dict[str, int]:
        """Idle bytes and buffers, and how many leases were reused or newly mapped."""
        with self._lock:
            buffers = sum(len(b) for b in self._idle.values())
            idle = self._idle_nbytes
        return {"idle_nbytes": idle, "idle_buffers": buffers, "reused": self._reused, "made": self._made}


def fill_from_pool(
    pool: HostPool,
    metas: Sequence[TensorMeta],
    packed_nbytes: int,
    dst: list[torch.Tensor | None],
    targets: Sequence[torch.device],
) -> Lease | None:
    """Fill the empty host entries of ``dst`` with tensors on one pooled buffer in the object's
    packed layout; the lease (None if nothing was pooled) is the caller's to
    :meth:`~Lease.discard` should the fetch fail."""
    missing = [i for i, d in enumerate(dst) if d is None and targets[i].type == "cpu" and metas[i].nbytes]
    if not missing:
        return None
    lease = pool.lease(packed_nbytes)
    if lease is None:
        return None
    buffer = torch.from_numpy(lease.array)
    for i in missing:
        meta = metas[i]
        piece = buffer[meta.offset : meta.offset + meta.nbytes]
        dst[i] = piece.view(getattr(torch, meta.dtype)).view(meta.shape)
    return lease
