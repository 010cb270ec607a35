"""Actor to actor, end to end, same run: tensorwire vs Ray's direct transport (gloo) vs Ray's
object store. Each producer holds its value ready; a round is "call the producer, pass its
result to the consumer, the consumer copies the tensors into its own buffers" (what loading
weights does). Also a plain two-call chain carrying nothing, as the latency floor.

Every timed round is checked: before it (untimed) the producers change every element of their
value (so a round that delivers an earlier round's data fails), after it (untimed) the
consumer's buffers are compared with the producer's by a strided checksum. Any wrong round
makes the script exit 1. The three methods are interleaved round by round.

Run: ``python -m benchmarks.ray_compare`` (about a minute on a 2-core VM; ``--quick`` for a
check with tiny values).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
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


def checksum(tensors) -> int:
    """A cheap strided checksum: about 64 Ki bytes of each tensor, by position."""
    total = 0
    for t in tensors:
        data = t.reshape(-1).view(torch.uint8)
        step = max(1, data.numel() // 65536)
        sample = data[::step].to(torch.int64)
        total += int((sample * (torch.arange(sample.numel()) % 251 + 1)).sum())
    return total


def _tensors(value) -> list:
    return list(value.values()) if isinstance(value, dict) else [value]


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

    def checksum(self) -> int:
        return checksum(self.buffers or [])


class Source:
    """A producer holding its value ready, so that rounds time the hand-over only."""

    def __init__(self) -> None:
        self.value = None

    def set(self, kind: str, nbytes: int) -> None:
        self.value = make_value(kind, nbytes)

    def change(self) -> int:
        """Change every element (in place); the checksum a consumer must now see."""
        for t in _tensors(self.value):
            t.add_(1)
        return checksum(_tensors(self.value))


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
    return interleaved([(None, fn, None)], repeats)[0]


def interleaved(cases, repeats: int) -> list[float]:
    """Median seconds of each case's ``run``, the cases run in rotating order so that noise on
    a shared machine falls on all of them alike. A case is ``(prepare, run, check)``:
    ``prepare()`` before each timed run and ``check(what prepare returned)`` after it, both
    untimed (None: nothing). A failed check raises ``WrongData`` at the end."""
    for _, run, _ in cases:
        run()  # warm-up
    samples: list[list[float]] = [[] for _ in cases]
    wrong = [0] * len(cases)
    for r in range(repeats):
        for k in range(len(cases)):
            i = (r + k) % len(cases)
            prepare, run, check = cases[i]
            expected = prepare() if prepare else None
            start = time.perf_counter()
            run()
            samples[i].append(time.perf_counter() - start)
            if check and not check(expected):
                wrong[i] += 1
    if any(wrong):
        raise WrongData(wrong)
    return [statistics.median(s) for s in samples]


class WrongData(Exception):
    """Rounds of a case delivered wrong data (counts per case)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray_compare")
    parser.add_argument("--quick", action="store_true", help="tiny values, three rounds (a check, not a measurement)")
    quick = parser.parse_args(argv).quick
    tw.init(address="local", include_dashboard=False, num_cpus=4)
    from ray.experimental.collective import create_collective_group

    twp, twc = TwProducer.remote(), TwConsumer.remote()
    rp, rc = RayProducer.remote(), RayConsumer.remote()
    create_collective_group([rp, rc], backend="torch_gloo")
    cases = [("tensor", 4096, 200), ("tensor", 64 * MIB, 10), ("tensor", 256 * MIB, 5), ("state_dict", 64 * MIB, 10)]
    if quick:
        cases = [("tensor", 4096, 3), ("tensor", 1 * MIB, 3), ("state_dict", 4 * MIB, 3)]
    floor = timed(lambda: ray.get(rc.take.remote(rp.nothing.remote())), 3 if quick else 200)
    print(f"plain Ray chain carrying nothing (producer call -> consumer call): {floor * 1e3:.2f} ms")
    header = f"{'value':>24} {'tensorwire':>12} {'ray rdt gloo':>13} {'object store':>13} {'tw vs best':>11}"
    print(header)
    failed = {}
    for kind, nbytes, repeats in cases:
        ray.get([twp.set.remote(kind, nbytes), rp.set.remote(kind, nbytes)])

        def case(producer, consumer, method: str, nbytes: int = nbytes):
            def run() -> None:
                assert ray.get(consumer.take.remote(getattr(producer, method).remote())) == nbytes

            return (
                lambda: ray.get(producer.change.remote()),
                run,
                lambda expected: ray.get(consumer.checksum.remote()) == expected,
            )

        label = f"{kind} {nbytes / MIB:g} MiB" if nbytes >= MIB else f"{kind} {nbytes // 1024} KiB"
        try:
            t_tw, t_rdt, t_store = interleaved(
                [case(twp, twc, "value_ref"), case(rp, rc, "value_rdt"), case(rp, rc, "value_plain")], repeats
            )
        except WrongData as e:
            failed[label] = dict(zip(("tensorwire", "ray rdt gloo", "object store"), e.args[0], strict=True))
            print(f"{label:>24} WRONG DATA (rounds per method): {failed[label]}")
            continue
        best = min(t_rdt, t_store)
        print(f"{label:>24} {t_tw * 1e3:10.2f}ms {t_rdt * 1e3:11.2f}ms {t_store * 1e3:11.2f}ms {best / t_tw:10.2f}x")
        if nbytes == 4096:
            floor = timed(lambda: ray.get(rc.take.remote(rp.nothing.remote())), repeats)
            print(
                f"{'':>24} small-transfer latency: tensorwire {t_tw / floor:.2f}x the plain chain "
                f"({floor * 1e3:.2f} ms, measured again now)"
            )
    ray.shutdown()
    if failed:
        print(f"FAILED: wrong data delivered: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
