"""Actor to actor, end to end, same run: tensorwire vs Ray's direct transport (gloo) vs Ray's
object store. Each producer holds its value ready; a round is "call the producer, pass its
result to the consumer, consumer has the tensors". Also a plain two-call chain carrying
nothing, as the latency floor.

Run: ``python -m benchmarks.ray_compare`` (about a minute on a 2-core VM).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
import torch

import tensorwire as tw

MIB = 1 << 20


def make_value(kind: str, nbytes: int):
    if kind == "tensor":
        return torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    per = nbytes // 1024 // 4
    return {f"p{i}": torch.randn(per) for i in range(1024)}


def nbytes_of(value) -> int:
    if isinstance(value, dict):
        return sum(t.numel() * t.element_size() for t in value.values())
    return 0 if value is None else value.numel() * value.element_size()


@tw.remote(num_cpus=0)
class TwProducer:
    def __init__(self) -> None:
        self.value = None

    def set(self, kind: str, nbytes: int) -> None:
        self.value = make_value(kind, nbytes)

    @tw.method
    def value_ref(self):
        return self.value


@tw.remote(num_cpus=0)
class TwConsumer:
    def take(self, value) -> int:
        return nbytes_of(value)


@ray.remote(num_cpus=0)
class RayProducer:
    def __init__(self) -> None:
        self.value = None

    def set(self, kind: str, nbytes: int) -> None:
        self.value = make_value(kind, nbytes)

    def value_plain(self):
        return self.value

    @ray.method(tensor_transport="gloo")
    def value_rdt(self):
        return self.value

    def nothing(self):
        return None


@ray.remote(num_cpus=0, enable_tensor_transport=True)  # receives RDT objects (ray issue #66264)
class RayConsumer:
    def take(self, value) -> int:
        return nbytes_of(value)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    tw.init(include_dashboard=False, num_cpus=4)
    from ray.experimental.collective import create_collective_group

    twp, twc = TwProducer.remote(), TwConsumer.remote()
    rp, rc = RayProducer.remote(), RayConsumer.remote()
    create_collective_group([rp, rc], backend="torch_gloo")
    cases = [("tensor", 4096, 50), ("tensor", 64 * MIB, 5), ("tensor", 256 * MIB, 3), ("state_dict", 64 * MIB, 5)]
    floor = timed(lambda: ray.get(rc.take.remote(rp.nothing.remote())), 50)
    print(f"plain Ray chain carrying nothing (producer call -> consumer call): {floor * 1e3:.2f} ms")
    header = f"{'value':>24} {'tensorwire':>12} {'ray rdt gloo':>13} {'object store':>13} {'tw vs best':>11}"
    print(header)
    for kind, nbytes, repeats in cases:
        ray.get([twp.set.remote(kind, nbytes), rp.set.remote(kind, nbytes)])

        def run_tw(nbytes: int = nbytes) -> None:
            assert ray.get(twc.take.remote(twp.value_ref.remote())) == nbytes

        def run_rdt(nbytes: int = nbytes) -> None:
            assert ray.get(rc.take.remote(rp.value_rdt.remote())) == nbytes

        def run_store(nbytes: int = nbytes) -> None:
            assert ray.get(rc.take.remote(rp.value_plain.remote())) == nbytes

        t_tw, t_rdt, t_store = timed(run_tw, repeats), timed(run_rdt, repeats), timed(run_store, repeats)
        label = f"{kind} {nbytes / MIB:g} MiB" if nbytes >= MIB else f"{kind} {nbytes // 1024} KiB"
        best = min(t_rdt, t_store)
        print(f"{label:>24} {t_tw * 1e3:10.2f}ms {t_rdt * 1e3:11.2f}ms {t_store * 1e3:11.2f}ms {best / t_tw:10.2f}x")
        if nbytes == 4096:
            print(f"{'':>24} small-transfer latency: tensorwire {t_tw / floor:.2f}x the plain chain")
    ray.shutdown()


if __name__ == "__main__":
    main()
