"""The sharded weight-sync benchmark: 2 trainer shards -> 2 inference replicas x TP 2.

A transformer-shaped state (per layer q, k, v, o, gate, up, down and a norm, float32) is held
half by each of 2 trainer actors (rows, as FSDP does); 4 receiver actors (bfloat16, as inference
engines hold weights) are 2 replicas of 2 tensor-parallel ranks with fused ``qkv`` / ``gate_up``
(column parallel), row-parallel ``o`` / ``down`` and replicated norms. Every method leaves the
same bytes in the receivers' tensors. The trainers' values change every round (a new seed), and
every round of every method is checked by checksum against the one pass below, computed in this
process from the same seeds, independently of any method (``wrong``: the bytes of receivers that
hold anything else):

* ``tensorwire WeightSync``: the plan; each receiver reads its bytes from the trainers into
  its shadow copy and all commit together (the default, all-or-none); with ``commit='each'``
  each receiver reads in place and commits on its own (best effort, as the baselines are); with
  ``aside='none'`` all-or-none with no shadow (it needs every byte held by two trainers: a second
  pair of trainer halves with the same values joins that sync). Each of these also has a ``first
  push`` row: a sync made anew (its rehearsal included in the making, not in the row) and timed
  on its first push.
* ``gather on trainer 0, push whole`` (what most RL frameworks do): the trainers all-gather
  every parameter (gloo), trainer 0 broadcasts it whole to the receivers (gloo), each keeps
  its slice.
* ``Ray object store``: each trainer puts its shard once; every receiver gets both and keeps
  its pieces.
* ``memcpy: one pass over the plan`` (the bound, not an alternative): in this process, every
  receiver piece copied from the trainers' values with the conversion on the way, once
  (torch's copy with its threads): the least any method can do on one node.

One core, two front ends: ``python -m benchmarks.sharded_sync`` and ``tensorwire bench
--scenarios sharded-sync``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import tensorwire as tw
from tensorwire.bench import ray_baselines
from tensorwire.collectives.weight_sync.planning.layout import Replicate, Shard, Sharded, placement_box
from tensorwire.collectives.weight_sync.planning.plan import Fuse, plan_sync
from tensorwire.collectives.weight_sync.streams.staging import checksum
from tensorwire.runtime.ray import calls

__all__ = ["DEFAULT", "EACH", "FIRST", "HIDDEN", "NO_ASIDE", "ONE_PASS", "Bench", "run"]

_TIMEOUT_S = 600.0


def _gather(refs: list[Any]) -> list[Any]:
    return calls.gather(refs, timeout_s=_TIMEOUT_S)


HIDDEN, FFN = 1024, 2816
TRAINERS, REPLICAS, TP = 2, 2, 2
RECEIVER_DTYPE = torch.bfloat16
ONE_PASS = "memcpy: one pass over the plan (read + convert)"
DEFAULT = "tensorwire WeightSync"
EACH = "tensorwire WeightSync, commit='each'"
NO_ASIDE = "tensorwire WeightSync, aside='none'"
FIRST = ", first push"
_PARTS = {
    "q": (HIDDEN, HIDDEN),
    "k": (HIDDEN, HIDDEN),
    "v": (HIDDEN, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate": (FFN, HIDDEN),
    "up": (FFN, HIDDEN),
    "down": (HIDDEN, FFN),
    "norm": (HIDDEN,),
}


def shapes(nbytes: int, hidden: int = HIDDEN) -> dict[str, tuple[int, ...]]:
    """Trainer parameter -> shape: as many layers as fit ``nbytes`` of float32 (at least
    one; below one layer of ``HIDDEN`` the width shrinks)."""
    scale = hidden / HIDDEN
    parts = {k: tuple(max(8, int(d * scale) // 8 * 8) for d in s) for k, s in _PARTS.items()}
    per_layer = sum(torch.Size(s).numel() * 4 for s in parts.values())
    if nbytes < per_layer and hidden > 64:
        return shapes(nbytes, hidden // 2)
    return {f"l{i}.{k}": s for i in range(max(1, round(nbytes / per_layer))) for k, s in parts.items()}


def trainer_entries(rank: int, model: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    return {n: (s, (Shard(0),), (TRAINERS,), (rank,), None) for n, s in model.items()}


def receiver_entries(coord: tuple[int, int], model: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    mesh, entries = (REPLICAS, TP), {}
    for layer in sorted({n.split(".")[0] for n in model}, key=lambda x: int(x[1:])):
        for fused, parts in (("qkv", "qkv"), ("gate_up", ("gate", "up"))):
            pieces = [placement_box(model[f"{layer}.{p}"], (Replicate(), Shard(0)), mesh, coord).sizes for p in parts]
            shape = (sum(model[f"{layer}.{p}"][0] for p in parts), model[f"{layer}.{parts[0]}"][1])
            entries[f"layers.{layer}.{fused}"] = (
                shape,
                (Replicate(), Shard(0)),
                mesh,
                coord,
                (sum(p[0] for p in pieces), pieces[0][1]),
            )
        for part in ("o", "down"):
            entries[f"layers.{layer}.{part}_proj"] = (
                model[f"{layer}.{part}"],
                (Replicate(), Shard(1)),
                mesh,
                coord,
                None,
            )
        entries[f"layers.{layer}.norm"] = (model[f"{layer}.norm"], (Replicate(), Replicate()), mesh, coord, None)
    return entries


def mapping(model: dict[str, tuple[int, ...]]) -> tuple[dict[str, str], dict[str, Fuse]]:
    layers = sorted({n.split(".")[0] for n in model})
    rename = {}
    fuse = {}
    for layer in layers:
        rename |= {
            f"{layer}.o": f"layers.{layer}.o_proj",
            f"{layer}.down": f"layers.{layer}.down_proj",
            f"{layer}.norm": f"layers.{layer}.norm",
        }
        fuse[f"layers.{layer}.qkv"] = Fuse((f"{layer}.q", f"{layer}.k", f"{layer}.v"))
        fuse[f"layers.{layer}.gate_up"] = Fuse((f"{layer}.gate", f"{layer}.up"))
    return rename, fuse


def held_pieces(entries: dict[str, tuple], seed: int | None, dtype: torch.dtype = RECEIVER_DTYPE) -> dict[str, Sharded]:
    """A rank's pieces: a trainer's (``seed``: random float32) or a receiver's (zeros of ``dtype``)."""
    gen = torch.Generator().manual_seed(seed or 0)
    pieces = {}
    for name, (shape, placements, mesh, coord, local) in entries.items():
        size = local or placement_box(shape, placements, mesh, coord).sizes
        tensor = torch.randn(size, generator=gen) if seed is not None else torch.zeros(size, dtype=dtype)
        pieces[name] = Sharded.of(tensor, placements, mesh, coord, shape)
    return pieces


