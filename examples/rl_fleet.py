"""A weight publish across a changing fleet: failover, a late joiner, versions rollouts can trust.

* Training: 2 data-parallel trainer replicas of 2 FSDP ranks each (4 actors); rank r of each
  replica holds rows r of every parameter (``Sharded``: ``Replicate`` over replicas, ``Shard(0)``
  over ranks), and both replicas apply the same update, as data parallelism does after its
  all-reduce.
* Inference: 3 replicas of 2 tensor-parallel ranks (6 actors; column-parallel: each rank holds
  half the rows). Each rollout reads the weights under the receiver's fence and is tagged with
  the version it used (``tw.collective.weight_version()``).
* Push 1 is clean. During push 2 one trainer rank is killed (at a named point of the push,
  after its second bucket): the push completes from that rank's replica (``report.replaced``).
  Then a fourth inference replica joins and catches up to the committed version from one of
  its peers before ``add_receiver`` returns. Push 3 reaches all four replicas, all or none.
* After every push each inference replica's weights are compared with the trainers' model.

Run: ``python examples/rl_fleet.py`` (CPU, no downloads; well under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import ray
import torch

import tensorwire as tw
from tensorwire.collectives import Replicate, Shard, Sharded

SHAPES = {f"layer{i}.weight": (256, 128) for i in range(4)} | {"head.weight": (64, 128)}
DP, FSDP = 2, 2  # trainer replicas x ranks
TP = 2  # ranks per inference replica


def full_model(step: int) -> dict[str, torch.Tensor]:
    """The model after ``step`` updates (every trainer replica computes the same one)."""
    gen = torch.Generator().manual_seed(0)
    model = {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}
    for s in range(1, step + 1):
        update = torch.Generator().manual_seed(s)
        for tensor in model.values():
            tensor.add_(torch.randn(tensor.shape, generator=update), alpha=0.01)
    return model


@tw.remote(num_cpus=0)
class TrainerRank:
    """Rank ``rank`` of trainer replica ``replica``: rows ``rank`` of every parameter."""

    def __init__(self, replica: int, rank: int) -> None:
        self.replica, self.rank, self.step_count = replica, rank, 0
        self.rows = {n: t.chunk(FSDP)[rank].clone() for n, t in full_model(0).items()}

    def state_dict(self) -> dict[str, Sharded]:
        return {
            n: Sharded.of(t, [Replicate(), Shard(0)], (DP, FSDP), (self.replica, self.rank), SHAPES[n])
            for n, t in self.rows.items()
        }

    def step(self) -> None:
        self.step_count += 1
        model = full_model(self.step_count)
        for name, rows in self.rows.items():
            rows.copy_(model[name].chunk(FSDP)[self.rank])

    def die_after_bucket(self, k: int) -> None:
        """Be killed (SIGKILL) once this rank has offered bucket ``k`` of the next push."""

        def hook(role: str, at: int) -> None:
            if role == "trainer" and at == k:
                os.kill(os.getpid(), signal.SIGKILL)

        tw.collective.set_fault_point(hook)


@tw.remote(num_cpus=0)
class InferenceRank:
    """Rank ``rank`` of an inference replica: half the rows of every parameter."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.rows = {n: torch.zeros(s[0] // TP, s[1]) for n, s in SHAPES.items()}

    def state_dict(self) -> dict[str, Sharded]:
        return {n: Sharded.of(t, [Shard(0)], (TP,), (self.rank,), SHAPES[n]) for n, t in self.rows.items()}

    def rollout(self, seed: int) -> tuple[int, float]:
        """A rollout: (the weight version it used, its score), read under the weights' fence."""
        x = torch.randn(128, generator=torch.Generator().manual_seed(seed))
        with tw.collective.weight_fence():
            version = tw.collective.weight_version()
            score = sum(float((w @ x).sum()) for w in self.rows.values())
        return version, score

    def weights(self) -> dict[str, torch.Tensor]:
        return self.rows


def replica_matches(ranks: list, step: int) -> bool:
    """Whether one inference replica holds the trainers' model after ``step`` updates (by value)."""
    model = full_model(step)
    pieces = ray.get([r.weights.remote() for r in ranks])
    return all(torch.equal(torch.cat([p[name] for p in pieces]), model[name]) for name in SHAPES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3, help="inference replicas at the start")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tw.init(include_dashboard=False)
    trainers = [TrainerRank.remote(d, f) for d in range(DP) for f in range(FSDP)]
    replicas = [[InferenceRank.remote(t) for t in range(TP)] for _ in range(args.replicas)]
    sync = tw.WeightSync(trainers, [r for replica in replicas for r in replica], bucket_bytes=64 << 10)
    print(f"plan: {len(trainers)} trainer ranks ({DP} replicas x {FSDP}) -> {args.replicas} replicas x TP {TP}")

    def push(steps: int) -> None:
        """Push the trainers' model after ``steps`` updates; check every inference replica."""
        report = sync.push()
        if not report.ok:
            print(f"push v{report.version}: failed: {report.failed}", file=sys.stderr)
            raise SystemExit(1)
        sources = sorted({source for source, _dst, _t in report.pairs})
        print(f"push v{report.version}: on every replica in {report.seconds * 1e3:.0f} ms from {', '.join(sources)}")
        for dead, why in report.replaced.items():
            print(f"  {dead} died mid-push ({why.rpartition(': ')[2] or 'killed'}); completed from its replica")
        bad = [i for i, replica in enumerate(replicas) if not replica_matches(replica, steps)]
        if bad:
            print(f"push v{report.version}: replica(s) {bad} differ from the trainers' model", file=sys.stderr)
            raise SystemExit(1)

    push(0)
    ray.get([t.step.remote() for t in trainers])
    ray.get(trainers[DP * FSDP - FSDP].die_after_bucket.remote(1))  # replica 1, rank 0
    push(1)
    newcomer = [InferenceRank.remote(t) for t in range(TP)]
    ids = [sync.add_receiver(rank) for rank in newcomer]
    replicas.append(newcomer)
    print(f"a new replica joined at v{sync.committed}, copied from {', '.join(sync.caught_up[i] for i in ids)}")
    if not replica_matches(newcomer, 1):
        print("the new replica does not hold the committed version", file=sys.stderr)
        return 1
    ray.get([t.step.remote() for t in sync.trainers])
    push(2)
    rollouts = ray.get([replica[0].rollout.remote(seed) for seed, replica in enumerate(replicas)])
    print("rollouts (version, score): " + ", ".join(f"(v{v}, {s:.2f})" for v, s in rollouts))
    if {v for v, _s in rollouts} != {3}:
        print("a rollout used another version than the last committed one", file=sys.stderr)
        return 1
    print(f"done: every replica at v3 = the trainers' model; versions {sync.versions()}")
    sync.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
