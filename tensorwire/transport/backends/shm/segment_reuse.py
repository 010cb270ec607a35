"""shm: one segment for tensors returned again unchanged, shared by every object made of them.

An actor that returns the same tensors call after call (parameters it did not update, a buffer
it did not touch) makes a new object each time. Where the shm transport packs objects into
segments (direct reads off or refused, and always for views), each such object was packed into
a new segment: the kernel allocates and zeroes fresh pages, then the bytes are copied in. The
:class:`SegmentCache` keeps the last segment made for a sequence of tensors (same storages,
offsets, sizes and packed layout), and a later object of the same tensors whose version
counters (``tensor._version``) have not moved shares that segment instead.

A segment's packed bytes are written once and never again; what changes is a *live byte* per
object, after the packed bytes (the first object's at ``packed_nbytes``, the next one's one
further on: the descriptor server reports each object's segment size as ending at its live
byte). Freeing one object clears its byte only, so the others stay readable, and a view of an
earlier object keeps exactly the bytes it saw.

A version counter does not see every write: not writes through ``tensor.data``, through a
numpy array or a DLPack capsule sharing the memory, or by another library. So by default
(``TENSORWIRE_SHM_REUSE=verify``) an unmoved counter is confirmed by comparing the bytes
(``memcmp`` against the segment, mapped once: 4.5 ms for 64 MiB on the 2-core build VM, where
packing into fresh pages took 25.6 ms); ``version`` trusts the counters alone (5 us); ``off``
packs every object.

Memory: a cached segment outlives its objects while its tensors live (that is the point), up to
``TENSORWIRE_SHM_REUSE_NBYTES`` of segments in all (default 1 GiB; least recently used go
first); an entry goes when any of its storages is freed. Once compared, a cached segment is
also mapped in the producer (so it counts in the producer's RSS; it is the same memory).
"""

from __future__ import annotations

import collections
import ctypes
import enum
import functools
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tensorwire.transport.contract import StoredObject

__all__ = ["MAX_SHARERS", "ReuseMode", "SegmentCache"]

LIVE, FREED = b"\x01", b"\x00"
MAX_SHARERS = 4096  # objects one segment serves (live bytes after its packed bytes); then a new one
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_DEFAULT_BUDGET_NBYTES = 1 << 30


class ReuseMode(enum.Enum):
    """When a later object may share an earlier object's segment."""

    VERIFY = "verify"  # same tensors, counters unmoved, and the bytes compare equal
    VERSION = "version"  # same tensors, counters unmoved
    OFF = "off"  # never

    @classmethod
    def from_env(cls) -> ReuseMode:
        raw = os.environ.get("TENSORWIRE_SHM_REUSE", "").strip().lower() or cls.VERIFY.value
        try:
            return cls(raw)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"environment variable TENSORWIRE_SHM_REUSE={raw!r} is not one of {choices}") from None


def _budget_from_env() -> int:
    raw = os.environ.get("TENSORWIRE_SHM_REUSE_NBYTES", "").strip()
    if not raw:
        return _DEFAULT_BUDGET_NBYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable TENSORWIRE_SHM_REUSE_NBYTES={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"environment variable TENSORWIRE_SHM_REUSE_NBYTES={raw!r} must not be negative")
    return value


@dataclass
class _Entry:
    """One cached segment: the cache's own descriptor, what it was packed from, its next live byte."""

    number: int
    fd: int
    nbytes: int
    storages: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    next_sharer: int = 1  # the first object's live byte is at packed_nbytes
    mapping: mmap.mmap | None = None  # read-only, made when a later object's bytes are first compared
    address: int = 0

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
        os.close(self.fd)


def _identity(obj: StoredObject) -> tuple[tuple, tuple[torch.UntypedStorage, ...], tuple[int, ...]]:
    """The cache key of an object's tensors, their storages and their version counters."""
    storages = tuple(t.untyped_storage() for t in obj.tensors)
    key = (
        obj.packed_nbytes,
        tuple(
            (s.data_ptr(), t.storage_offset() * t.element_size(), m.nbytes, m.offset)
            for t, s, m in zip(obj.tensors, storages, obj.metas, strict=True)
        ),
    )
    return key, storages, tuple(t._version for t in obj.tensors)


