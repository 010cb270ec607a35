"""What describes an object and how that description travels.

The records every layer shares: :class:`TensorMeta` (one tensor's shape, dtype, device and
place in the pack), :class:`ObjectDescriptor` (what a reference carries), :class:`PeerInfo`
(how to reach an agent), :class:`StoredObject` (the producer's side of an object) and
:class:`FetchRequest` (the consumer's side of one fetch). :mod:`tensorwire.transport.contract`
re-exports them for backend authors.

How an object's descriptor travels in a pickled reference, and what a fetch derives from
its tensors' metadata: both remembered, because the same layouts come again and again.

A pickled :class:`~tensorwire.transport.contract.TensorMeta` is an object rebuilt field by field;
for a state dict of 1,024 tensors that is about 2 ms to pickle and 2 ms to unpickle on the
2-core build VM, every time the reference travels. Here a descriptor's metadata travels as
one tuple of plain tuples (*rows*), which pickle handles in C:

* the producer makes an object's rows once (a reference pickled again, the same object
  returned again, reuses them);
* the consumer turns rows it has seen before into the very same ``TensorMeta`` tuple (the same
  object fetched again; a new object with the layout of an earlier one, as a trainer's weights
  are every step), so nothing is rebuilt;
* facts a fetch needs about the tensors (their bytes, memory kinds, GPUs) are remembered per
  metadata tuple, so a fetch does not walk 1,024 tensors to find them again;
* dtype names and ``torch.device`` objects are made once per name.

Every memo is bounded (:data:`MEMO_SIZE` entries, cleared when full) and holds the tuples it is
keyed by, so a key (an ``id``) cannot be reused while its entry lives. Entries are immutable;
concurrent threads may compute the same entry twice, harmlessly.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from tensorwire.transport.costs import MemoryKind

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT",
    "MEMO_SIZE",
    "MEMO_TENSORS",
    "DeviceInfo",
    "FetchRequest",
    "MetaFacts",
    "ObjectDescriptor",
    "PeerInfo",
    "StoredObject",
    "TensorKind",
    "TensorMeta",
    "descriptor_from_rows",
    "device",
    "dtype_name",
    "facts",
    "metas_from_rows",
    "reduce_descriptor",
    "rows",
]

MEMO_SIZE = 256  # entries of one memo
MEMO_TENSORS = 1 << 16  # tensors' metadata one memo keeps in all (about 0.4 KiB each)
FORMAT = 1  # of a pickled descriptor's arguments; another version's reference is refused by name
_FOREIGN_KINDS = ("cupy", "dlpack")  # memory torch did not allocate (TensorKind values)

Row = tuple[tuple[int, ...], str, str, int, int, str, str]


class TensorKind(enum.Enum):
    """Which array type the user gave us, so that the consumer gets the same type back."""

    TORCH = "torch"
    NUMPY = "numpy"
    CUPY = "cupy"  # arrives as a cupy array where cupy is installed (else a torch tensor)
    DLPACK = "dlpack"  # another DLPack producer (JAX, ...): arrives as a torch tensor


@dataclass(frozen=True)
class DeviceInfo:
    """One device a process can see, identified physically (never only by index)."""

    kind: str  # torch device type: "cpu", "cuda", ...
    index: int
    uuid: str = ""
    pci_bus_id: str = ""


@dataclass(frozen=True)
class PeerInfo:
    """Everything another process needs to know to reach an agent.

    ``node_id`` decides "same node" for transport selection and can be overridden with
    ``TENSORWIRE_NODE_ID`` (tests use it to force cross-node paths on one machine);
    ``machine_id`` (host name + boot id) is never overridden and decides whether process
    liveness can be checked by pid.
    """

    agent_id: str
    node_id: str
    machine_id: str
    hostname: str
    pid: int
    start_time: int
    unix_address: str = ""
    tcp_address: str = ""
    transports: tuple[str, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    gpu_links: tuple[tuple[str, str, str], ...] = ()  # (uuid, uuid, "nvlink" | "pcie" | "none")
    transport_info: tuple[tuple[str, str], ...] = ()  # (transport, facts), e.g. ("ucx", "cma,posix,tcp")

    def gpu_link(self, a: str, b: str) -> str:
        """How this process's GPUs ``a`` and ``b`` (UUIDs) reach each other: "same",
        "nvlink", "pcie", "none", or "" when unknown."""
        if a == b:
            return "same"
        for x, y, kind in self.gpu_links:
            if {x, y} == {a, b}:
                return kind
        return ""

    def with_transport_info(self, transport: str, info: str) -> PeerInfo:
        """This peer with ``info`` as ``transport``'s connection info (replacing what it had)."""
        others = tuple(item for item in self.transport_info if item[0] != transport)
        return replace(self, transport_info=(*others, (transport, info)))

    def same_process(self, other: PeerInfo) -> bool:
        return self.agent_id == other.agent_id

    def same_node(self, other: PeerInfo) -> bool:
        return self.node_id == other.node_id

    def same_machine(self, other: PeerInfo) -> bool:
        return self.machine_id == other.machine_id


