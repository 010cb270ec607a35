"""``shm``: same node, host memory, one-sided through an anonymous shared-memory segment.

The producer packs an object into one ``memfd_create`` segment when a reference to it first
leaves the process (:mod:`tensorwire.transport.backends.shm.memfd`): nothing is named in ``/dev/shm``, and
the kernel frees the memory when the producer's descriptor and every consumer's mapping are
gone, so a producer killed with SIGKILL leaves nothing behind. The reference carries only the
address of the producer's descriptor server; a consumer gets the segment's descriptor from it
(``SCM_RIGHTS`` over a Unix socket, one round trip) only by presenting the object's
capability token, maps it and copies into its own buffers, or on request maps it
copy-on-write as a zero-copy view. Freeing the object withdraws the descriptor; mappings
consumers hold stay valid.

A consumer that holds a reference keeps the descriptor it received (keyed by object id *and*
token, so a forged reference in the same process still asks the server), so fetching the
same object again costs no round trip. After the packed bytes each object has a *live* byte
(the descriptor server's reported size ends at it): the producer clears it when it frees the
object, and a consumer reads it (``pread``) before every fetch from a kept descriptor, so a
fetch after ``free()`` is still ``ObjectFreedError``. Objects of the same unchanged tensors
share one segment, each with its own live byte (:mod:`tensorwire.transport.backends.shm.segment_reuse`).
Kept descriptors are closed when the consumer drops its last reference (``forget_object``).

Direct reads (:mod:`tensorwire.transport.backends.shm.cma`): where the kernel lets a process read a
sibling's memory, a fetch into buffers skips the segment altogether. The producer's export
then packs nothing: it offers the segment *lazily* (made on the first descriptor request:
a view, or a consumer that cannot read directly) together with the addresses of its tensors,
which the descriptor server hands out, like descriptors, only for the object's token. The
consumer copies once, ``process_vm_readv`` from the producer's tensors into its buffers,
then checks the object's live word. Such a fetch reads the producer's tensors as they are
at the fetch (like the two-sided transports), not as they were when the reference left.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tensorwire.errors import TransportError, TransportUnavailableError
from tensorwire.transport.backends.shm import cma, memfd, segment_reuse
from tensorwire.transport.backends.shm.staging import RingReader, StagingRing
from tensorwire.transport.config import socket_dir
from tensorwire.transport.contract import (
    Capabilities,
    CostModel,
    Diagnosis,
    FetchRequest,
    Health,
    StoredObject,
    TensorMeta,
    Transport,
    TransportContext,
)
from tensorwire.transport.hw import topology
from tensorwire.transport.packing import COPY_THREADS, byte_view, copy_before

__all__ = ["ShmTransport"]

logger = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_LIVE, _FREED = segment_reuse.LIVE, segment_reuse.FREED
_KEPT_MAX = 1024  # descriptors a consumer keeps for objects it holds (least recently used go)
_LIVE_WORDS = cma.LiveWords()  # the producer's live words of directly readable objects


class ShmTransport(Transport):
    """Same-node host memory through one anonymous shared-memory segment per object."""

    name = "shm"
    capabilities = Capabilities(
        one_sided=True,
        same_process=False,
        same_node=True,
        cross_node=False,
        needs_export=True,
        zero_copy_view=True,
        staging_rings=True,
    )
    cost_model = CostModel.uniform(fixed_us=60, bandwidth_gbps=5.0)  # measured on the 2-core build VM

    def __init__(self, context: TransportContext) -> None:
        super().__init__(context)
        # (descriptor, offset of the object's live byte) by (object id, token)
        self._kept: collections.OrderedDict[tuple[bytes, bytes], tuple[int, int]] = collections.OrderedDict()
        # re-entrant: a reference's finalizer (forget_object) can run inside forget_object when an
        # allocation there starts the garbage collector on this thread (seen as a hang under load)
        self._kept_lock = threading.RLock()
        self._direct: collections.OrderedDict[tuple[bytes, bytes], cma.DirectRead] = collections.OrderedDict()
        self.copy_threads = COPY_THREADS
        self.segments = segment_reuse.SegmentCache()  # unchanged tensors returned again share one

    def diagnose(self) -> list[Diagnosis]:
        """Segments are anonymous (``/dev/shm``'s size does not limit them); whether the kernel
        allows direct reads (one copy per fetch)."""
        direct = cma.unavailable_reason()
        return [
            Diagnosis("shared memory", Health.OK, "anonymous segments (memfd_create); /dev/shm is not used"),
            Diagnosis(
                "shm direct reads",
                Health.OK if direct is None else Health.WARN,
                direct or "process_vm_readv allowed: one copy per shm fetch",
            ),
        ]

    def unavailable_reason(self) -> str | None:
        """Any process: usable where ``memfd_create`` and descriptor passing exist (Linux)."""
        if not hasattr(os, "memfd_create") or not hasattr(os, "MFD_CLOEXEC"):
            return "this system has no memfd_create (Linux 3.17 or newer is needed)"
        return None

    # ---------------------------------------------------------------- producer

    def export(self, obj: StoredObject) -> bytes | None:
        """Producer: offer the object; returns the address of this process's descriptor server.

        With direct reads on, nothing is copied now: the server hands out the tensors'
        addresses and makes the segment on the first descriptor request. Otherwise blocks for
        one copy of the object into a new segment (``pwrite``: no memory is an error, not a
        SIGBUS); raises ``TransportUnavailableError`` when the memory cannot be had (the agent
        then leaves consumers to another transport).
        """
        if not obj.host_only:
            return None  # device memory goes by cuda_ipc, or two-sided transports that stage it
        server = memfd.fd_server(socket_dir())
        if cma.enabled():
            slot, live_address, nonce = _LIVE_WORDS.take()
            ranges = [(t.data_ptr() if m.nbytes else 0, m.nbytes) for t, m in zip(obj.tensors, obj.metas, strict=True)]
            own: list[tuple[int, int]] = []
            obj.transport_state[self.name] = (server, own, slot)
            server.offer_lazy(
                obj.object_id,
                obj.token,
                lambda: _served(self.segments.segment(obj, _pack), own),
                addresses=cma.pack_addresses(live_address, nonce, ranges),
            )
            return server.path.encode()
        fd, live_offset = self.segments.segment(obj, _pack)
        try:
            server.offer(obj.object_id, obj.token, os.dup(fd), live_offset + len(_LIVE))
        except BaseException:
            os.close(fd)
            raise
        obj.transport_state[self.name] = (server, [(fd, live_offset)], None)
        return server.path.encode()

    def export_nbytes(self, obj: StoredObject) -> int:
        """Producer: the object's segment, once made (with direct reads, on first request)."""
        state = obj.transport_state.get(self.name)
        return obj.packed_nbytes if isinstance(state, tuple) and state[1] else 0

    def staging_ring(self, slot_nbytes: int, slots: int = 2) -> StagingRing:
        """Writer: a ring of anonymous segments this process's descriptor server hands out."""
        return StagingRing(self.context.peer, slot_nbytes, slots)

    def ring_reader(self) -> RingReader:
        """Reader on the writer's node: keeps its mappings of ring slots until closed."""
        return RingReader()

    def reads_in_place(self, readers: int) -> bool:
        """Writer: with direct reads an export copies nothing and each reader copies once out
        of the writer's tensors (``process_vm_readv``, at ``s`` x memcpy's speed); a ring costs
        one packing copy and a memcpy per reader. In place wins when ``readers / s < 1 +
        readers``."""
        return cma.enabled() and readers < cma.speed_vs_memcpy() * (1 + readers)

    def release(self, obj: StoredObject) -> None:
        """Producer: mark the object freed and withdraw it; mappings consumers hold stay valid."""
        state = obj.transport_state.pop(self.name, None)
        if isinstance(state, tuple):
            server, own, slot = state
            if slot is not None:
                _LIVE_WORDS.clear(slot)
            server.withdraw(obj.object_id)  # waits for a segment being made
            for fd, live_offset in own:
                try:
                    os.pwrite(fd, _FREED, live_offset)  # this object's byte: others sharing the segment stay
                finally:
                    os.close(fd)

    def close(self) -> None:
        """Any process, at agent shutdown: close kept descriptors, cached segments, the server
        and the client."""
        with self._kept_lock:
            kept, self._kept = list(self._kept.values()), collections.OrderedDict()
        for fd, _ in kept:
            os.close(fd)
        self.segments.close()
        memfd.close_all()

    # ---------------------------------------------------------------- consumer

    def forget_object(self, object_id: bytes) -> None:
        """Consumer: close the descriptors kept for ``object_id``."""
        with self._kept_lock:  # each dict copied first: a finalizer run meanwhile may change it
            for key in [k for k in list(self._direct) if k[0] == object_id]:
                self._direct.pop(key, None)
            keys = [k for k in list(self._kept) if k[0] == object_id]
            fds = [kept[0] for kept in (self._kept.pop(k, None) for k in keys) if kept is not None]
        for fd in fds:
            os.close(fd)

    def _kept_descriptor(self, request: FetchRequest) -> int | None:
        """A duplicate of the kept descriptor of a live object (the caller closes it)."""
        key = (request.object_id, request.token)
        with self._kept_lock:
            kept = self._kept.get(key)
            if kept is None:
                return None
            self._kept.move_to_end(key)
            fd, live_offset = os.dup(kept[0]), kept[1]
        if os.pread(fd, 1, live_offset) == _LIVE:
            return fd
        os.close(fd)
        self.forget_object(request.object_id)
        self.context.check_owner(request)  # raises ObjectFreedError / OwnerDiedError
        raise TransportError(f"the shared-memory segment of {request!r} was freed, its owner keeps it")

    def _keep(self, request: FetchRequest, fd: int, live_offset: int) -> None:
        if not self.context.holds(request.object_id):
            return  # nobody would tell us when to close it
        dropped = []
        with self._kept_lock:
            key = (request.object_id, request.token)
            if key not in self._kept:
                self._kept[key] = (os.dup(fd), live_offset)
            while len(self._kept) > _KEPT_MAX:
                dropped.append(self._kept.popitem(last=False)[1][0])
        for old in dropped:
            os.close(old)

    def _open(self, request: FetchRequest) -> int:
        if request.handle is None:
            raise TransportUnavailableError("the reference carries no shared-memory segment")
        owner = request.owner
        if not topology.process_alive(owner.pid, owner.start_time):
            self.forget_object(request.object_id)
            self.context.check_owner(request)  # raises OwnerDiedError
        fd = self._kept_descriptor(request)
        if fd is not None:
            return fd
        try:
            fd, nbytes = memfd.fd_client().receive(
                request.handle.decode(), request.object_id, request.token, deadline=request.deadline
            )
        except (memfd.SegmentUnknownError, OSError):
            self.context.check_owner(request)  # raises ObjectFreedError / OwnerDiedError
            raise TransportError(f"the shared-memory segment of {request!r} is gone, its owner keeps it") from None
        if nbytes < request.packed_nbytes + len(_LIVE):
            os.close(fd)
            raise TransportError(f"the shared-memory segment of {request!r} has {nbytes} bytes, too few")
        self._keep(request, fd, nbytes - len(_LIVE))  # the object's live byte ends what the server reports
        return fd

    def _addresses(self, request: FetchRequest) -> cma.DirectRead | None:
        """What the owner said about the object's memory (kept while this process holds it);
        None if it offers no addresses."""
        key = (request.object_id, request.token)
        with self._kept_lock:
            found = self._direct.get(key)
        if found is not None or request.handle is None:
            return found
        try:
            data = memfd.fd_client().addresses(
                request.handle.decode(), request.object_id, request.token, deadline=request.deadline
            )
        except (memfd.SegmentUnknownError, OSError):
            return None  # the segment path tells freed from "no direct reads"
        found = cma.unpack_addresses(data)
        if [n for _, n in found.ranges] != [m.nbytes for m in request.metas]:
            raise TransportError(f"the owner of {request!r} described tensors of other sizes than its reference's")
        if self.context.holds(request.object_id):
            with self._kept_lock:
                self._direct[key] = found
                while len(self._direct) > _KEPT_MAX:
                    self._direct.popitem(last=False)
        return found

    def _fetch_direct(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> bool:
        """Copy straight from the owner's tensors; False when the segment path must do it."""
        found = self._addresses(request)
        if found is None:
            return False
        local = []
        for meta, out in zip(request.metas, dst, strict=True):
            if out.nbytes != meta.nbytes or not out.is_contiguous():
                return False  # not one buffer of the right size: the segment path copies
            local.append((out.data_ptr(), meta.nbytes))
        try:
            live = cma.read_into(
                request.owner.pid,
                found,
                local,
                threads=self.copy_threads,
                deadline=request.deadline,
                what=f"shm direct read of object {request.object_id.hex()}",
            )
        except cma.PermissionLost as e:
            self.context.check_owner(request)  # a dead owner's pid reused by another user: OwnerDiedError
            cma.disable(f"process_vm_readv was refused: {e}")
            logger.info("shm: direct reads are off in this process (%s); using segments", e)
            return False
        except OSError:
            live = False
        if live:
            return True
        self.forget_object(request.object_id)
        self.context.check_owner(request)  # raises ObjectFreedError / OwnerDiedError
        return False  # live, but its memory did not answer as described (another pid namespace?)

    def fetch(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
        """Consumer: copy the owner's tensors straight into ``dst`` where the kernel allows
        it, else get the segment (one round trip), map it read-only and copy into ``dst``;
        blocks for the copy, bounded by the request's deadline."""
        if cma.enabled() and self._fetch_direct(request, dst):
            return
        fd = self._open(request)
        try:
            size = max(request.packed_nbytes, 1)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
            try:
                _copy_out(mm, request, dst)
            finally:
                with contextlib.suppress(BufferError):  # views kept by a traceback: unmapped with it
                    mm.close()
        finally:
            os.close(fd)

    def repeater(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> Callable[[float], bool] | None:
        """Consumer: the direct read of the last fetch with its iovecs made once, where it read
        directly (the owner's addresses kept while this process holds the object)."""
        with self._kept_lock:
            found = self._direct.get((request.object_id, request.token))
        if found is None or not cma.enabled():
            return None
        return cma.prepared_read(request.owner.pid, found, [(t.data_ptr(), t.numel() * t.element_size()) for t in dst])

    def view(self, request: FetchRequest) -> list[torch.Tensor]:
        """Consumer: tensors mapped copy-on-write on the segment (no copy; writes stay private)."""
        fd = self._open(request)
        try:
            mm = mmap.mmap(
                fd, max(request.packed_nbytes, 1), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        buffer = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))  # keeps ``mm`` alive
        return [_tensor_at(buffer, meta) for meta in request.metas]


def _pack(obj: StoredObject) -> int:
    """A new segment holding the object's packed bytes, room for its live byte after them (the
    caller owns it and sets that byte)."""
    fd = memfd.create_memfd(obj.packed_nbytes + len(_LIVE))
    try:
        for tensor, meta in zip(obj.tensors, obj.metas, strict=True):
            if meta.nbytes:
                _write_all(fd, memoryview(byte_view(tensor).numpy()), meta.offset)
    except OSError as e:
        os.close(fd)
        _raise_no_room(e, obj.packed_nbytes)
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def _served(segment: tuple[int, int], own: list[tuple[int, int]]) -> tuple[int, int]:
    """A lazily made segment: the producer keeps its descriptor and the object's live byte (to
    mark it freed), the server a copy and the size up to that byte."""
    own.append(segment)
    fd, live_offset = segment
    return os.dup(fd), live_offset + len(_LIVE)


def _raise_no_room(error: OSError, size: int) -> None:
    """Raise ``TransportUnavailableError`` if ``error`` says ``/dev/shm`` is full."""
    if error.errno in (errno.ENOSPC, errno.ENOMEM):
        raise TransportUnavailableError(
            f"no memory for a {size}-byte shared-memory segment ({error}); free objects or raise the memory limit"
        ) from error


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset``. ``write`` (unlike stores into a mapping) reports a full
    ``/dev/shm`` as ENOSPC instead of killing the process with SIGBUS, and it is the fastest
    way to fill fresh tmpfs pages (about 2.5 GB/s vs 1.5 GB/s through a mapping here)."""
    step = 64 << 20
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written : written + step], offset + written)


def _copy_out(mapping: mmap.mmap, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
    source = np.frombuffer(mapping, dtype=np.uint8)
    what = f"shm fetch of {request!r}"
    for meta, out in zip(request.metas, dst, strict=True):
        if meta.nbytes:
            copy_before(byte_view(out).numpy(), source[meta.offset : meta.offset + meta.nbytes], request.deadline, what)


def _tensor_at(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    dtype = getattr(torch, meta.dtype)
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=dtype)
    return buffer[meta.offset : meta.offset + meta.nbytes].view(dtype).view(meta.shape)
