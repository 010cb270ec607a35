"""Layouts: which piece of each parameter a weight-sync trainer or receiver holds.

Pure metadata (no tensor memory), so that a plan for a trillion-parameter model is computed
from descriptions alone. A piece is a :class:`Box` (offsets and sizes along every dimension)
of the parameter's global shape. An actor describes its pieces next to the tensors its
``source``/``target`` gives:

* a plain tensor: the whole parameter (replicated: every holder has all of it);
* a ``torch.distributed.tensor.DTensor``: its mesh, placements and coordinate give the box;
* :class:`Sharded` (``tw.collective.Sharded``): a local tensor with placements over a mesh
  like DTensor's (``Shard(dim)``, ``Replicate()``), or with explicit offsets.

``Shard`` splits like ``torch.chunk`` (and DTensor): chunks of ``ceil(size / parts)``, the last
ones smaller or empty; several mesh dimensions sharding one tensor dimension split it in mesh
order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorwire.transport.metadata import dtype_name

if TYPE_CHECKING:
    import torch

__all__ = [
    "Box",
    "ParamPiece",
    "Replicate",
    "Shard",
    "Sharded",
    "describe_value",
    "dtype_itemsize",
    "placement_box",
]

_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}
FLOAT8 = frozenset(name for name in _ITEMSIZE if name.startswith("float8"))


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named like torch's (``"bfloat16"``)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        import torch

        size = getattr(torch, dtype).itemsize
        _ITEMSIZE[dtype] = size
    return size


@dataclass(frozen=True)
class Shard:
    """The tensor's dimension ``dim`` is split over a mesh dimension (like DTensor's)."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """Every rank along a mesh dimension holds the same piece (like DTensor's)."""


Placement = Shard | Replicate


@dataclass(frozen=True, slots=True)
class Box:
    """A rectangular piece of a tensor: ``offsets`` and ``sizes`` along every dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common piece, or None when they do not overlap (or it is empty)."""
        offsets, sizes = [], []
        for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True):
            start, end = max(a, b), min(a + s, b + t)
            if end <= start:
                return None
            offsets.append(start)
            sizes.append(end - start)
        return Box(tuple(offsets), tuple(sizes))

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + t <= a + s
            for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        )

    def relative_to(self, origin: Sequence[int]) -> Box:
        """This box in the coordinates of a piece that starts at ``origin``."""
        return Box(tuple(o - p for o, p in zip(self.offsets, origin, strict=True)), self.sizes)

    def moved(self, dim: int, delta: int) -> Box:
        offsets = list(self.offsets)
        offsets[dim] += delta
        return Box(tuple(offsets), self.sizes)

    def split(self, max_numel: int) -> list[Box]:
        """Cut along the first dimension longer than 1 into boxes of at most ``max_numel``
        elements (as few as possible; a single row larger than that stays whole)."""
        if self.numel <= max_numel:
            return [self]
        dim = next((d for d, s in enumerate(self.sizes) if s > 1), None)
        if dim is None:
            return [self]
        row = self.numel // self.sizes[dim]
        per = max(1, max_numel // row)
        pieces = []
        for start in range(0, self.sizes[dim], per):
            offsets, sizes = list(self.offsets), list(self.sizes)
            offsets[dim] += start
            sizes[dim] = min(per, self.sizes[dim] - start)
            pieces.append(Box(tuple(offsets), tuple(sizes)))
        return pieces

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk ``index`` of ``parts`` along a dimension of ``size``
    (``torch.chunk``'s sizes: ``ceil(size / parts)``, the last ones smaller or empty)."""
    per = -(-size // parts)
    start = min(per * index, size)
    return start, max(0, min(per, size - start))


def placement_box(
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> Box:
    """The piece that the rank at ``coordinate`` of a mesh holds under ``placements``
    (one per mesh dimension)."""
    if not (len(placements) == len(mesh_shape) == len(coordinate)):
        raise ValueError(
            f"placements {list(placements)}, mesh shape {list(mesh_shape)} and coordinate {list(coordinate)} "
            "need one entry per mesh dimension each"
        )
    offsets, sizes = [0] * len(global_shape), list(global_shape)
    for placement, parts, index in zip(placements, mesh_shape, coordinate, strict=True):
        if not 0 <= index < parts:
            raise ValueError(f"coordinate {list(coordinate)} is outside the mesh {list(mesh_shape)}")
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise TypeError(f"placements are Shard(dim) or Replicate(), not {placement!r}")
        dim = placement.dim if placement.dim >= 0 else placement.dim + len(global_shape)
        if not 0 <= dim < len(global_shape):
            raise ValueError(f"{placement} of a tensor with {len(global_shape)} dimensions")
        start, length = chunk(sizes[dim], parts, index)
        offsets[dim] += start
        sizes[dim] = length
    return Box(tuple(offsets), tuple(sizes))


@dataclass(frozen=True, slots=True)
class ParamPiece:
    """One holder's piece of one parameter, as the plan sees it (no tensor).

    ``placements``/``mesh_shape``/``coordinate`` are kept when the piece was described by
    them (fused receiver parameters need them: each part is split the same way).
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    box: Box
    placements: tuple[Placement, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    coordinate: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None  # placed by an expert map: the global expert in each local slot (dim 0)

    @property
    def nbytes(self) -> int:
        return self.box.numel * dtype_itemsize(self.dtype)


@dataclass(frozen=True)
class Sharded:
    """A local tensor and which piece of the global parameter it is (``tw.collective.Sharded``).

    Give either ``offsets`` or ``placements`` (with ``mesh_shape`` and ``coordinate``);
    ``global_shape`` defaults, for placements, to an even split.
    """

    tensor: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    placements: tuple[Placement, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    coordinate: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None

    @classmethod
    def experts(cls, tensor: torch.Tensor, experts: Sequence[int], num_experts: int) -> Sharded:
        """``tensor`` holds, in slot ``s`` along dim 0, global expert ``experts[s]`` of a
        parameter of ``num_experts`` experts (an inference engine's expert map: any order, an
        expert on several ranks; :mod:`.experts`)."""
        rows = tuple(int(e) for e in experts)
        return cls(tensor, (num_experts, *tuple(tensor.shape)[1:]), (0,) * tensor.dim(), rows=rows)

    @classmethod
    def at(cls, tensor: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]) -> Sharded:
        """``tensor`` is the piece of a ``global_shape`` parameter that starts at ``offsets``."""
        return cls(tensor, tuple(global_shape), tuple(offsets))

    @classmethod
    def of(
        cls,
        tensor: torch.Tensor,
        placements: Sequence[Placement],
        mesh_shape: Sequence[int],
        coordinate: Sequence[int],
        global_shape: Sequence[int] | None = None,
    ) -> Sharded:
        """``tensor`` is the piece the rank at ``coordinate`` of a mesh holds (DTensor-style)."""
        if global_shape is None:
            shape = list(tensor.shape)
            for placement, parts in zip(placements, mesh_shape, strict=True):
                if isinstance(placement, Shard):
                    shape[placement.dim] *= parts
            global_shape = shape
        box = placement_box(global_shape, placements, mesh_shape, coordinate)
        return cls(tensor, tuple(global_shape), box.offsets, tuple(placements), tuple(mesh_shape), tuple(coordinate))


def _from_dtensor(value: Any) -> Sharded:
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("a DTensor of a mesh this process is not part of")
    placements: list[Placement] = []
    for placement in value.placements:
        if type(placement) is TorchShard:
            placements.append(Shard(placement.dim))
        elif isinstance(placement, TorchReplicate):
            placements.append(Replicate())
        else:
            raise ValueError(
                f"DTensor placement {placement!r} is not supported (Shard(dim) and Replicate() are); "
                "redistribute() it first"
            )
    return Sharded.of(value.to_local(), placements, tuple(mesh.shape), tuple(coordinate), tuple(value.shape))


def _is_dtensor(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def describe_value(
    value: dict[str, Any], role: str, *, own_tensors: bool = False
) -> tuple[list[ParamPiece], list[torch.Tensor]]:
    """The pieces a holder's ``source``/``target`` dict describes, and the local tensors
    (detached; ``own_tensors``: the tensor objects themselves, to swap memory into them)."""
    import torch

    layout, tensors = [], []
    for name, given in value.items():
        item = _from_dtensor(given) if _is_dtensor(given) else given
        if isinstance(item, Sharded) and item.rows is not None:
            if role == "source":
                raise ValueError(
                    f"source {name!r}: an expert map describes where a receiver places experts; describe a trainer's "
                    "experts by the block it holds (Sharded.at / Sharded.of)"
                )
            local = item.tensor
            if not isinstance(local, torch.Tensor):
                raise TypeError(f"{role} {name!r}: Sharded holds {type(local).__name__}, not a tensor")
            _check_rows(f"{role} {name!r}", item.rows, tuple(local.shape), item.global_shape)
            box = Box((0,) * local.dim(), tuple(local.shape))
            held = ParamPiece(name, item.global_shape, dtype_name(local.dtype), box, rows=item.rows)
        elif isinstance(item, Sharded):
            local = item.tensor
            if not isinstance(local, torch.Tensor):
                raise TypeError(f"{role} {name!r}: Sharded holds {type(local).__name__}, not a tensor")
            box = Box(item.offsets, tuple(local.shape))
            if len(item.global_shape) != local.dim() or not Box.full(item.global_shape).contains(box):
                raise ValueError(
                    f"{role} {name!r}: a local piece of shape {tuple(local.shape)} at offsets {list(item.offsets)} "
                    f"does not fit the global shape {list(item.global_shape)}"
                )
            held = ParamPiece(
                name, item.global_shape, dtype_name(local.dtype), box, item.placements, item.mesh_shape, item.coordinate
            )
        elif isinstance(item, torch.Tensor):
            local = item
            held = ParamPiece(name, tuple(local.shape), dtype_name(local.dtype), Box.full(local.shape))
        else:
            raise TypeError(f"{role} {name!r} is {type(item).__name__}, not a tensor, a DTensor or a Sharded")
        layout.append(held)
        tensors.append(local if own_tensors else local.detach())
    return layout, tensors


def _check_rows(who: object, rows: Sequence[int], local_shape: Sequence[int], global_shape: Sequence[int]) -> None:
    """Raise ``ValueError`` for an expert map that cannot describe the local tensor."""
    if not global_shape or len(local_shape) != len(global_shape):
        raise ValueError(f"{who}: an expert map needs a local tensor of the global tensor's rank, experts along dim 0")
    if len(rows) != local_shape[0]:
        raise ValueError(f"{who}: its expert map lists {len(rows)} experts for {local_shape[0]} slots along dim 0")
    if tuple(local_shape[1:]) != tuple(global_shape[1:]):
        raise ValueError(
            f"{who}: each slot must hold a whole expert: local shape {list(local_shape)}, global {list(global_shape)}"
        )
    bad = [e for e in rows if not 0 <= e < global_shape[0]]
    if bad:
        raise ValueError(f"{who}: experts {bad[:5]} are not among the {global_shape[0]} experts")