class TensorMeta(NamedTuple):
    """Shape, dtype and placement of one tensor of an object, and its place in the pack.

    ``offset`` is the byte offset of the tensor in the object's packed layout (tensors laid
    end to end, each aligned); one-sided transports use one buffer per object. A named tuple:
    a producer makes one per tensor, and a frozen dataclass costs twice as much to make (a
    state dict of 1,024 tensors: about 1 ms more on the 2-core VM).
    """

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    device: str  # device as the producer saw it, e.g. "cpu" or "cuda:0"
    nbytes: int
    offset: int
    kind: TensorKind = TensorKind.TORCH
    device_uuid: str = ""

    @property
    def memory(self) -> MemoryKind:
        return MemoryKind.CUDA if self.device.startswith("cuda") else MemoryKind.HOST


@dataclass(frozen=True)
class ObjectDescriptor:
    """What a reference carries about its object (never the bytes, except inline handles)."""

    object_id: bytes
    token: bytes  # the capability: whoever presents it may read the object
    owner: PeerInfo
    metas: tuple[TensorMeta, ...]
    packed_nbytes: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # the metadata as plain rows, memoised
        return reduce_descriptor(self)

    @property
    def nbytes(self) -> int:
        return facts(self.metas).nbytes

    def __repr__(self) -> str:  # never show the token
        return f"ObjectDescriptor(id={self.object_id.hex()}, owner={self.owner.agent_id}, tensors={len(self.metas)})"


@dataclass
class StoredObject:
    """Producer side: one registered object as its owner's agent keeps it.

    Transports may keep per-object state in ``transport_state`` (keyed by transport name);
    they must free it in ``release``.
    """

    object_id: bytes
    token: bytes
    tensors: list[torch.Tensor]
    metas: tuple[TensorMeta, ...]
    packed_nbytes: int
    transport_state: dict[str, object] = field(default_factory=dict)
    ready: list[tuple[int, Any]] = field(default_factory=list)  # (CUDA device, event) recorded at put

    @property
    def nbytes(self) -> int:
        return facts(self.metas).nbytes

    @property
    def host_only(self) -> bool:
        """Producer (a transport's ``export``): every tensor is on the cpu device (worked out
        once per metadata tuple)."""
        return facts(self.metas).cpu_only

    def wait_ready(self) -> None:
        """Make the calling thread's current CUDA streams wait for the work that produced the
        tensors (recorded when the object was put); no host synchronisation."""
        if not self.ready:
            return
        import torch

        for device, event in self.ready:
            torch.cuda.current_stream(device).wait_event(event)


class FetchRequest(NamedTuple):
    """Consumer side: what one fetch needs to know about the object it pulls (a named tuple:
    one is made per fetch attempt, and a frozen dataclass costs microseconds to make)."""

    object_id: bytes
    token: bytes
    owner: PeerInfo
    metas: tuple[TensorMeta, ...]
    packed_nbytes: int
    handle: bytes | None
    deadline: float  # time.monotonic() value

    def __repr__(self) -> str:  # never show the token
        return f"FetchRequest(id={self.object_id.hex()}, owner={self.owner.agent_id}, tensors={len(self.metas)})"

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class MetaFacts(NamedTuple):
    """What a fetch needs to know about an object's tensors as a whole."""

    nbytes: int
    memory: frozenset[MemoryKind]
    src_devices: frozenset[str]  # UUIDs of the GPUs the tensors live on
    foreign_memory: bool  # some CUDA tensor came from a DLPack producer (cupy, ...)
    cpu_only: bool  # every tensor is on the cpu device (other devices count as host memory above)


class _Memo:
    """At most :data:`MEMO_SIZE` entries and :data:`MEMO_TENSORS` tensors in all; emptied when
    either would be passed (the next uses fill it again). Counts may drift under races between
    threads; the entry bound holds regardless."""

    def __init__(self) -> None:
        self.entries: dict[Any, Any] = {}
        self.tensors = 0

    def get(self, key: Any) -> Any:
        return self.entries.get(key)

    def put(self, key: Any, value: Any, tensors: int) -> None:
        if len(self.entries) >= MEMO_SIZE or self.tensors + tensors > MEMO_TENSORS:
            self.entries.clear()
            self.tensors = 0
        self.entries[key] = value
        self.tensors += tensors


