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
import logging
import mmap
import threading
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["HostPool", "Lease", "liveness"]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_mappings: dict[int, weakref.ref] = {}  # start address -> every pool's mapping there (gone: its entry goes)


def _remember(memory: mmap.mmap) -> None:
    address = np.frombuffer(memory, dtype=np.uint8, count=1).ctypes.data

    def forget(ref: weakref.ref, address: int = address) -> None:
        if _mappings.get(address) is ref:
            del _mappings[address]

    _mappings[address] = weakref.ref(memory, forget)


class _Mapped:
    """Liveness of a pool's mapping (``expired()``, as torch's ``StorageWeakRef`` has)."""

    __slots__ = ("_ref",)

    def __init__(self, ref: weakref.ref) -> None:
        self._ref = ref

    def expired(self) -> bool:
        return self._ref() is None


def liveness(tensor: torch.Tensor) -> Any:
    """Whether the memory ``tensor`` lives in still exists, as an object with ``expired()``:
    for memory a pool leased, the mapping's (it outlives the tensors of one lease, so a
    registration of it stays good for the next value leased there); else the storage's."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storage = tensor.untyped_storage()
    ref = _mappings.get(storage.data_ptr())
    if ref is not None and ref() is not None:
        return _Mapped(ref)
    return StorageWeakRef(storage)


class Lease:
    """One buffer of a :class:`HostPool` (consumer side): ``array`` (uint8, the requested
    length), which goes back to the pool when it is collected. The holder keeps the lease
    only while the fetch runs: a kept lease keeps the array."""

    def __init__(self, array: np.ndarray, finalizer: weakref.finalize) -> None:
        self.array = array
        self._finalizer = finalizer

    def discard(self) -> None:
        """Never give this memory back to the pool (its fetch failed); it is unmapped when the
        array goes."""
        self._finalizer.detach()


class HostPool:
    """Idle host buffers by size, at most ``max_idle_nbytes`` of them in this process (least
    recently idle go first; 0 keeps nothing). Thread-safe.

    Buffers come back through a finalizer of each leased array, which may run in any thread,
    inside garbage collection and while the array still holds its buffer: it only queues the
    buffer; :meth:`_settle` files it under the lock at the next call. Dropped buffers are never
    closed here, only let go of: a mapping goes when its last user does.

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
        self._returned: collections.deque[mmap.mmap] = collections.deque()  # appended by finalizers
        self._lock = threading.Lock()
        self._reused = 0
        self._made = 0

    def lease(self, nbytes: int) -> Lease | None:
        """A buffer of ``nbytes`` bytes (reused when one of that size is idle), or None when
        the request is too small to pool, the pool keeps nothing or no memory can be mapped."""
        if nbytes < self.min_nbytes or self.max_idle_nbytes <= 0 or nbytes > self.max_idle_nbytes:
            return None
        size = -(-nbytes // _PAGE) * _PAGE
        with self._lock:
            self._settle()
            free = self._idle.get(size)
            memory = free.pop() if free else None
            if free is not None and not free:
                del self._idle[size]
            if memory is not None:
                self._idle_nbytes -= size
                self._reused += 1
        if memory is None:
            try:
                memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
            except OSError as e:
                logger.debug("host pool: no %d-byte mapping (%s): allocating as usual", size, e)
                return None
            _remember(memory)
            with self._lock:
                self._made += 1
        array = np.frombuffer(memory, dtype=np.uint8, count=nbytes)
        finalizer = weakref.finalize(array, self._returned.append, memory)
        finalizer.atexit = False
        return Lease(array, finalizer)

    def _settle(self) -> None:
        """File the buffers given back since the last call, dropping the oldest idle ones
        beyond the limit (under the lock)."""
        while self._returned:
            memory = self._returned.popleft()
            self._idle.setdefault(len(memory), []).append(memory)
            self._idle.move_to_end(len(memory))
            self._idle_nbytes += len(memory)
        while self._idle_nbytes > self.max_idle_nbytes and self._idle:
            oldest_size, buffers = next(iter(self._idle.items()))
            buffers.pop(0)
            self._idle_nbytes -= oldest_size
            if not buffers:
                del self._idle[oldest_size]

    def close(self) -> None:
        """Let go of every idle buffer and keep none from now on (leased ones go when their
        tensors do)."""
        with self._lock:
            self.max_idle_nbytes = 0
            self._settle()

    def stats(self) -> dict[str, int]:
        """Idle bytes and buffers, and how many leases were reused or newly mapped."""
        with self._lock:
            self._settle()
            buffers = sum(len(b) for b in self._idle.values())
            idle = self._idle_nbytes
        return {"idle_nbytes": idle, "idle_buffers": buffers, "reused": self._reused, "made": self._made}