class OnePass:
    """The bound: every receiver's pieces copied once from the trainers' values, converted on
    the way, in this process."""

    def __init__(self, model: dict[str, tuple[int, ...]], coords: list[tuple[int, int]], dtype: torch.dtype) -> None:
        self.model = model
        self.sources: list[dict[str, torch.Tensor]] = []
        self.step(0)
        self.targets = [
            {n: p.tensor for n, p in held_pieces(receiver_entries(c, model), None, dtype).items()} for c in coords
        ]
        self.cuts: dict[int, list[tuple[Any, ...]]] = {}

    def step(self, seed: int) -> None:
        """The trainers' values of round ``seed`` (what every trainer rank holds then)."""
        self.sources = [
            {n: p.tensor for n, p in held_pieces(trainer_entries(r, self.model), seed + r + 1).items()}
            for r in range(TRAINERS)
        ]

    def run(self) -> None:
        for r, cuts in self.cuts.items():
            for trainer, source, src, target, dst in cuts:
                self.targets[r][target][dst].copy_(self.sources[trainer][source][src])

    def clear(self) -> None:
        for target in self.targets:
            for tensor in target.values():
                tensor.zero_()

    def digests(self) -> list[int]:
        return [checksum(list(target.values())) for target in self.targets]


@tw.remote(num_cpus=0)
class ShardedRank:
    """A trainer rank (its half of every parameter) or a receiver rank (zeros of its layout)."""

    def __init__(self, entries: dict[str, tuple], seed: int | None, dtype: torch.dtype = RECEIVER_DTYPE) -> None:
        self.pieces = held_pieces(entries, seed, dtype)
        self._cuts: list[tuple[Any, ...]] = []
        self._pool: dict[tuple[int, ...], torch.Tensor] = {}

    def state_dict(self) -> dict[str, Sharded]:
        return self.pieces

    def step(self, entries: dict[str, tuple], seed: int) -> None:
        """A trainer rank: new values (round ``seed``), in the same tensors."""
        for name, piece in held_pieces(entries, seed).items():
            self.pieces[name].tensor.copy_(piece.tensor)

    def digest(self) -> int:
        return checksum([p.tensor for p in self.pieces.values()])

    def clear(self) -> None:
        for piece in self.pieces.values():
            piece.tensor.zero_()

    def set_cuts(self, cuts: list[tuple[Any, ...]]) -> None:
        """Where the baselines' whole tensors go: (trainer, source, src slices, target, dst slices)."""
        self._cuts = cuts

    # gather on trainer 0, push whole
    def gather_push(self, order: list[tuple[str, tuple[int, ...]]], trainer: int | None) -> None:
        push = tw.collective.get_group("tw-bench-push") if trainer in (None, 0) else None
        by_source: dict[str, list[tuple[Any, ...]]] = {}
        for cut in self._cuts:
            by_source.setdefault(cut[1], []).append(cut)
        for name, shape in order:
            if trainer is not None:
                gather = tw.collective.get_group("tw-bench-gather")
                mine = self.pieces[name].tensor
                parts = [torch.empty_like(mine) for _ in range(TRAINERS)]
                gather.all_gather(parts, mine)
                if push is not None:
                    push.broadcast(torch.cat(parts), 0)
                continue
            full = self._pool.get(shape)
            if full is None:
                full = self._pool[shape] = torch.empty(shape)  # float32, as the trainers send it
            push.broadcast(full, 0)
            for _t, _source, src, target, dst in by_source.get(name, ()):
                self.pieces[target].tensor[dst].copy_(full[src])

    # Ray's object store
    def put_shard(self) -> list[Any]:
        return ray_baselines.put({n: p.tensor for n, p in self.pieces.items()})

    def load_shards(self, boxes: list[list[Any]]) -> None:
        shards = [ray_baselines.take(box) for box in boxes]
        for trainer, source, src, target, dst in self._cuts:
            self.pieces[target].tensor[dst].copy_(shards[trainer][source][src])


