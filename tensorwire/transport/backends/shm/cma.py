"""Cross-memory attach: a consumer copies straight out of the producer's memory.

``process_vm_readv`` (Linux 3.2) copies from another process's address space into ours in
one pass, with no shared segment to fill first. The kernel allows it where the caller may
``ptrace`` the target (same user; Yama's ``ptrace_scope`` 0; no seccomp filter denying it):
:func:`unavailable_reason` detects that once per process and ``tensorwire doctor`` reports
it. ``TENSORWIRE_SHM_DIRECT=0`` turns it off (shm then packs every object into a segment).

The producer hands out addresses only after the object's token checked out (its descriptor
server, :mod:`tensorwire.transport.backends.shm.memfd`), together with the address of a *live word*: a
random 64-bit nonce in memory the producer never frees, overwritten when the object is
freed. A consumer reads the tensors, then the live word (one call for an object of a few
tensors: the kernel copies the iovecs in order); a mismatch means the object was freed (or its
process replaced) during the copy, and the bytes are not used.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from tensorwire.errors import TransferTimeoutError, TransportError

__all__ = [
    "DirectRead",
    "LiveWords",
    "PermissionLost",
    "disable",
    "enabled",
    "pack_addresses",
    "prepared_read",
    "read_into",
    "speed_vs_memcpy",
    "unavailable_reason",
    "unpack_addresses",
]

_IOV_MAX = 1024
_HEADER = struct.Struct("!QQI")  # live word address, nonce, tensor count
_RANGE = struct.Struct("!QQ")  # address, bytes
_RANGE_WORDS = np.dtype(">u8")  # the same, as array words
THREADED_MIN_NBYTES = 32 << 20  # a copy at least this large is split over the copy threads
STEP_NBYTES = 16 << 20  # a copy that might miss its deadline goes in steps of this size
_SLOW_BYTES_PER_S = 0.5e9  # a loaded machine's copy rate, for "surely done in time"
_FEW = 64  # an object of fewer tensors is read with its live word in one call


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class PermissionLost(TransportError):
    """The kernel refused ``process_vm_readv`` (ptrace policy, seccomp): use segments."""


_libc: ctypes.CDLL | None = None
_reason: str | None = None
_checked = False
_lock = threading.Lock()
_speed: list[float] = []  # speed_vs_memcpy's measurement, once
_PROBE_NBYTES = 32 << 20


def _readv() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.process_vm_readv.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        _libc.process_vm_readv.restype = ctypes.c_ssize_t
    return _libc.process_vm_readv


_unchecked: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]


def _unchecked_readv() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """``process_vm_readv`` without argument types, for calls whose arguments are all ctypes
    objects made once (:func:`prepared_read`): checking and converting six arguments costs
    about 0.8 us a call, a third of a 4 KiB read. A plain Python int passed to it would go as a
    32-bit C int."""
    global _unchecked
    if _unchecked is None:
        _readv()  # loads the C library
        function = _libc["process_vm_readv"]  # indexing makes a function object of its own: no argtypes
        function.restype = ctypes.c_ssize_t
        _unchecked = function
    return _unchecked


def _probe() -> str | None:
    """Why this process cannot read another's memory, or None. Reads our own memory (the
    syscall exists, no seccomp filter) and checks Yama's policy."""
    try:
        readv = _readv()
    except (OSError, AttributeError):
        return "this system's C library has no process_vm_readv"
    src, dst = ctypes.create_string_buffer(b"tw", 2), ctypes.create_string_buffer(2)
    local, remote = _Iovec(ctypes.addressof(dst), 2), _Iovec(ctypes.addressof(src), 2)
    if readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != 2 or dst.raw != b"tw":
        return f"process_vm_readv fails here ({os.strerror(ctypes.get_errno())}; seccomp or an old kernel)"
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        return None  # no Yama: the classic same-user ptrace check applies
    if scope != "0":
        return f"Yama ptrace_scope is {scope} (only 0 lets a process read a sibling's memory)"
    return None