_memcmp = ctypes.CDLL(None).memcmp  # releases the GIL while it compares
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _same_bytes(entry: _Entry, obj: StoredObject) -> bool:
    """Whether the entry's segment holds exactly the object's tensors' bytes now. Maps the
    segment on first use and keeps the mapping with the entry (mapping 64 MiB costs about as
    much as comparing it); False when it cannot be mapped (the object is then packed anew,
    which reports a lack of memory)."""
    if entry.mapping is None:
        try:
            entry.mapping = mmap.mmap(entry.fd, entry.nbytes, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        except OSError:
            return False
        segment = np.frombuffer(entry.mapping, dtype=np.uint8)
        entry.address = segment.ctypes.data  # valid while the mapping is open
        del segment  # (an exported buffer would keep the mapping from closing)
    return all(
        _memcmp(entry.address + m.offset, t.data_ptr(), m.nbytes) == 0
        for t, m in zip(obj.tensors, obj.metas, strict=True)
        if m.nbytes
    )


class SegmentCache:
    """Producer: the last segment made for each sequence of tensors, shared by later objects of
    the same unchanged tensors. One per shm transport; any thread may call it."""

    def __init__(self, mode: ReuseMode | None = None, budget_nbytes: int | None = None) -> None:
        self._mode, self._budget_nbytes = mode, budget_nbytes  # None: the environment's, read at each call
        self.shared = 0  # objects that got a cached segment (for tests and stats)
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._nbytes = 0
        self._numbers = itertools.count()
        # Not re-entrant on purpose: a storage's weakref callback may run inside a locked block on
        # this thread (a tensor freed there); it then leaves its entry to the next call (_died).
        self._lock = threading.Lock()
        self._dead: collections.deque[tuple[tuple, int]] = collections.deque()
        weakref.finalize(self, _close_entries, self._entries)  # the safety net of close()

    def segment(self, obj: StoredObject, pack: Callable[[StoredObject], int]) -> tuple[int, int]:
        """Producer, when the object's segment is wanted: a descriptor the caller owns of a
        segment holding its packed bytes, and the offset of the object's own live byte (set).
        Blocks for ``pack`` (which returns a new segment's descriptor, packed) unless a cached
        segment serves; raises what ``pack`` raises."""
        mode = ReuseMode.from_env() if self._mode is None else self._mode
        budget_nbytes = self.budget_nbytes()
        if mode is ReuseMode.OFF or not 0 < obj.packed_nbytes <= budget_nbytes:
            return _first_sharer(pack(obj), obj)
        key, storages, versions = _identity(obj)
        shared = self._share(key, storages, versions, obj, verify=mode is ReuseMode.VERIFY)
        if shared is not None:
            return shared
        fd, offset = _first_sharer(pack(obj), obj)
        self._keep(key, storages, versions, fd, obj.packed_nbytes, budget_nbytes=budget_nbytes)
        return fd, offset

    def budget_nbytes(self) -> int:
        """Bytes of segments this cache may keep in all."""
        return _budget_from_env() if self._budget_nbytes is None else self._budget_nbytes

    def _share(
        self, key: tuple, storages: tuple, versions: tuple[int, ...], obj: StoredObject, *, verify: bool
    ) -> tuple[int, int] | None:
        """A descriptor of the cached segment of these very tensors, unchanged, and the next
        live byte in it; None if there is none (the bytes are compared under the lock: dropping
        an entry closes its mapping)."""
        with self._lock:
            self._purge()
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.versions != versions or any(r() is not s for r, s in zip(entry.storages, storages, strict=True)):
                self._drop(key)  # written since: its segment serves its own objects only
                return None
            self._entries.move_to_end(key)
            if entry.next_sharer >= MAX_SHARERS or (verify and not _same_bytes(entry, obj)):
                return None
            offset = entry.nbytes + entry.next_sharer
            entry.next_sharer += 1
            fd = os.dup(entry.fd)
        try:
            os.pwrite(fd, LIVE, offset)  # past the end: the segment grows by a byte
        except BaseException:
            os.close(fd)
            raise
        self.shared += 1
        return fd, offset

    def _keep(
        self, key: tuple, storages: tuple, versions: tuple[int, ...], fd: int, nbytes: int, *, budget_nbytes: int
    ) -> None:
        number = next(self._numbers)
        died = weakref.WeakMethod(self._died)  # the storages' callbacks do not keep the cache alive
        refs = tuple(weakref.ref(s, functools.partial(_storage_died, died, key, number)) for s in storages)
        with self._lock:
            self._drop(key)
            self._entries[key] = _Entry(number, os.dup(fd), nbytes, refs, versions)
            self._nbytes += nbytes
            while self._nbytes > budget_nbytes:
                self._drop(next(iter(self._entries)))

    def _died(self, key: tuple, number: int) -> None:
        """A storage of an entry was freed (any thread, maybe inside a locked block of this one)."""
        self._dead.append((key, number))
        if self._lock.acquire(blocking=False):
            try:
                self._purge()
            finally:
                self._lock.release()

    def _purge(self) -> None:
        while self._dead:
            key, number = self._dead.popleft()
            entry = self._entries.get(key)
            if entry is not None and entry.number == number:
                self._drop(key)

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._nbytes -= entry.nbytes
            entry.close()

    def cached_nbytes(self) -> int:
        """Bytes of the segments kept for later objects."""
        with self._lock:
            self._purge()
            return self._nbytes

    def close(self) -> None:
        """At shutdown: close every cached segment (objects' own descriptors stay theirs)."""
        with self._lock:
            self._dead.clear()
            while self._entries:
                self._drop(next(iter(self._entries)))


def _storage_died(died: weakref.WeakMethod, key: tuple, number: int, _: weakref.ref) -> None:
    method = died()
    if method is not None:
        method(key, number)


def _close_entries(entries: dict[tuple, _Entry]) -> None:
    for entry in entries.values():
        entry.close()
    entries.clear()


def _first_sharer(fd: int, obj: StoredObject) -> tuple[int, int]:
    """A new segment's first live byte, set: right after the packed bytes."""
    try:
        os.pwrite(fd, LIVE, obj.packed_nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, obj.packed_nbytes