_rows_of = _Memo()  # id(metas) -> (metas, rows)
_metas_of = _Memo()  # rows -> metas
_facts_of = _Memo()  # id(metas) -> (metas, facts)
_dtype_names: dict[Any, str] = {}  # torch.dtype -> name (a handful)
_devices = _Memo()  # device string -> torch.device


def dtype_name(dtype: Any) -> str:
    """A torch dtype's name as metadata spells it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def device(name: str) -> Any:
    """``torch.device(name)``, made once per name (consumer: where fetched tensors land)."""
    made = _devices.get(name)
    if made is None:
        import torch

        made = torch.device(name)
        _devices.put(name, made, 1)
    return made


def rows(metas: tuple[TensorMeta, ...]) -> tuple[Row, ...]:
    """Producer, pickling a reference: ``metas`` as plain tuples (made once per tuple)."""
    known = _rows_of.get(id(metas))
    if known is not None and known[0] is metas:
        return known[1]
    made = tuple(
        (shape, dtype, dev, nbytes, offset, kind.value, uuid) for shape, dtype, dev, nbytes, offset, kind, uuid in metas
    )
    _rows_of.put(id(metas), (metas, made), len(made))
    return made


def _meta(row: Row) -> TensorMeta:
    """One row as ``TensorMeta``; ``ValueError`` unless every field has its exact type (a
    ``True`` or ``1.0`` equals ``1`` as a memo key, so a loose row would stand for good ones)."""
    shape, dtype, device_name, nbytes, offset, kind, uuid = row
    exact = type(shape) is tuple and all(type(n) is int for n in shape) and type(nbytes) is int
    exact = exact and type(offset) is int and type(dtype) is str and type(device_name) is str and type(uuid) is str
    if not exact:
        raise ValueError(f"row {row!r} is not tensor metadata")
    return TensorMeta(shape, dtype, device_name, nbytes, offset, TensorKind(kind), uuid)


def metas_from_rows(made: tuple[Row, ...]) -> tuple[TensorMeta, ...]:
    """Consumer, unpickling a reference: the ``TensorMeta`` tuple of ``made`` (the same tuple
    for rows seen before). Raises ``ValueError`` or ``TypeError`` for rows that are not metadata."""
    known = _metas_of.get(made)
    if known is not None:
        return known
    if type(made) is not tuple:
        raise ValueError("tensor metadata is not a tuple of rows")
    metas = tuple(_meta(row) for row in made)
    _metas_of.put(made, metas, len(metas))
    return metas


def reduce_descriptor(desc: ObjectDescriptor) -> tuple[Any, tuple[Any, ...]]:
    """``ObjectDescriptor.__reduce__`` (producer, or anyone passing a reference on): the
    metadata as rows, under :data:`FORMAT`."""
    made = rows(desc.metas)
    return descriptor_from_rows, (FORMAT, desc.object_id, desc.token, desc.owner, made, desc.packed_nbytes)


def descriptor_from_rows(  # noqa: PLR0917 - pickle calls it with positional arguments
    version: int, object_id: bytes, token: bytes, owner: PeerInfo, made: tuple[Row, ...], packed_nbytes: int
) -> ObjectDescriptor:
    """Consumer, unpickling: what :func:`reduce_descriptor` wrote, back as a descriptor.

    Raises:
        ValueError: Another version's format, or rows that are not tensor metadata.
    """
    if version != FORMAT:
        raise ValueError(
            f"a reference from another tensorwire version: its descriptor format is {version!r}, this one reads "
            f"{FORMAT}; run the same tensorwire version in every process"
        )
    try:
        metas = metas_from_rows(made)
    except (TypeError, ValueError) as e:  # a row of the wrong length, kind or types; unhashable parts
        raise ValueError(f"malformed tensor metadata in a reference: {e}") from None
    return ObjectDescriptor(object_id, token, owner, metas, packed_nbytes)


def facts(metas: tuple[TensorMeta, ...]) -> MetaFacts:
    """Consumer (a fetch's selection) or owner (byte counts): the :class:`MetaFacts` of
    ``metas``, worked out once per metadata tuple."""
    known = _facts_of.get(id(metas))
    if known is not None and known[0] is metas:
        return known[1]
    devices = {(m.device, m.device_uuid, m.kind.value) for m in metas}
    memory = frozenset(MemoryKind.CUDA if d.startswith("cuda") else MemoryKind.HOST for d, _, _ in devices)
    made = MetaFacts(
        nbytes=sum(m.nbytes for m in metas),
        memory=memory or frozenset({MemoryKind.HOST}),
        src_devices=frozenset(u for _, u, _ in devices if u),
        foreign_memory=any(d.startswith("cuda") and k in _FOREIGN_KINDS for d, _, k in devices),
        cpu_only=all(d == "cpu" or d.startswith("cpu:") for d, _, _ in devices),
    )
    _facts_of.put(id(metas), (metas, made), len(metas))
    return made