def unavailable_reason() -> str | None:
    """Why direct reads are off in this process (detected once), or None when they are on."""
    global _reason, _checked
    if os.environ.get("TENSORWIRE_SHM_DIRECT", "1").strip() == "0":
        return "turned off by TENSORWIRE_SHM_DIRECT=0"
    if not _checked:  # (read without the lock once set: a fetch asks every time)
        with _lock:
            if not _checked:
                _reason, _checked = _probe(), True
    return _reason


def speed_vs_memcpy() -> float:
    """How fast ``process_vm_readv`` copies here, as a share of ``memcpy`` (measured once per
    process on 32 MiB of our own memory, best of 3 each: about 30 ms, in the first weight-sync
    bucket a process serves). 0.8-0.9 on the 2-core build VM (0.76 from another process)."""
    if not _speed:
        with _lock:
            if not _speed:
                _speed.append(_measure_speed())
    return _speed[0]


def _measure_speed() -> float:
    src, dst = np.ones(_PROBE_NBYTES, np.uint8), np.zeros(_PROBE_NBYTES, np.uint8)
    local = _Iovec(dst.ctypes.data, _PROBE_NBYTES)
    remote = _Iovec(src.ctypes.data, _PROBE_NBYTES)
    readv, me = _readv(), os.getpid()
    kernel = memcpy = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        if readv(me, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != _PROBE_NBYTES:
            return 0.0
        kernel = min(kernel, time.perf_counter() - start)
        start = time.perf_counter()
        np.copyto(dst, src)
        memcpy = min(memcpy, time.perf_counter() - start)
    return memcpy / kernel


def enabled() -> bool:
    return unavailable_reason() is None


def disable(reason: str) -> None:
    """Turn direct reads off in this process (the kernel refused one)."""
    global _reason, _checked
    with _lock:
        _reason, _checked = reason, True


class LiveWords:
    """Producer: 64-bit words that never move or go away, one per exported object."""

    _CHUNK = 4096

    def __init__(self) -> None:
        self._chunks: list[ctypes.Array[ctypes.c_uint64]] = []
        self._free: list[int] = []  # chunk * _CHUNK + index
        # Re-entrant: a reference's finalizer frees objects (clear) and the garbage collector
        # may run it inside take, on this thread (making a chunk allocates).
        self._lock = threading.RLock()

    def take(self) -> tuple[int, int, int]:
        """A slot, its address and its nonce (written in the slot)."""
        with self._lock:
            if not self._free:
                self._chunks.append((ctypes.c_uint64 * self._CHUNK)())
                base = (len(self._chunks) - 1) * self._CHUNK
                # plain ints (not tuples): making thousands of them does not wake the garbage collector
                self._free.extend(range(base + self._CHUNK - 1, base - 1, -1))  # keeps slots given back meanwhile
            slot = self._free.pop()
        nonce = secrets.randbits(64) | 1  # never 0: a cleared word
        chunk, index = divmod(slot, self._CHUNK)
        self._chunks[chunk][index] = nonce
        return slot, ctypes.addressof(self._chunks[chunk]) + 8 * index, nonce

    def clear(self, slot: int) -> None:
        chunk, index = divmod(slot, self._CHUNK)
        self._chunks[chunk][index] = 0
        with self._lock:
            self._free.append(slot)


def pack_addresses(live_address: int, nonce: int, ranges: Sequence[tuple[int, int]]) -> bytes:
    """Producer (shm's ``export``): the descriptor server's reply that :func:`unpack_addresses`
    reads (the ranges as one array: 1,024 tensors in one call)."""
    table = np.array(ranges, dtype=_RANGE_WORDS).reshape(-1, 2)
    return _HEADER.pack(live_address, nonce, len(table)) + table.tobytes()


class DirectRead:
    """Consumer: what the producer said about one object (see :func:`unpack_addresses`)."""

    __slots__ = ("live_address", "nonce", "ranges")

    def __init__(self, live_address: int, nonce: int, ranges: list[list[int]]) -> None:
        self.live_address, self.nonce, self.ranges = live_address, nonce, ranges


def unpack_addresses(data: bytes) -> DirectRead:
    """Consumer: what :func:`pack_addresses` wrote; raises ``TransportError`` for a malformed reply."""
    if len(data) < _HEADER.size:
        raise TransportError("malformed address reply from a descriptor server")
    live, nonce, count = _HEADER.unpack_from(data)
    if len(data) != _HEADER.size + count * _RANGE.size:
        raise TransportError("malformed address reply from a descriptor server")
    ranges = np.frombuffer(data, _RANGE_WORDS, offset=_HEADER.size).reshape(-1, 2).tolist()
    return DirectRead(live, nonce, ranges)


def _read_pieces(pid: int, pieces: Sequence[tuple[int, int, int]]) -> None:
    """Copy ``(local address, remote address, bytes)`` pieces from ``pid``; raises OSError.

    The iovec arrays are built with numpy (two 64-bit words per entry, as ``struct iovec``
    is on 64-bit Linux): a 1,024-tensor object costs two array copies, not 2,048 objects."""
    readv = _readv()
    table = np.array(pieces, dtype=np.uint64).reshape(-1, 3)
    table = table[table[:, 2] > 0]
    iov_type = ctypes.POINTER(_Iovec)
    for start in range(0, len(table), _IOV_MAX):
        batch = table[start : start + _IOV_MAX]
        while len(batch):
            local = np.ascontiguousarray(batch[:, [0, 2]])
            remote = np.ascontiguousarray(batch[:, [1, 2]])
            count = len(batch)
            got = readv(pid, local.ctypes.data_as(iov_type), count, remote.ctypes.data_as(iov_type), count, 0)
            if got < 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
            if got == 0:
                raise OSError(errno.EFAULT, "process_vm_readv copied nothing")
            ends = np.cumsum(batch[:, 2])
            done = int(np.searchsorted(ends, got, side="right"))  # pieces copied whole
            batch = batch[done:].copy()
            if len(batch):
                partial = got - (int(ends[done - 1]) if done else 0)
                step = np.uint64(partial)
                batch[0, 0] += step
                batch[0, 1] += step
                batch[0, 2] -= step


def _read_with_word(pid: int, pieces: Sequence[tuple[int, int, int]], total: int, info: DirectRead) -> bool | None:
    """One ``process_vm_readv`` of every piece and, last, the live word (the kernel copies the
    iovecs in order: the word is read after the data): whether it held the nonce; None if the
    kernel copied less (the caller reads again the usual way). Raises OSError."""
    word = ctypes.c_uint64(0)
    count = len(pieces) + 1
    local = (_Iovec * count)(*[_Iovec(d, n) for d, _, n in pieces], _Iovec(ctypes.addressof(word), 8))
    remote = (_Iovec * count)(*[_Iovec(r, n) for _, r, n in pieces], _Iovec(info.live_address, 8))
    got = _readv()(pid, local, count, remote, count, 0)
    if got < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return word.value == info.nonce if got == total + 8 else None


def prepared_read(pid: int, info: DirectRead, local: Sequence[tuple[int, int]]) -> Callable[[float], bool] | None:
    """The read :func:`read_into` makes of an object of few tensors (its pieces, then the live
    word, in one call), with its iovecs made once: called with the deadline
    (``time.monotonic()``), whether every byte came while the object was live. False also when
    the kernel refused or copied less, the copy might not fit before the deadline, direct reads
    were turned off meanwhile (:func:`disable`), or another thread is running it (the caller
    then reads the usual way, which says why). None for an object :func:`read_into` reads
    otherwise (many tensors, a threaded copy).
    """
    pieces = [(dst, src, n) for (dst, n), (src, m) in zip(local, info.ranges, strict=True) if n == m]
    total = sum(p[2] for p in pieces)
    if len(pieces) != len(info.ranges) or len(pieces) >= _FEW or total >= THREADED_MIN_NBYTES:
        return None
    word = ctypes.c_uint64(0)
    count = len(pieces) + 1
    local_iov = (_Iovec * count)(*[_Iovec(d, n) for d, _, n in pieces], _Iovec(ctypes.addressof(word), 8))
    remote_iov = (_Iovec * count)(*[_Iovec(r, n) for _, r, n in pieces], _Iovec(info.live_address, 8))
    slow_s = total / _SLOW_BYTES_PER_S
    readv = _unchecked_readv()
    iovecs = ctypes.c_ulong(count)
    arguments = (ctypes.c_int(pid), local_iov, iovecs, remote_iov, iovecs, ctypes.c_ulong(0))  # all ctypes objects
    expected_nbytes, nonce = total + 8, info.nonce
    busy = threading.Lock()  # one read at a time owns the word

    def read(deadline: float) -> bool:
        if _reason is not None or deadline - time.monotonic() <= slow_s or not busy.acquire(blocking=False):
            return False
        try:
            word.value = 0
            return readv(*arguments) == expected_nbytes and word.value == nonce
        finally:
            busy.release()

    return read


def _split(pieces: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """``pieces`` cut into ``parts`` runs of about equal bytes (large pieces are cut)."""
    total = sum(p[2] for p in pieces)
    share = -(-total // parts)
    runs: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for piece in pieces:
        local, remote, size = piece
        while size:
            take = min(size, room)
            runs[-1].append((local, remote, take))
            local, remote, size, room = local + take, remote + take, size - take, room - take
            if room == 0 and len(runs) < parts:
                runs.append([])
                room = share
    return [r for r in runs if r]


def _read_parallel(pid: int, pieces: list[tuple[int, int, int]], threads: int) -> None:
    runs = _split(pieces, threads)
    errors: list[OSError] = []

    def work(run: list[tuple[int, int, int]]) -> None:
        try:
            _read_pieces(pid, run)
        except OSError as e:
            errors.append(e)

    helpers = [threading.Thread(target=work, args=(r,), daemon=True) for r in runs[1:]]
    for t in helpers:
        t.start()
    work(runs[0])
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]


def _read_in_steps(pid: int, pieces: list[tuple[int, int, int]], total: int, deadline: float, what: str) -> None:
    """A copy that might not fit in the time left: 16 MiB steps, the deadline checked between."""
    steps = _split(pieces, -(-total // STEP_NBYTES))
    done = 0
    for step in steps:
        if done and time.monotonic() >= deadline:
            raise TransferTimeoutError(f"{what}: not complete before the deadline ({done} of {total} bytes)")
        _read_pieces(pid, step)
        done += sum(p[2] for p in step)


def read_into(
    pid: int,
    info: DirectRead,
    local: Sequence[tuple[int, int]],
    *,
    threads: int = 1,
    deadline: float | None = None,
    what: str = "direct read",
) -> bool:
    """Copy the producer's ranges into ``local`` ``(address, bytes)`` buffers (same order and
    sizes), then read its live word: True if the object was live throughout. A copy that
    might not fit before ``deadline`` (``time.monotonic()``) goes in steps and raises
    ``TransferTimeoutError`` naming ``what`` when the time is up.

    Raises:
        PermissionLost: The kernel refused the read (the owner's pid may belong to another
            process now; if the owner lives, the caller turns direct reads off).
        OSError: The process is gone (ESRCH) or the memory unmapped (EFAULT).
    """
    pieces = [(dst, src, n) for (dst, n), (src, m) in zip(local, info.ranges, strict=True) if n == m]
    if len(pieces) != len(info.ranges):
        raise TransportError("direct read: the owner's tensor sizes and the consumer's buffers disagree")
    total = sum(p[2] for p in pieces)
    try:
        stepped = deadline is not None and deadline - time.monotonic() <= total / _SLOW_BYTES_PER_S
        threaded = threads > 1 and total >= THREADED_MIN_NBYTES
        if len(pieces) < _FEW and not stepped and not threaded:
            live = _read_with_word(pid, pieces, total, info)
            if live is not None:
                return live
        if stepped:
            _read_in_steps(pid, pieces, total, deadline, what)
        elif threaded:
            _read_parallel(pid, pieces, threads)
        else:
            _read_pieces(pid, pieces)
        word = ctypes.c_uint64(0)
        _read_pieces(pid, [(ctypes.addressof(word), info.live_address, 8)])
    except OSError as e:
        if e.errno == errno.EPERM:  # the caller turns direct reads off if the owner still lives
            raise PermissionLost(f"the kernel refused to read the producer's memory: {e.strerror}") from None
        raise
    return word.value == info.nonce
