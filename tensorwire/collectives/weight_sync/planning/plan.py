"""The weight-sync plan: which bytes each receiver reads from which trainer (pure metadata).

:func:`plan_sync` takes every trainer's and receiver's pieces (:class:`~.layout.ParamPiece`)
and a :class:`NameMap` (renames, fused parameters, fp8 scales), and returns a :class:`Plan`:
per receiver, :class:`Transfer` s of rectangular pieces (``src`` in the trainer's local
tensor, ``dst`` in the receiver's). Every receiver byte is covered exactly once, or planning
raises ``ValueError`` naming the parameter and the gap or overlap. A piece that several
trainers hold (replicas, data parallelism) is read from the least loaded of them, so the
bytes spread over trainers. Receivers are added and removed without replanning the others.

Fused receiver parameters (``qkv_proj`` from ``q``, ``k``, ``v``; ``gate_up_proj`` from
``gate``, ``up``) take the tensor-parallel interleaved form: a receiver sharded over a mesh
holds, along the fused dimension, *its* piece of each part one after the other, each part
split by the receiver's placements (``[its q rows; its k rows; its v rows]``).

dtypes: a receiver tensor of another floating dtype gets the trainer's values converted on
the trainer (fewer bytes on the wire for fp32 -> bf16); a float8 receiver tensor gets the
trainer's dtype on the wire and is quantised on the receiver with a per-tensor scale (the
amax of its piece / the float8 maximum), written to the scale tensor ``NameMap.scales`` names.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tensorwire.collectives.weight_sync.planning import buckets as bucket_policy
from tensorwire.collectives.weight_sync.planning import experts
from tensorwire.collectives.weight_sync.planning.layout import FLOAT8, Box, ParamPiece, dtype_itemsize, placement_box
from tensorwire.collectives.weight_sync.planning.mapping import Fuse, NameMap
from tensorwire.units import nbytes_text

__all__ = ["Arrived", "Fuse", "NameMap", "Plan", "Stream", "Transfer", "plan_sync"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One piece a receiver reads: ``src`` of the trainer's local ``source`` tensor into
    ``dst`` of its own ``target`` tensor, as ``wire_dtype`` on the way."""

    trainer: int
    source: str
    src: Box
    target: str
    dst: Box
    wire_dtype: str
    nbytes: int

    def split(self, bucket_bytes: int) -> list[Transfer]:
        """This transfer cut into pieces that fit a bucket (:func:`.buckets.split_rows`)."""
        itemsize = dtype_itemsize(self.wire_dtype)
        limit = bucket_policy.split_rows(self.nbytes, itemsize, bucket_bytes)
        if limit is None:
            return [self]
        return [
            Transfer(self.trainer, self.source, s, self.target, d, self.wire_dtype, s.numel * itemsize)
            for s, d in zip(self.src.split(limit), self.dst.split(limit), strict=True)
        ]


@dataclass(frozen=True)
class Stream:
    """What one trainer sends the same way to one or more receivers: the same source pieces
    in the same buckets (``transfers[r]`` are receiver ``r``'s, aligned with each other)."""

    trainer: int
    readers: tuple[int, ...]
    transfers: dict[int, list[Transfer]]
    buckets: list[list[int]]

    @property
    def slot_nbytes(self) -> int:
        """The staging slot this stream needs (:func:`.buckets.slot_nbytes`)."""
        first = self.transfers[self.readers[0]]
        return bucket_policy.slot_nbytes([first[i].nbytes for i in b] for b in self.buckets)


Arrived = Mapping[tuple[str, str], Sequence[Box]]  # (receiver parameter, wire dtype) -> boxes it holds


def _arrived_already(held: Arrived, piece: Transfer) -> bool:
    """Whether one of the ``held`` boxes of the piece's parameter (same wire dtype) covers it."""
    return any(box.contains(piece.dst) for box in held.get((piece.target, piece.wire_dtype), ()))


class _Sources:
    """The trainers that hold one box of a parameter."""

    __slots__ = ("box", "trainers")

    def __init__(self, box: Box, trainers: list[int]) -> None:
        self.box = box
        self.trainers = trainers

    def least(self, loads: list[int]) -> int:
        """The least loaded holder (the first of equals)."""
        return self.trainers[0] if len(self.trainers) == 1 else min(self.trainers, key=loads.__getitem__)