class Bench:
    """The actors, groups and syncs of one run, and its methods (call :meth:`close`)."""

    def __init__(
        self, nbytes: int, *, bucket_bytes: int = 64 << 20, receiver_dtype: torch.dtype = RECEIVER_DTYPE
    ) -> None:
        self.model = shapes(nbytes)
        self.coords = [(r, t) for r in range(REPLICAS) for t in range(TP)]
        self.trainers = [ShardedRank.remote(trainer_entries(r, self.model), seed=r + 1) for r in range(TRAINERS)]
        self.replicas = [ShardedRank.remote(trainer_entries(r, self.model), seed=r + 1) for r in range(TRAINERS)]
        self.receivers = [
            ShardedRank.remote(receiver_entries(c, self.model), seed=None, dtype=receiver_dtype) for c in self.coords
        ]
        rename, fuse = mapping(self.model)
        self.options = {"rename": rename, "fuse": fuse, "bucket_bytes": bucket_bytes, "progress": False}
        self.syncs = {mode: self.make_sync(mode) for mode in (DEFAULT, EACH, NO_ASIDE)}
        self.sync = self.syncs[DEFAULT]
        tw.collective.create_group(self.trainers, backend="gloo", name="tw-bench-gather")
        tw.collective.create_group([self.trainers[0], *self.receivers], backend="gloo", name="tw-bench-push")
        self._object_cuts = self._cuts(self.sync.plan)
        layouts = self.sync.receiver_layouts
        whole = plan_sync(
            [self._whole_layout()], [layouts[i] for i in range(len(self.receivers))], self.sync.plan.mapping
        )
        self._whole_cuts = self._cuts(whole)
        self.one_pass = OnePass(self.model, self.coords, receiver_dtype)
        self.one_pass.cuts = self._object_cuts
        self.expected: list[int] = []  # the receivers' digests the one pass gives this round
        self.receiver_nbytes = [sum(p.nbytes for p in layouts[i]) for i in range(len(self.receivers))]
        self.last_report: Any = None  # the last tensorwire push's report (its timeline)
        self.step(0)

    def make_sync(self, mode: str) -> tw.WeightSync:
        """A new sync of ``mode`` (its rehearsal included): ``aside='none'`` over both pairs of
        trainer halves (every byte held twice), the others over the first pair."""
        if mode == NO_ASIDE:
            trainers = [*self.trainers, *self.replicas]
            return tw.WeightSync(trainers, self.receivers, aside="none", name="bench-none", **self.options)
        commit = "each" if mode == EACH else "all"
        return tw.WeightSync(self.trainers, self.receivers, commit=commit, name=f"bench-{commit}", **self.options)

    def step(self, seed: int) -> None:
        """Round ``seed``: new values in every trainer, and the digests the one pass gives from
        them (computed here, independently of every method)."""
        _gather(
            [t.step.remote(trainer_entries(r, self.model), seed + r + 1) for r, t in enumerate(self.trainers)]
            + [t.step.remote(trainer_entries(r, self.model), seed + r + 1) for r, t in enumerate(self.replicas)]
        )
        self.one_pass.step(seed)
        self.one_pass.clear()
        self.one_pass.run()
        self.expected = self.one_pass.digests()

    def _whole_layout(self) -> list[Any]:
        from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece

        return [ParamPiece(n, s, "float32", Box.full(s)) for n, s in self.model.items()]

    @staticmethod
    def _cuts(plan: Any) -> dict[int, list[tuple[Any, ...]]]:
        return {
            r: [(t.trainer, t.source, t.src.slices(), t.target, t.dst.slices()) for t in ts]
            for r, ts in plan.receivers.items()
        }

    def pair_nbytes(self) -> dict[str, dict[tuple[int, int], int]]:
        """Bytes each (trainer, receiver) pair moves per round, per method (the gather's
        trainer-to-trainer bytes under receiver -1)."""
        full = sum(torch.Size(s).numel() * 4 for s in self.model.values())
        n = len(self.receivers)
        plans = {mode: sync.plan.pair_nbytes() for mode, sync in self.syncs.items()}
        return {
            **plans,
            **{mode + FIRST: pairs for mode, pairs in plans.items()},
            "gather on trainer 0, push whole": {
                **{(0, r): full for r in range(n)},
                (1, -1): full // 2,
                (0, -1): full // 2,
            },
            "Ray object store": {(t, r): full // TRAINERS for t in range(TRAINERS) for r in range(n)},
            ONE_PASS: {},  # in one process: nothing moves between processes
        }

    def methods(self) -> dict[str, tuple[Callable[[], None], bool]]:
        order = list(self.model.items())

        def push(sync: tw.WeightSync) -> None:
            report = sync.push()
            if not report.ok:
                raise RuntimeError(f"weight sync failed: {report.failed}")
            self.last_report = report

        def gather() -> None:
            _gather(
                [t.gather_push.remote(order, i) for i, t in enumerate(self.trainers)]
                + [r.gather_push.remote(order, None) for r in self.receivers]
            )

        def store() -> None:
            boxes = _gather([t.put_shard.remote() for t in self.trainers])
            _gather([r.load_shards.remote(boxes) for r in self.receivers])

        tensorwire = {mode: (lambda sync=sync: push(sync), False) for mode, sync in self.syncs.items()}
        return {
            **tensorwire,
            "gather on trainer 0, push whole": (gather, True),
            "Ray object store": (store, True),
            ONE_PASS: (self.one_pass.run, True),
        }

    def prepare(self, method: str) -> None:
        if method == ONE_PASS:
            self.one_pass.clear()
            return
        cuts = self._whole_cuts if method.startswith("gather") else self._object_cuts
        _gather([r.set_cuts.remote(cuts[i]) for i, r in enumerate(self.receivers)])
        _gather([r.clear.remote() for r in self.receivers])

    def wrong_nbytes(self, method: str) -> int:
        """Bytes of the receivers (or the one pass's targets) that hold anything but what the
        one pass gives from this round's trainer values."""
        got = self.one_pass.digests() if method == ONE_PASS else _gather([r.digest.remote() for r in self.receivers])
        return sum(n for n, a, b in zip(self.receiver_nbytes, got, self.expected, strict=True) if a != b)

    def first_push(self, mode: str) -> float:
        """Seconds of the first push of a sync of ``mode`` made anew (not its making)."""
        self.prepare(mode)
        sync = self.make_sync(mode)
        try:
            start = time.perf_counter()
            report = sync.push()
            elapsed = time.perf_counter() - start
        finally:
            sync.close()
        if not report.ok:
            raise RuntimeError(f"weight sync failed: {report.failed}")
        return elapsed

    def close(self) -> None:
        for sync in self.syncs.values():
            sync.close()
        for name in ("tw-bench-gather", "tw-bench-push"):
            tw.collective.destroy_group(name)


def measure(
    bench: Bench, rounds: int, log: Callable[[str], None] = lambda _s: None
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds per round of each method (round 0 warms up, not kept), orders rotated, the
    trainers' values new each round; and each method's wrong bytes over the kept rounds."""
    methods = bench.methods()
    names = list(methods)
    samples: dict[str, list[float]] = {n: [] for n in [*names, *(m + FIRST for m in bench.syncs)]}
    wrong = dict.fromkeys(samples, 0)
    for index in range(rounds + 1):
        bench.step(1000 * index)
        for name in names[index % len(names) :] + names[: index % len(names)]:
            bench.prepare(name)
            start = time.perf_counter()
            methods[name][0]()
            elapsed = time.perf_counter() - start
            if index:
                samples[name].append(elapsed)
                wrong[name] += bench.wrong_nbytes(name)
            log(f"round {index} {name}: {elapsed:.3f} s")
        for mode in bench.syncs if index else ():
            elapsed = bench.first_push(mode)
            samples[mode + FIRST].append(elapsed)
            wrong[mode + FIRST] += bench.wrong_nbytes(mode)
            log(f"round {index} {mode}{FIRST}: {elapsed:.3f} s")
    return samples, wrong


def run(options: Any, progress: Any, notes: list[str]) -> list[Any]:
    """``tensorwire bench`` scenario ``sharded-sync``: a model of ``--max-bytes``."""
    from tensorwire.bench.schema import make_row

    started = not calls.is_initialized()
    # a local instance of its own (its own CPU count), even when another cluster runs on this machine
    tw.init(address="local", include_dashboard=False, num_cpus=8)
    rows = []
    try:
        bench = Bench(options.max_bytes)
        try:
            progress.total += len(bench.methods()) + len(bench.syncs)  # a step per row, added once known
            plan_bytes = bench.sync.plan.nbytes
            samples, wrong = measure(bench, max(1, min(options.iterations, 5)))
            for method, times in samples.items():
                ours = method.startswith("tensorwire")
                result = {"times": times, "wrong": wrong[method] if options.check else -1}
                reason = "2 fp32 trainer halves -> 2 bf16 replicas x TP 2"
                rows.append(
                    make_row(
                        "sharded-sync",
                        method,
                        result,
                        baseline=not ours,
                        nbytes=plan_bytes,
                        tensors=len(bench.model),
                        peers=len(bench.receivers),
                        rate=plan_bytes / statistics.median(times) / 1e9,
                        transport="auto" if ours else "",
                        reason=reason + (" (4 trainers: each half twice)" if method.startswith(NO_ASIDE) else ""),
                    )
                )
                progress.step(f"sharded-sync {method}")
            notes.append(f"sharded-sync: {len(bench.model)} tensors; GB/s counts the plan's bytes ({plan_bytes} B)")
            if options.timeline and bench.last_report is not None:
                bench.last_report.plot(options.timeline)
        finally:
            bench.close()
    finally:
        if started:
            calls.shutdown()
    return rows
