"""``cuda_ipc``: CUDA memory between processes of one node, one-sided, through CUDA IPC.

Verified on one NVIDIA H200 (``benchmarks/device_check.sh``; see ``docs/performance.md``);
the build machines have no GPU.

Each consumer process asks the owner once per object for its own handle (an ``Export``
call; ``export_per_consumer``), then maps it and reads with no further work on the producer.
The producer uses torch's own sharing path (``UntypedStorage._share_cuda_``): per tensor, the
IPC handle of the caching allocator's *block* the tensor lives in (tensors of one block share
it; the offset travels alongside) and an interprocess event recorded on the current stream
after the work that produced the tensors (the stream first waits for the events recorded at
``put``). Going through torch handles expandable segments the way torch supports them; memory
that torch did not allocate (a cupy array sent as is) cannot be shared this way, so the
selector leaves such values to ucx or host (``torch_memory_only``; found on the H200).

Why one handle per consumer: each ``_share_cuda_`` result carries one count in torch's IPC
reference counter, and exactly one consumer's mapping must release it. A handle opened by
none or by two consumers leaves the block in torch's "limbo" after the producer frees it
(measured on the H200: 64 MiB stayed allocated). With one share per consumer the count
balances and the producer's memory returns as soon as tensorwire frees the object, which it
does only after every consumer released its reference (holder protocol), and consumers
close their mappings before they release. Known gap: a consumer killed while it holds a
mapping never releases its count, so that block stays allocated until the producer exits.

Consumer, per fetch, host work is kept to the copies (the GPU fixed-cost issue): mapped
tensors and the per-device events that mark the last copy are made once per object and
reused; the owner's liveness (a syscall for a same-node owner) is checked when an object is
first opened and then at most every ``LIVENESS_CHECK_S`` per owner, not on every fetch.

Consumer: devices are matched by physical UUID, never by index, so producer and consumer may
see different ``CUDA_VISIBLE_DEVICES``. Handles are opened once per object and process
(``_new_shared_cuda`` makes the consumer's current stream wait on the producer's event: no
host synchronisation) and kept until the consumer's last reference to the object is gone.
``fetch`` copies into the consumer's buffers on its current stream (another GPU copies peer
to peer where CUDA allows it); ``view`` returns tensors on the mapping itself (same memory as
the producer's: treat as read-only), which keep the object held while they live.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorwire.errors import TransportError, TransportUnavailableError
from tensorwire.transport.contract import Capabilities, CostModel, FetchRequest, MemoryKind, StoredObject, Transport
from tensorwire.transport.hw import topology

__all__ = ["CudaIpcTransport", "IpcRecord", "decode_records", "encode_records"]

logger = logging.getLogger(__name__)

_VERSION = 1
_HEADER = struct.Struct("!BI")
_NUMBERS = struct.Struct("!QQQQB")  # storage size, storage offset, ref-counter offset, tensor offset, event sync
_LENGTH = struct.Struct("!I")
LIVENESS_CHECK_S = 1.0  # a cached object's owner is checked for liveness at most this often


@dataclass(frozen=True)
class IpcRecord:
    """How a consumer opens one tensor of an exported object (empty tensors: empty handle)."""

    device_uuid: str
    handle: bytes
    storage_nbytes: int
    storage_offset: int  # bytes from the start of the IPC allocation to the storage
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int  # bytes from the start of the storage to the tensor


def encode_records(records: Sequence[IpcRecord]) -> bytes:
    """The export handle: a versioned binary layout (never pickled)."""
    parts = [_HEADER.pack(_VERSION, len(records))]
    for r in records:
        for field in (r.device_uuid.encode(), r.handle, r.ref_counter_handle, r.event_handle):
            parts += [_LENGTH.pack(len(field)), field]
        parts.append(
            _NUMBERS.pack(
                r.storage_nbytes, r.storage_offset, r.ref_counter_offset, r.tensor_offset, r.event_sync_required
            )
        )
    return b"".join(parts)


def decode_records(data: bytes) -> list[IpcRecord]:
    """Inverse of :func:`encode_records`; raises ``TransportError`` on malformed input."""
    try:
        version, count = _HEADER.unpack_from(data, 0)
        if version != _VERSION:
            raise TransportError(f"cuda_ipc: handle version {version} (expected {_VERSION})")
        position = _HEADER.size
        records = []
        for _ in range(count):
            fields = []
            for _ in range(4):
                (length,) = _LENGTH.unpack_from(data, position)
                position += _LENGTH.size
                if position + length > len(data):
                    raise TransportError("cuda_ipc: truncated handle")
                fields.append(bytes(data[position : position + length]))
                position += length
            size, offset, counter_offset, tensor_offset, sync = _NUMBERS.unpack_from(data, position)
            position += _NUMBERS.size
            records.append(
                IpcRecord(
                    fields[0].decode(),
                    fields[1],
                    size,
                    offset,
                    fields[2],
                    counter_offset,
                    fields[3],
                    bool(sync),
                    tensor_offset,
                )
            )
    except struct.error as e:
        raise TransportError(f"cuda_ipc: malformed handle ({e})") from None
    if position != len(data):
        raise TransportError("cuda_ipc: trailing bytes in handle")
    return records


class CudaIpcTransport(Transport):
    """Same-node CUDA memory through CUDA IPC handles of the producer's allocations."""

    name = "cuda_ipc"
    capabilities = Capabilities(
        one_sided=True,
        same_process=False,
        same_node=True,
        cross_node=False,
        memory=frozenset({MemoryKind.CUDA}),
        zero_copy_view=True,
        needs_device_access=True,
        export_per_consumer=True,
        torch_memory_only=True,
    )
    cost_model = CostModel.uniform(fixed_us=100, bandwidth_gbps=1000.0)  # unverified until measured on GPUs

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._lock = threading.RLock()  # forget_object runs from finalizers, which may run inside it
        self._opened: dict[bytes, list[torch.Tensor]] = {}  # object id -> the producer's tensors, mapped
        self._pending: dict[bytes, dict[torch.device, torch.cuda.Event]] = {}  # object id -> last copy per device
        self._alive_at: dict[tuple[int, int], float] = {}  # owner (pid, start time) -> last seen alive

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device visible to this process"
        return None

    # ------------------------------------------------------------------ producer

    def export(self, obj: StoredObject) -> bytes | None:
        if not obj.tensors or any(t.device.type != "cuda" for t in obj.tensors):
            return None
        obj.wait_ready()  # the IPC events below are recorded after the producing work
        records = []
        for tensor, meta in zip(obj.tensors, obj.metas, strict=True):
            if tensor.numel() == 0:
                records.append(IpcRecord(meta.device_uuid, b"", 0, 0, b"", 0, b"", False, 0))
                continue
            with torch.cuda.device(tensor.device):
                try:
                    shared = tensor.untyped_storage()._share_cuda_()
                except RuntimeError as e:
                    logger.info("cuda_ipc: torch cannot share this allocation (%s); other transports serve it", e)
                    return None
            device, handle, size, offset, counter_handle, counter_offset, event_handle, event_sync = shared
            records.append(
                IpcRecord(
                    device_uuid=meta.device_uuid or topology.cuda_uuid(device),
                    handle=bytes(handle),
                    storage_nbytes=int(size),
                    storage_offset=int(offset),
                    ref_counter_handle=bytes(counter_handle),
                    ref_counter_offset=int(counter_offset),
                    event_handle=bytes(event_handle or b""),
                    event_sync_required=bool(event_sync),
                    tensor_offset=tensor.storage_offset() * tensor.element_size(),
                )
            )
        return encode_records(records)

    # ------------------------------------------------------------------ consumer

    def _owner_alive(self, request: FetchRequest, *, cached: bool) -> bool:
        """Whether the owner may be alive; asks (a syscall) unless a cached object's owner
        was seen alive less than ``LIVENESS_CHECK_S`` ago."""
        key = (request.owner.pid, request.owner.start_time)
        now = time.monotonic()
        if cached and now - self._alive_at.get(key, -LIVENESS_CHECK_S) < LIVENESS_CHECK_S:
            return True
        if not self.context.peer_may_be_alive(request.owner):
            self._alive_at.pop(key, None)
            return False
        self._alive_at[key] = now
        return True

    def _open(self, request: FetchRequest) -> list[torch.Tensor]:
        """The producer's tensors, mapped into this process (opened once per object)."""
        with self._lock:
            cached = self._opened.get(request.object_id)
        if not self._owner_alive(request, cached=cached is not None):
            with self._lock:
                self._opened.pop(request.object_id, None)  # its memory went with it
            self.context.check_owner(request)  # raises OwnerDiedError
        if cached is not None:
            return cached
        handle = request.handle or self.context.request_export(request, self.name)  # this process's own share
        records = decode_records(handle)
        if len(records) != len(request.metas):
            raise TransportError("cuda_ipc: handle and metadata disagree")
        torch.cuda.init()
        storages: dict[tuple[bytes, int], torch.UntypedStorage] = {}  # tensors of one block share it
        tensors = []
        for record, meta in zip(records, request.metas, strict=True):
            dtype = getattr(torch, meta.dtype)
            index = topology.local_cuda_index(record.device_uuid)
            if index is None:
                raise TransportUnavailableError(f"cuda_ipc: this process cannot see GPU {record.device_uuid}")
            device = torch.device("cuda", index)
            if not record.handle:
                tensors.append(torch.empty(meta.shape, dtype=dtype, device=device))
                continue
            key = (record.handle, record.storage_offset)
            if key not in storages:
                storages[key] = self._open_storage(request, record, index)
            element = torch.empty(0, dtype=dtype).element_size()
            tensor = torch.empty(0, dtype=dtype, device=device)
            tensor.set_(storages[key], record.tensor_offset // element, meta.shape)
            tensors.append(tensor)
        with self._lock:
            return self._opened.setdefault(request.object_id, tensors)

    def _open_storage(self, request: FetchRequest, record: IpcRecord, index: int) -> torch.UntypedStorage:
        try:
            return torch.UntypedStorage._new_shared_cuda(
                index,
                record.handle,
                record.storage_nbytes,
                record.storage_offset,
                record.ref_counter_handle,
                record.ref_counter_offset,
                record.event_handle or None,
                record.event_sync_required,
            )
        except RuntimeError as e:
            self.context.check_owner(request)  # the owner exited or freed it: say so
            raise TransportError(f"cuda_ipc: cannot open the producer's allocation: {e}") from None

    def fetch(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
        """Copy into ``dst`` on the consumer's current stream (host ``dst``: synchronous)."""
        sources = self._open(request)
        devices = set()
        for source, target in zip(sources, dst, strict=True):
            if source.numel() == 0:
                continue
            target.copy_(source, non_blocking=target.device.type == "cuda")
            if target.device.type == "cuda":
                devices.add(target.device)
        if devices:
            with self._lock:
                events = self._pending.setdefault(request.object_id, {})
            for device in devices:  # the last copy on each device; mappings close after it
                event = events.get(device)
                if event is None:  # one event per object and device, recorded again by each fetch
                    event = events[device] = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))

    def view(self, request: FetchRequest) -> list[torch.Tensor]:
        """The producer's tensors themselves (same GPU: no copy). Writes reach the producer.

        New tensor objects on the cached mappings: the agent ties the object's hold to their
        lifetime, so a mapping stays open while any view of it lives.
        """
        return [t.detach() for t in self._open(request)]

    def forget_object(self, object_id: bytes) -> None:
        with self._lock:
            mapped = self._opened.pop(object_id, None)
            events = self._pending.pop(object_id, {})
        for event in events.values():
            event.synchronize()  # copies out of the mapping finished before it closes
        del mapped  # closes the mappings (when no view holds them)

    def close(self) -> None:
        with self._lock:
            ids = list(self._opened)
        for object_id in ids:
            self.forget_object(object_id)
