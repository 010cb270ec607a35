"""Weight publish across a changing fleet, timed: a push whose trainer dies or is stopped half-way
against a clean push, and a late joiner's catch-up from a receiver replica against one from the
trainers.

Two trainer replicas (each the whole model, as data-parallel replicas are) push into N
receivers (all-or-none, the default). *Killed at 50 %*: trainer 1 is killed (SIGKILL) once it
offered half its buckets; the push completes from trainer 0 (failover), timed from the caller
like the clean one (the median of three pushes after two warm-up pushes). *Stopped at 50 %*: the
same with ``SIGSTOP`` instead (the process is frozen, its control service too: a debugger, a
swapped-out host), on a sync of its own; resumed and killed after the push. *Killed at 50 %, one
more dead since the last push*: three trainer replicas; trainer 2 is killed between two pushes,
trainer 1 at 50 % of the next one, which completes from trainer 0. *Catch-up*:
``add_receiver`` of one more receiver, once with the replicas in the sync (copied from one of
them) and once with none left (pushed from the trainers), timed once the newcomer's actor is
up. Every push and catch-up is checked against the trainer's checksum.

Run: ``python -m benchmarks.fleet`` (256 MiB, 3 receivers, 3 rounds: a few minutes on 2 cores);
``--mib 32`` for a quick look; ``--aside none`` for all-or-none written in place (no shadow).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
import torch

import tensorwire as tw

MIB = 1 << 20
TENSORS = 64


@tw.remote(num_cpus=0)
class Rank:
    """A trainer (seeded weights: every replica the same) or a receiver (zeros)."""

    def __init__(self, nbytes: int, seed: int | None) -> None:
        gen = torch.Generator().manual_seed(seed or 0)
        per = nbytes // TENSORS // 4
        make = (lambda: torch.randn(per, generator=gen)) if seed is not None else (lambda: torch.zeros(per))
        self.weights = {f"w{i}": make() for i in range(TENSORS)}

    def checksum(self) -> float:
        return float(sum(t.double().sum().item() for t in self.weights.values()))

    def pid(self) -> int:
        return os.getpid()

    def die_after_bucket(self, k: int, sig: int = signal.SIGKILL) -> None:
        def hook(role: str, at: int) -> None:
            if role == "trainer" and at == k:
                os.kill(os.getpid(), sig)

        tw.collective.set_fault_point(hook)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def check(receivers: list, expected: float, what: str) -> None:
    got = ray.get([r.checksum.remote() for r in receivers])
    if any(abs(g - expected) > 1e-6 * max(1.0, abs(expected)) for g in got):
        raise SystemExit(f"{what}: a receiver holds other bytes than the trainer")


def broken_push(nbytes: int, readers: list, bucket: int, aside: str, *, stop: bool, dead_before: bool) -> float:
    """Seconds of a push whose trainer 1 is killed (or stopped: ``stop``) after half its buckets,
    on a sync of its own over the same receivers (``dead_before``: three trainers, trainer 2
    killed between the last push and this one)."""
    trainers = [Rank.remote(nbytes, seed=1) for _ in range(3 if dead_before else 2)]
    name = f"fleet-{'stop' if stop else 'dead'}-{time.monotonic_ns()}"
    sync = tw.WeightSync(
        trainers, readers, source="weights", bucket_bytes=bucket, progress=False, aside=aside, name=name
    )
    pid = ray.get(trainers[1].pid.remote())
    try:
        sync.push()
        report = sync.push()
        levels = 1 + max(s.bucket for s in report.timeline if s.source == "trainer 1")
        how = signal.SIGSTOP if stop else signal.SIGKILL
        ray.get(trainers[1].die_after_bucket.remote(max(0, levels // 2 - 1), how))
        if dead_before:
            ray.kill(trainers[2].ray_handle)
            time.sleep(1.0)  # its process gone, as between two training steps
        took = timed(sync.push)
        check(readers, ray.get(trainers[0].checksum.remote()), "push with a trainer stopped" if stop else "killed")
        return took
    finally:
        if stop:
            os.kill(pid, signal.SIGCONT)
        sync.close()
        for actor in trainers:
            ray.kill(actor.ray_handle)


def one_round(nbytes: int, receivers: int, bucket: int, aside: str) -> dict[str, float]:
    trainers = [Rank.remote(nbytes, seed=1) for _ in range(2)]
    readers = [Rank.remote(nbytes, seed=None) for _ in range(receivers)]
    sync = tw.WeightSync(trainers, readers, source="weights", bucket_bytes=bucket, progress=False, aside=aside)
    expected = ray.get(trainers[0].checksum.remote())
    try:
        for _ in range(2):
            sync.push()  # warm-up (registrations, mappings, shadows)
        cleans = []
        for _ in range(3):
            start = time.perf_counter()
            report = sync.push()
            cleans.append(time.perf_counter() - start)
        clean = statistics.median(cleans)
        check(readers, expected, "clean push")
        levels = 1 + max(s.bucket for s in report.timeline if s.source == "trainer 1")
        ray.get(trainers[1].die_after_bucket.remote(max(0, levels // 2 - 1)))  # after half its buckets
        killed = timed(sync.push)
        check(readers, expected, "push with a trainer killed")
        stopped = broken_push(nbytes, readers, bucket, aside, stop=True, dead_before=False)
        two_lost = broken_push(nbytes, readers, bucket, aside, stop=False, dead_before=True)
        joiner = Rank.remote(nbytes, seed=None)
        ray.get(joiner.checksum.remote())  # started (a Ray worker's start-up is not the catch-up)
        from_replica = timed(lambda: sync.add_receiver(joiner))
        check([joiner], expected, "catch-up from a replica")
        for rid in list(sync.receiver_ids):
            sync.remove_receiver(rid)
        late = Rank.remote(nbytes, seed=None)
        ray.get(late.checksum.remote())
        from_trainers = timed(lambda: sync.add_receiver(late))
        check([late], expected, "catch-up from the trainers")
        aside_mib = report.aside_nbytes / MIB
        return {
            "clean": clean,
            "killed": killed,
            "stopped": stopped,
            "two_lost": two_lost,
            "from_replica": from_replica,
            "from_trainers": from_trainers,
            "aside_mib": aside_mib,
        }
    finally:
        sync.close()
        for actor in (*trainers, *readers):
            ray.kill(actor.ray_handle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--receivers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--aside", choices=("shadow", "none"), default="shadow", help="WeightSync(aside=...)")
    args = parser.parse_args(argv)
    tw.init(address="local", include_dashboard=False, num_cpus=8)
    rounds = [one_round(args.mib * MIB, args.receivers, args.bucket_mib * MIB, args.aside) for _ in range(args.rounds)]
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"{args.mib} MiB, 2 trainer replicas -> {args.receivers} receivers, {args.bucket_mib} MiB buckets, "
        f"aside={args.aside!r} ({medians['aside_mib']:.0f} MiB aside per receiver), "
        f"median of {args.rounds} rounds (each checked):"
    )
    print(f"  clean push                     {medians['clean'] * 1e3:9.1f} ms")
    print(
        f"  trainer 1 killed at 50 %       {medians['killed'] * 1e3:9.1f} ms "
        f"({medians['killed'] / medians['clean']:.2f}x the clean push; target <= 1.3x)"
    )
    print(
        f"  trainer 1 stopped at 50 %      {medians['stopped'] * 1e3:9.1f} ms "
        f"({medians['stopped'] / medians['clean']:.2f}x; SIGSTOP, default stall detection)"
    )
    print(
        f"  killed at 50 %, one more dead  {medians['two_lost'] * 1e3:9.1f} ms "
        f"({medians['two_lost'] / medians['clean']:.2f}x; target <= 1.5x)"
    )
    print(f"  late joiner from a replica     {medians['from_replica'] * 1e3:9.1f} ms")
    print(f"  late joiner from the trainers  {medians['from_trainers'] * 1e3:9.1f} ms")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
