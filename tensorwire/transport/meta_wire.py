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
    "MEMO_SIZE",
    "MetaFacts",
    "descriptor_from_rows",
    "device",
    "dtype_name",
    "facts",
    "metas_from_rows",
    "reduce_descriptor",
    "rows",
]

MEMO_SIZE = 256
_FOREIGN_KINDS = ("cupy", "dlpack")  # memory torch did not allocate (TensorKind values)

Row = tuple[tuple[int, ...], str, str, int, int, str, str]


class MetaFacts(NamedTuple):
    """What a fetch needs to know about an object's tensors as a whole."""

    nbytes: int
    memory: frozenset[MemoryKind]
    src_devices: frozenset[str]  # UUIDs of the GPUs the tensors live on
    foreign_memory: bool  # some CUDA tensor came from a DLPack producer (cupy, ...)
    placements: int  # distinct (device, GPU UUID) pairs among the tensors


_rows_of: dict[int, tuple[tuple[TensorMeta, ...], tuple[Row, ...]]] = {}  # id(metas) -> (metas, rows)
_metas_of: dict[tuple[Row, ...], tuple[TensorMeta, ...]] = {}  # rows -> metas
_facts_of: dict[int, tuple[tuple[TensorMeta, ...], MetaFacts]] = {}  # id(metas) -> (metas, facts)
_dtype_names: dict[Any, str] = {}  # torch.dtype -> name (a handful)
_devices: dict[str, Any] = {}  # device string -> torch.device


def _remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    if len(memo) >= MEMO_SIZE:
        memo.clear()
    memo[key] = value


def dtype_name(dtype: Any) -> str:
    """A torch dtype's name as metadata spells it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def device(name: str) -> Any:
    """``torch.device(name)``, made once per name."""
    made = _devices.get(name)
    if made is None:
        import torch

        made = torch.device(name)
        _remember(_devices, name, made)
    return made


def rows(metas: tuple[TensorMeta, ...]) -> tuple[Row, ...]:
    """``metas`` as plain tuples (made once per metadata tuple)."""
    known = _rows_of.get(id(metas))
    if known is not None and known[0] is metas:
        return known[1]
    made = tuple((m.shape, m.dtype, m.device, m.nbytes, m.offset, m.kind.value, m.device_uuid) for m in metas)
    _remember(_rows_of, id(metas), (metas, made))
    return made


def metas_from_rows(made: tuple[Row, ...]) -> tuple[TensorMeta, ...]:
    """The ``TensorMeta`` tuple of ``made`` (the same tuple for rows seen before)."""
    known = _metas_of.get(made)
    if known is not None:
        return known
    from tensorwire.transport.base import TensorKind, TensorMeta

    metas = tuple(TensorMeta(s, d, dev, n, o, TensorKind(k), u) for s, d, dev, n, o, k, u in made)
    _remember(_metas_of, made, metas)
    return metas


def reduce_descriptor(desc: ObjectDescriptor) -> tuple[Any, tuple[Any, ...]]:
    """``ObjectDescriptor.__reduce__``: the metadata as rows."""
    return descriptor_from_rows, (desc.object_id, desc.token, desc.owner, rows(desc.metas), desc.packed_nbytes)


def descriptor_from_rows(
    object_id: bytes, token: bytes, owner: PeerInfo, made: tuple[Row, ...], packed_nbytes: int
) -> ObjectDescriptor:
    """What :func:`reduce_descriptor` wrote, back as a descriptor. Raises ``ValueError`` for rows
    that are not tensor metadata."""
    from tensorwire.transport.base import ObjectDescriptor

    try:
        metas = metas_from_rows(made)
    except (TypeError, ValueError) as e:  # a row of the wrong length or kind
        raise ValueError(f"malformed tensor metadata in a reference: {e}") from None
    return ObjectDescriptor(object_id, token, owner, metas, packed_nbytes)


def facts(metas: tuple[TensorMeta, ...]) -> MetaFacts:
    """The :class:`MetaFacts` of ``metas`` (worked out once per metadata tuple)."""
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
        placements=len({(d, u) for d, u, _ in devices}),
    )
    _remember(_facts_of, id(metas), (metas, made))
    return made
