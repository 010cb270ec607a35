"""Actor to actor, end to end, same run: tensorwire vs Ray's direct transport (gloo) vs Ray's
object store. Each producer holds its value ready; a round is "call the producer, pass its
result to the consumer, the consumer copies the tensors into its own buffers" (what loading
weights does). Also a plain two-call chain carrying nothing, as the latency floor.

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


class Sink:
    """What a consumer does with received weights: copy them into its own buffers."""

    def __init__(self) -> None:
        self.buffers = None

    def take(self, value) -> int:
        if value is None:
            return 0
        tensors = list(value.values()) if isinstance(value, dict) else [value]
        if self.buffers is None or [b.shape for b in self.buffers] != [t.shape for t in tensors]:
            self.buffers = [torch.empty_like(t) for t in tensors]
            for b in self.buffers:
                b.zero_()  # fault the buffers in once, as a model's parameters are
        for b, t in zip(self.buffers, tensors, strict=True):
            b.copy_(t)
        return nbytes_of(value)


class Source:
    """A producer holding its value ready, so that rounds time the hand-over only."""

    def __init__(self) -> None:
        self.value = None

    def set(self, kind: str, nbytes: int) -> None:
        self.value = make_value(kind, nbytes)


@tw.remote(num_cpus=0)
class TwProducer(Source):
    @tw.method
    def value_ref(self):
        return self.value


@tw.remote(num_cpus=0)
class TwConsumer(Sink):
    pass


@ray.remote(num_cpus=0)
class RayProducer(Source):
    def value_plain(self):
        return self.value

    @ray.method(tensor_transport="gloo")
    def value_rdt(self):
        return self.value

    def nothing(self):
        return None


@ray.remote(num_cpus=0, enable_tensor_transport=True)  # receives RDT objects (ray issue #66264)
class RayConsumer(Sink):
    pass


def timed(fn, repeats: int) -> float:
    return interleaved([fn], repeats)[0]


def interleaved(fns, repeats: int) -> list[float]:
    """Median seconds of each function, run in rotating order so that noise on this shared
    2-core machine falls on all of them alike."""
    for fn in fns:
        fn()  # warm-up
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            start = time.perf_counter()
            fns[i]()
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def main() -> None:
    tw.init(include_dashboard=False, num_cpus=4)
    from ray.experimental.collective import create_collective_group

    twp, twc = TwProducer.remote(), TwConsumer.remote()
    rp, rc = RayProducer.remote(), RayConsumer.remote()
    create_collective_group([rp, rc], backend="torch_gloo")
    cases = [("tensor", 4096, 200), ("tensor", 64 * MIB, 10), ("tensor", 256 * MIB, 5), ("state_dict", 64 * MIB, 10)]
    floor = timed(lambda: ray.get(rc.take.remote(rp.nothing.remote())), 200)
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

        t_tw, t_rdt, t_store = interleaved([run_tw, run_rdt, run_store], repeats)
        label = f"{kind} {nbytes / MIB:g} MiB" if nbytes >= MIB else f"{kind} {nbytes // 1024} KiB"
        best = min(t_rdt, t_store)
        print(f"{label:>24} {t_tw * 1e3:10.2f}ms {t_rdt * 1e3:11.2f}ms {t_store * 1e3:11.2f}ms {best / t_tw:10.2f}x")
        if nbytes == 4096:
            floor = timed(lambda: ray.get(rc.take.remote(rp.nothing.remote())), repeats)
            print(
                f"{'':>24} small-transfer latency: tensorwire {t_tw / floor:.2f}x the plain chain "
                f"({floor * 1e3:.2f} ms, measured again now)"
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
