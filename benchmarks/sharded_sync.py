"""Sharded weight sync, same run, same actors: 2 trainer halves -> 2 replicas x TP 2 (4
receivers) with fused qkv / gate_up, row-parallel o / down: tensorwire ``WeightSync`` (the
plan) vs gathering on trainer 0 and pushing the whole state to every receiver (what most RL
frameworks do) vs Ray's object store (each trainer puts its shard, every receiver gets both);
bytes moved per pair against the plan's minimum, time, GB/s of the plan's bytes, and the memcpy
bound (the plan's bytes / single-thread memcpy bandwidth). See :mod:`tensorwire.bench.sharded`.

Run: ``python -m benchmarks.sharded_sync`` (1 GiB model: a few minutes on a 2-core VM);
``--mib 128`` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray

import tensorwire as tw
from benchmarks.weight_sync import memcpy_gbps
from tensorwire.bench.sharded import DEFAULT, EACH, FIRST, Bench, measure

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="model size in MiB (float32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    tw.init(address="local", include_dashboard=False, num_cpus=8)
    bench = Bench(args.mib * MIB, bucket_bytes=args.bucket_mib * MIB)
    try:
        print(bench.sync.plan, flush=True)
        samples, wrong = measure(bench, args.repeats, log=lambda line: print("  " + line, file=sys.stderr, flush=True))
    finally:
        bench.close()
    plan = bench.sync.plan
    plan_bytes = plan.nbytes
    pairs = bench.pair_nbytes()
    memcpy = memcpy_gbps(min(plan_bytes, 1 << 30))
    bound = plan_bytes / (memcpy * 1e9)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    ours = medians["tensorwire WeightSync"]
    model = sum(4 * math.prod(shape) for shape in bench.model.values())
    print(
        f"\nmodel {model / MIB:.0f} MiB in {len(bench.model)} tensors, 2 trainers -> 4 receivers; plan: "
        f"{plan_bytes / MIB:.0f} MiB per push ({plan_bytes / MIB / 4:.0f} MiB per receiver); single-thread memcpy "
        f"{memcpy:.2f} GB/s -> bound {bound:.3f} s; median of {args.repeats}"
    )
    header = ("method", "seconds", "GB/s", "moved MiB", "x plan", "x bound", "vs tensorwire")
    header = (*header, "#wrong")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (52, 8, 6, 10, 7, 8, 14, 8), strict=True)))
    for name, seconds in medians.items():
        moved = sum(n for (t, r), n in pairs[name].items())
        spread = f"[{min(samples[name]):.3f}-{max(samples[name]):.3f}]"
        print(
            f"{name:>52} {seconds:8.3f} {plan_bytes / seconds / 1e9:6.2f} {moved / MIB:10.0f} "
            f"{moved / plan_bytes:7.2f} {seconds / bound:8.2f} {seconds / ours:13.2f}x {wrong[name]:8d} {spread}"
        )
    print("bytes per (trainer, receiver) pair, MiB (receiver -1: trainer to trainer):")
    for name, table in pairs.items():
        print(f"  {name}: " + ", ".join(f"{k}: {v / MIB:.0f}" for k, v in sorted(table.items())))
    gather = medians["gather on trainer 0, push whole"]
    each, first = medians[EACH], medians[DEFAULT + FIRST]
    print(
        f"default (all-or-none): {ours / each:.2f}x commit='each'; first push {first / ours:.2f}x a later push; "
        f"{ours / (plan_bytes / (memcpy * 1e9)):.2f}x one memcpy of the plan's bytes"
    )
    print(
        f"tensorwire: {gather / ours:.2f}x the gather-then-push baseline, {medians['Ray object store'] / ours:.2f}x "
        f"Ray's object store; {ours / bound:.2f}x the memcpy bound for the plan's bytes"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "plan_nbytes": plan_bytes,
                    "memcpy_gbps": memcpy,
                    "samples_s": samples,
                    "wrong_nbytes": wrong,
                    "pairs": {m: {f"{t}->{r}": n for (t, r), n in p.items()} for m, p in pairs.items()},
                },
                f,
                indent=1,
            )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
