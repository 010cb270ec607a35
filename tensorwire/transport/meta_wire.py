"""How an object's descriptor travels in a pickled reference, and what a fetch derives from
its tensors' metadata: both remembered, because the same layouts come again and again.

A pickled :class:`~tensorwire.transport.base.TensorMeta` is a dataclass rebuilt field by field;
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

from typing import TYPE_CHECKING, Any, NamedTuple

from tensorwire.transport.costs import MemoryKind

if TYPE_CHECKING:
    from tensorwire.transport.base import ObjectDescriptor, PeerInfo, TensorMeta

__all__ = [
    "FORMAT",
    "MEMO_SIZE",
    "MEMO_TENSORS",
    "MetaFacts",
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


class MetaFacts(NamedTuple):
    """What a fetch needs to know about an object's tensors as a whole."""

    nbytes: int
    memory: frozenset[MemoryKind]
    src_devices: frozenset[str]  # UUIDs of the GPUs the tensors live on
    foreign_memory: bool  # some CUDA tensor came from a DLPack producer (cupy, ...)


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
    made = tuple((m.shape, m.dtype, m.device, m.nbytes, m.offset, m.kind.value, m.device_uuid) for m in metas)
    _rows_of.put(id(metas), (metas, made), len(made))
    return made


def _meta(row: Row) -> TensorMeta:
    """One row as ``TensorMeta``; ``ValueError`` unless every field has its exact type (a
    ``True`` or ``1.0`` equals ``1`` as a memo key, so a loose row would stand for good ones)."""
    from tensorwire.transport.base import TensorKind, TensorMeta

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
    from tensorwire.transport.base import ObjectDescriptor

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
    )
    _facts_of.put(id(metas), (metas, made), len(metas))
    return made