class Plan:
    """The plan of a weight sync (see the module doc). ``str(plan)`` is a readable summary."""

    def __init__(self, trainers: Sequence[Sequence[ParamPiece]], mapping: NameMap | None = None) -> None:
        self.mapping = mapping or NameMap()
        self.trainer_count = len(trainers)
        if not trainers:
            raise ValueError("a weight sync needs at least one trainer")
        self._first: dict[str, tuple[int, ParamPiece]] = {}  # per parameter: its first holder
        self._groups: dict[str, dict[Box, _Sources]] = {}  # per parameter: the trainers holding each distinct box
        for t, layout in enumerate(trainers):
            for held in layout:
                if held.placements is not None:
                    _check_piece(f"trainer {t}'s {held.name!r}", held)
                first = self._first.get(held.name)
                if first is None:
                    self._first[held.name] = (t, held)
                    self._groups[held.name] = {held.box: _Sources(held.box, [t])}
                    continue
                if first[1].global_shape != held.global_shape or first[1].dtype != held.dtype:
                    raise ValueError(
                        f"trainer parameter {held.name!r}: trainer {first[0]} has {list(first[1].global_shape)} "
                        f"{first[1].dtype}, trainer {t} {list(held.global_shape)} {held.dtype}"
                    )
                groups = self._groups[held.name]
                group = groups.get(held.box)
                if group is None:
                    groups[held.box] = _Sources(held.box, [t])
                else:
                    group.trainers.append(t)
        self._sources: dict[str, str] = {}
        for name in self._first:
            target = self.mapping.renamed(name)
            if target is None:
                continue
            if target in self._sources:
                raise ValueError(
                    f"receiver parameter {target!r}: trainer parameters {self._sources[target]!r} and {name!r} both "
                    "map to it (overlap); fix the rename"
                )
            self._sources[target] = name
        self._cut: dict[tuple[str, Box], list[tuple[Box, list[_Sources]]]] = {}  # pieces cut by _cells()
        self.loads = [0] * self.trainer_count  # bytes each trainer sends
        self.receivers: dict[int, list[Transfer]] = {}

    # ------------------------------------------------------------------ planning

    def add_receiver(self, receiver: int, layout: Sequence[ParamPiece]) -> list[Transfer]:
        """Plan receiver ``receiver`` (a new id) against the trainers; the others stay."""
        if receiver in self.receivers:
            raise ValueError(f"receiver {receiver} is planned already")
        names = {p.name for p in layout}
        scale_targets = {self.mapping.scales[p.name] for p in layout if p.name in self.mapping.scales}
        planned: dict[int, list[Transfer]] = {}
        transfers: list[Transfer] = []
        # the largest first, so that the greedy choice of trainers evens out (LPT); listed in layout order
        order = sorted(range(len(layout)), key=lambda i: -layout[i].box.numel * dtype_itemsize(layout[i].dtype))
        try:
            for i in order:
                if layout[i].name not in scale_targets:
                    planned[i] = self._plan_param(receiver, layout[i], names)
            transfers = [t for i in range(len(layout)) for t in planned.get(i, ())]
        except BaseException:
            transfers = [t for ts in planned.values() for t in ts]
            self.receivers[receiver] = transfers
            self.remove_receiver(receiver)
            raise
        self.receivers[receiver] = transfers
        return transfers

    def remove_receiver(self, receiver: int) -> None:
        """Forget receiver ``receiver``'s transfers (and the load they put on the trainers)."""
        for t in self.receivers.pop(receiver, []):
            self.loads[t.trainer] -= t.nbytes

    def _plan_param(self, receiver: int, held: ParamPiece, names: set[str]) -> list[Transfer]:
        fast = self._whole_piece(held)
        if fast is not None:
            return fast
        who = _Who(receiver, held.name)
        fused = self.mapping.fuse.get(held.name)
        parts = fused.parts if fused else (self._sources.get(held.name),)
        if parts[0] is None:
            raise ValueError(f"{who}: no trainer parameter maps to it (gap); rename one to it, or fuse parts into it")
        shapes = []
        for part in parts:
            first = self._first.get(part)
            if first is None:
                raise ValueError(f"{who}: no trainer holds its source {part!r} (gap)")
            shapes.append(first[1].global_shape)
        source_dtype = self._first[parts[0]][1].dtype
        if held.dtype in FLOAT8:
            scale = self.mapping.scales.get(held.name)
            if scale is None or scale not in names:
                raise ValueError(
                    f"{who} is {held.dtype}: name its per-tensor scale tensor (a float32 tensor of the receiver) "
                    f"in scales={{{held.name!r}: ...}}; got {scale!r}"
                )
            wire = source_dtype
        else:
            wire = held.dtype
        if (wire != source_dtype) and not _floating(wire, source_dtype):
            raise ValueError(f"{who}: cannot convert {source_dtype} to {held.dtype} (only between floating dtypes)")
        needs = self._needs(who, held, parts, shapes, fused)
        result = []
        itemsize = dtype_itemsize(wire)
        for part, need, local_offsets in needs:
            for trainer, cell, holder_box in self._cover(who, part, need, itemsize):
                if cell is holder_box and not any(local_offsets):  # a whole piece into a whole tensor
                    src = dst = Box((0,) * len(cell.sizes), cell.sizes)
                else:
                    src = cell.relative_to(holder_box.offsets)
                    moved = zip(cell.offsets, need.offsets, local_offsets, strict=True)
                    dst = Box(tuple(c - n + o for c, n, o in moved), cell.sizes)
                result.append(Transfer(trainer, part, src, held.name, dst, wire, cell.numel * itemsize))
        return result

    def _whole_piece(self, held: ParamPiece) -> list[Transfer] | None:
        """The common case without the general machinery: a plain parameter of the trainers'
        dtype whose piece is exactly some trainers' piece (None: take the general path)."""
        if held.placements is not None or held.rows is not None or held.name in self.mapping.fuse:
            return None
        source = self._sources.get(held.name)
        first = self._first.get(source) if source is not None else None
        if first is None or first[1].dtype != held.dtype or first[1].global_shape != held.global_shape:
            return None
        group = self._groups[source].get(held.box)
        if group is None:
            return None
        if not held.box.numel:
            return []
        trainer = group.least(self.loads)
        nbytes = held.box.numel * dtype_itemsize(held.dtype)
        self.loads[trainer] += nbytes
        local = Box((0,) * len(held.box.sizes), held.box.sizes)
        return [Transfer(trainer, source, local, held.name, local, held.dtype, nbytes)]

    def _needs(
        self, who: _Who, held: ParamPiece, parts: Sequence[str], shapes: Sequence[tuple[int, ...]], fused: Fuse | None
    ) -> list[tuple[str, Box, tuple[int, ...]]]:
        """(part, the piece of it this receiver needs, where that lands in its local tensor)."""
        if fused is not None and held.rows is not None:
            raise ValueError(f"{who}: placed by an expert map and fused: describe the experts unfused")
        if fused is None and held.rows is not None:  # placed by an expert map
            if shapes[0] != held.global_shape:
                raise ValueError(f"{who}: {list(held.global_shape)} experts' tensor, its source {list(shapes[0])}")
            return experts.needs(parts[0], held)
        if fused is None:
            if shapes[0] != held.global_shape:
                raise ValueError(
                    f"{who} has global shape {list(held.global_shape)}, its source {parts[0]!r} {list(shapes[0])}"
                )
            _check_piece(who, held)
            return [(parts[0], held.box, (0,) * len(held.box.sizes))]
        dim = fused.dim if fused.dim >= 0 else fused.dim + len(held.global_shape)
        for part, shape in zip(parts, shapes, strict=True):
            other = [s for d, s in enumerate(shape) if d != dim]
            mine = [s for d, s in enumerate(held.global_shape) if d != dim]
            if len(shape) != len(held.global_shape) or other != mine:
                raise ValueError(f"{who}: part {part!r} of shape {list(shape)} cannot be fused along dim {dim}")
        total = sum(shape[dim] for shape in shapes)
        if total != held.global_shape[dim]:
            raise ValueError(
                f"{who}: its parts {list(parts)} add up to {total} along dim {dim}, it has {held.global_shape[dim]}"
            )
        if held.placements is None and held.box != Box.full(held.global_shape):
            raise ValueError(f"{who} is fused and sharded: describe its piece by placements (Sharded.of), not offsets")
        needs, position = [], 0
        for part, shape in zip(parts, shapes, strict=True):
            if held.placements is None:
                box = Box.full(shape)
            else:
                box = placement_box(shape, held.placements, held.mesh_shape or (), held.coordinate or ())
            local = [0] * len(shape)
            local[dim] = position
            needs.append((part, box, tuple(local)))
            position += box.sizes[dim]
        if position != held.box.sizes[dim]:
            raise ValueError(
                f"{who}: its local tensor has {held.box.sizes[dim]} along dim {dim}; its parts' pieces add up to "
                f"{position}"
            )
        return needs

    def _cover(self, who: _Who, part: str, need: Box, itemsize: int) -> list[tuple[int, Box, Box]]:
        """(trainer, cell, that trainer's box) covering ``need`` exactly once, each cell from the
        least loaded trainer holding it (whose load grows by the cell's bytes)."""
        if need.numel == 0:
            return []
        loads = self.loads
        groups = self._groups[part]
        exact = groups.get(need)
        if exact is not None:  # the common case: the trainers' pieces are the receiver's
            trainer = exact.least(loads)
            loads[trainer] += need.numel * itemsize
            return [(trainer, exact.box, exact.box)]
        cells = self._cut.get((part, need))
        if cells is None:  # receivers of one piece share its geometry; only the loads differ
            cells = self._cut[(part, need)] = _cells(who, part, need, list(groups.values()))
        result = []
        for cell, candidates in cells:
            group, trainer = _least(candidates, loads)
            loads[trainer] += cell.numel * itemsize
            result.append((trainer, cell, group.box))
        return result

    # ------------------------------------------------------------------ execution view

    def streams(
        self, receivers: Iterable[int], bucket_bytes: int, have: Mapping[int, Arrived] | None = None
    ) -> list[Stream]:
        """Per trainer, the live ``receivers`` grouped by identical source pieces, cut into
        buckets; ``have[r]``: pieces receiver ``r`` holds already, left out (a failover's try
        again reads only what is missing)."""
        result = []
        for trainer in range(self.trainer_count):
            groups: dict[tuple, list[int]] = {}
            lists: dict[int, list[Transfer]] = {}
            for r in receivers:
                held = (have or {}).get(r)
                mine = [
                    piece
                    for t in self.receivers[r]
                    if t.trainer == trainer
                    for piece in t.split(bucket_bytes)
                    if not held or not _arrived_already(held, piece)
                ]
                if not mine:
                    continue
                lists[r] = mine
                groups.setdefault(tuple((t.source, t.src, t.wire_dtype) for t in mine), []).append(r)
            for readers in groups.values():
                buckets = bucket_policy.cut([t.nbytes for t in lists[readers[0]]], bucket_bytes)
                result.append(Stream(trainer, tuple(readers), {r: lists[r] for r in readers}, buckets))
        return result

    # ------------------------------------------------------------------ reporting

    @property
    def nbytes(self) -> int:
        """Bytes every push moves (each receiver's bytes once)."""
        return sum(self.receiver_nbytes().values())

    def pair_nbytes(self) -> dict[tuple[int, int], int]:
        pairs: dict[tuple[int, int], int] = {}
        for r, transfers in self.receivers.items():
            for t in transfers:
                pairs[(t.trainer, r)] = pairs.get((t.trainer, r), 0) + t.nbytes
        return pairs

    def receiver_nbytes_of(self, receiver: int, targets: frozenset[str] | None = None) -> int:
        """Bytes ``receiver`` gets in a push (of its parameters ``targets`` only, when given)."""
        return sum(t.nbytes for t in self.receivers[receiver] if targets is None or t.target in targets)

    def receiver_nbytes(self) -> dict[int, int]:
        return {r: sum(t.nbytes for t in transfers) for r, transfers in self.receivers.items()}

    def trainer_nbytes(self) -> list[int]:
        return list(self.loads)

    def transfer_counts(self) -> tuple[list[int], dict[int, int]]:
        per_trainer = [0] * self.trainer_count
        for transfers in self.receivers.values():
            for t in transfers:
                per_trainer[t.trainer] += 1
        return per_trainer, {r: len(ts) for r, ts in self.receivers.items()}

    def modelled_push_s(self, rank_gbps: float, *, latency_us: float = 0.0) -> float:
        """A push with every pair at once, when each rank moves at most ``rank_gbps`` (GB/s)
        and pays ``latency_us`` per transfer: the slowest rank's time."""
        per_trainer, per_receiver = self.transfer_counts()
        rate = rank_gbps * 1e9
        times = [b / rate + n * latency_us * 1e-6 for b, n in zip(self.loads, per_trainer, strict=True)]
        sizes = self.receiver_nbytes()
        times += [sizes[r] / rate + per_receiver[r] * latency_us * 1e-6 for r in sizes]
        return max(times, default=0.0)

    def bound_s(self, rank_gbps: float) -> float:
        """No plan beats this: the busiest receiver's bytes, or the bytes spread evenly over
        the trainers, at ``rank_gbps`` per rank."""
        sizes = self.receiver_nbytes()
        busiest = max(max(sizes.values(), default=0), self.nbytes / self.trainer_count)
        return busiest / (rank_gbps * 1e9)

    def summary(self, rank_gbps: float = 25.0, *, max_pairs: int = 16) -> str:
        pairs = sorted(self.pair_nbytes().items(), key=lambda kv: (-kv[1], kv[0]))
        receiver_bytes = self.receiver_nbytes()
        count = sum(len(ts) for ts in self.receivers.values())
        lines = [
            f"weight-sync plan: {self.trainer_count} trainer(s) -> {len(self.receivers)} receiver(s), "
            f"{nbytes_text(self.nbytes)} per push in {count} transfer(s) over {len(pairs)} pair(s)",
            f"  {'trainer':>8} {'receiver':>8} {'bytes':>12}",
        ]
        lines += [f"  {t:>8} {r:>8} {nbytes_text(n):>12}" for (t, r), n in pairs[:max_pairs]]
        if len(pairs) > max_pairs:
            lines.append(f"  ... {len(pairs) - max_pairs} more pair(s)")
        if self.loads:
            lines.append(f"  per trainer: min {nbytes_text(min(self.loads))}, max {nbytes_text(max(self.loads))}")
        if receiver_bytes:
            low, high = min(receiver_bytes.values()), max(receiver_bytes.values())
            lines.append(f"  per receiver: min {nbytes_text(low)}, max {nbytes_text(high)}")
        lines.append(
            f"  at {rank_gbps:g} GB/s per rank: modelled push {_duration(self.modelled_push_s(rank_gbps))}, "
            f"bound {_duration(self.bound_s(rank_gbps))}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


class _Who:
    """``receiver 3's 'name'``, formatted only when an error message needs it."""

    __slots__ = ("name", "receiver")

    def __init__(self, receiver: int, name: str) -> None:
        self.receiver, self.name = receiver, name

    def __str__(self) -> str:
        return f"receiver {self.receiver}'s {self.name!r}"

    __format__ = lambda self, _spec: str(self)  # noqa: E731


def _check_piece(who: object, held: ParamPiece) -> None:
    """A piece described by placements must be the piece they give (its local shape included)."""
    if held.placements is None:
        return
    given = placement_box(held.global_shape, held.placements, held.mesh_shape or (), held.coordinate or ())
    if given != held.box:
        raise ValueError(
            f"{who}: its local piece {held.box} (shape {list(held.box.sizes)}) is not the piece its placements "
            f"{list(held.placements)} give on mesh {list(held.mesh_shape or ())} at {list(held.coordinate or ())}: "
            f"{given}"
        )


def _cells(who: _Who, part: str, need: Box, groups: list[_Sources]) -> list[tuple[Box, list[_Sources]]]:
    """``need`` cut at the edges of the trainers' boxes it overlaps: (cell, the groups holding
    it whole); one cell when some trainers hold all of ``need``."""
    hits = [g for g in groups if g.box.intersect(need) is not None]
    whole = [g for g in hits if g.box.contains(need)]
    if whole:
        return [(need, whole)]
    cuts = []
    for d, (start, size) in enumerate(zip(need.offsets, need.sizes, strict=True)):
        points = {start, start + size}
        for g in hits:
            b = g.box
            points.update(p for p in (b.offsets[d], b.offsets[d] + b.sizes[d]) if start < p < start + size)
        cuts.append(list(itertools.pairwise(sorted(points))))
    cells = []
    for intervals in itertools.product(*cuts):
        cell = Box(tuple(a for a, _ in intervals), tuple(b - a for a, b in intervals))
        candidates = [g for g in hits if g.box.contains(cell)]
        if not candidates:
            raise ValueError(f"{who}: no trainer holds {cell} of {part!r} (gap)")
        cells.append((cell, candidates))
    return cells


def _least(groups: Sequence[_Sources], loads: list[int]) -> tuple[_Sources, int]:
    """The group and trainer of the least loaded holder among ``groups``."""
    if len(groups) == 1:
        return groups[0], groups[0].least(loads)
    best = min(((g, g.least(loads)) for g in groups), key=lambda gt: (loads[gt[1]], gt[1]))
    return best


def _floating(*dtypes: str) -> bool:
    return all(d.startswith(("float", "bfloat")) for d in dtypes)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def plan_sync(
    trainers: Sequence[Sequence[ParamPiece]],
    receivers: Sequence[Sequence[ParamPiece]],
    mapping: NameMap | None = None,
) -> Plan:
    """Plan a sync from layouts alone (no actors, no tensors): receiver ``i`` gets id ``i``."""
    plan = Plan(trainers, mapping)
    for index, layout in enumerate(receivers):
        plan.add_receiver(index, layout)
    return plan
