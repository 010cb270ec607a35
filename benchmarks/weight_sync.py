"""One trainer's state dict into N receivers' existing tensors, same run, same actors:
tensorwire ``WeightSync`` vs Ray's object store (``ray.put`` once, N gets, copy in) vs Ray's
direct transport (gloo; one ref passed to N actors, copy in) vs torch.distributed gloo
broadcast (tensor by tensor, in place), against the memcpy bound (bytes x receivers /
single-thread memcpy bandwidth, measured now both tensor by tensor and as one block).

Run: ``python -m benchmarks.weight_sync`` (1 GiB, 500 tensors, 3 receivers: a few minutes on
a 2-core VM); ``--mib 64`` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import ray
import torch

import tensorwire as tw

MIB = 1 << 20


def make_weights(tensors: int, nbytes: int, seed: int | None) -> dict[str, torch.Tensor]:
    per = max(1, nbytes // tensors // 4)
    gen = torch.Generator().manual_seed(seed or 0)
    if seed is None:
        return {f"layer{i}.weight": torch.zeros(per) for i in range(tensors)}  # faulted in, like parameters
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(tensors)}


@tw.remote(num_cpus=0)
class Node:
    """Trainer (seeded weights) or receiver (zeros) for every method under test."""

    def __init__(self, tensors: int, nbytes: int, seed: int | None) -> None:
        self.weights = make_weights(tensors, nbytes, seed)

    def checksum(self) -> float:
        return float(sum(t.double().sum().item() for t in self.weights.values()))

    def clear(self) -> None:
        for t in self.weights.values():
            t.zero_()

    # Ray's object store: one put in the trainer, a get and a copy in each receiver
    def put_state(self) -> list:
        return [ray.put(self.weights)]

    def load_from_store(self, boxed: list) -> int:
        return self._copy_in(ray.get(boxed[0]))

    # Ray's direct transport (RDT) over gloo: one reference, passed to every receiver
    @ray.method(tensor_transport="gloo")
    def state_rdt(self) -> dict[str, torch.Tensor]:
        return self.weights

    def load(self, state: dict[str, torch.Tensor]) -> int:
        return self._copy_in(state)

    # torch.distributed gloo broadcast, tensor by tensor into the weights
    def broadcast_all(self, group: str) -> int:
        g = tw.collective.get_group(group)
        for t in self.weights.values():
            g.broadcast(t, 0)
        return len(self.weights)

    def _copy_in(self, state: dict[str, torch.Tensor]) -> int:
        for name, t in self.weights.items():
            t.copy_(state[name])
        return len(state)


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """Single-thread memcpy bandwidth of one ``nbytes`` block (numpy copy between faulted-in
    buffers; glibc uses non-temporal stores at this size)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def state_memcpy_gbps(tensors: int, nbytes: int, repeats: int = 3) -> float:
    """Single-thread memcpy bandwidth of copying a state like the one synced, tensor by tensor
    into another such state (what any receiver must do at least once)."""
    src, dst = make_weights(tensors, nbytes, 1), make_weights(tensors, nbytes, None)
    pairs = [(dst[name].numpy(), src[name].numpy()) for name in src]
    total = sum(a.nbytes for a, _ in pairs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for a, b in pairs:
            np.copyto(a, b)
        times.append(time.perf_counter() - start)
    return total / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="state size in MiB")
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--receivers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    nbytes = args.mib * MIB

    tw.init(address="local", include_dashboard=False, num_cpus=4)
    from ray.experimental.collective import create_collective_group

    trainer = Node.options(enable_tensor_transport=True).remote(args.tensors, nbytes, 1)
    receivers = [
        Node.options(enable_tensor_transport=True).remote(args.tensors, nbytes, None) for _ in range(args.receivers)
    ]
    everyone = [trainer, *receivers]
    create_collective_group([a.ray_handle for a in everyone], backend="torch_gloo")  # for RDT
    tw.collective.create_group(everyone, backend="gloo", name="bench")  # torch.distributed gloo
    expected = ray.get(trainer.checksum.remote())
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=args.bucket_mib * MIB, progress=False)
    total = sync.nbytes

    def tensorwire() -> None:
        report = sync.push()
        assert report.ok, report.failed

    def object_store() -> None:
        boxed = ray.get(trainer.put_state.remote())
        ray.get([r.load_from_store.remote(boxed) for r in receivers])
        del boxed

    def ray_rdt_gloo() -> None:
        ref = trainer.state_rdt.remote()
        ray.get([r.load.remote(ref) for r in receivers])
        del ref

    def torch_gloo_broadcast() -> None:
        ray.get([a.broadcast_all.remote("bench") for a in everyone])

    methods = {
        "tensorwire WeightSync": tensorwire,
        "Ray object store": object_store,
        "Ray RDT (gloo)": ray_rdt_gloo,
        "torch.distributed gloo broadcast": torch_gloo_broadcast,
    }
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for round_index in range(args.repeats + 1):  # round 0 warms up
        names = list(methods)
        names = names[round_index % len(names) :] + names[: round_index % len(names)]  # rotate against noise
        for name in names:
            ray.get([r.clear.remote() for r in receivers])
            start = time.perf_counter()
            methods[name]()
            elapsed = time.perf_counter() - start
            got = ray.get([r.checksum.remote() for r in receivers])
            if any(abs(g - expected) > 1e-6 * max(1.0, abs(expected)) for g in got):
                print(f"{name}: WRONG DATA ({got} vs {expected})", file=sys.stderr)
                return 1
            if round_index:
                samples[name].append(elapsed)
            print(f"  round {round_index} {name}: {elapsed:.3f} s", file=sys.stderr, flush=True)

    block_gbps = memcpy_gbps(min(nbytes, 1 << 30))
    state_gbps = state_memcpy_gbps(args.tensors, nbytes)
    block_bound = total * args.receivers / (block_gbps * 1e9)
    state_bound = total * args.receivers / (state_gbps * 1e9)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    ours = medians["tensorwire WeightSync"]
    best_other = min(t for name, t in medians.items() if name != "tensorwire WeightSync")
    print(
        f"\nstate {total / MIB:.0f} MiB in {args.tensors} tensors -> {args.receivers} receivers, median of "
        f"{args.repeats}; single-thread memcpy: {state_gbps:.2f} GB/s tensor by tensor (bound "
        f"{state_bound:.3f} s), {block_gbps:.2f} GB/s as one block (bound {block_bound:.3f} s)"
    )
    print(f"{'method':>34} {'seconds':>8} {'GB/s':>6} {'x bound':>8} {'x block bound':>14} {'vs tensorwire':>14}")
    for name, seconds in medians.items():
        rate = total * args.receivers / seconds / 1e9
        print(
            f"{name:>34} {seconds:8.3f} {rate:6.2f} {seconds / state_bound:8.2f} {seconds / block_bound:14.2f} "
            f"{seconds / ours:13.2f}x"
        )
    print(
        f"tensorwire: {best_other / ours:.2f}x faster than the best alternative; {ours / state_bound:.2f}x the "
        f"tensor-by-tensor memcpy bound, {ours / block_bound:.2f}x the one-block bound"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "nbytes": total,
                    "tensors": args.tensors,
                    "receivers": args.receivers,
                    "memcpy_state_gbps": state_gbps,
                    "memcpy_block_gbps": block_gbps,
                    "samples_s": samples,
                },
                f,
                indent=1,
            )
    sync.close()
    tw.collective.destroy_group("bench")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
