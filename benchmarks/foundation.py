"""Foundation measurements: shm vs single-thread memcpy, and the small put->get round trip.

Run: ``python -m benchmarks.foundation`` (prints a table and the machine it ran on; ``--mib``
and ``--repeats`` for a quick look). Every timed transfer and copy is checked: the producer's
value is a byte pattern, each receive buffer is zeroed before its timed call (untimed) and
compared with the pattern after it; each small round trip is checked in the consumer. Any
wrong result makes the script exit 1.

Per repeat the four timed methods run one after the other (shm into a reused buffer, shm into
fresh memory, copy into a reused buffer, copy into fresh memory), so they are interleaved.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time

import torch

import tensorwire as tw
from tensorwire.bench.ops import pattern
from tensorwire.bench.schema import machine
from tests.helpers.procs import Worker

MIB = 1 << 20


def bench_consumer(ref: tw.Ref, nbytes: int, repeats: int) -> dict[str, object]:
    """Runs in the consumer: shm get into a reused buffer and into fresh memory, vs torch memcpy;
    {"gbps": {method: GB/s}, "wrong": {method: rounds that delivered wrong data}}."""
    torch.set_num_threads(1)
    expected = pattern(nbytes)
    out = torch.empty(nbytes, dtype=torch.uint8)
    src = expected.clone()
    results: dict[str, list[float]] = {"shm_out": [], "shm_fresh": [], "memcpy_out": [], "memcpy_fresh": []}
    wrong = dict.fromkeys(results, 0)
    tw.get(ref, out=out)  # warm up: map once, fault the buffer in

    def timed(key: str, fn) -> None:
        out.zero_()
        start = time.perf_counter()
        value = fn()
        results[key].append(time.perf_counter() - start)
        if not torch.equal(value, expected):
            wrong[key] += 1

    for _ in range(repeats):
        timed("shm_out", lambda: tw.get(ref, out=out, transport="shm"))
        timed("shm_fresh", lambda: tw.get(ref, transport="shm"))
        timed("memcpy_out", lambda: out.copy_(src))
        timed("memcpy_fresh", lambda: torch.empty(nbytes, dtype=torch.uint8).copy_(src))
    return {"gbps": {k: nbytes / statistics.median(v) / 1e9 for k, v in results.items()}, "wrong": wrong}


def small_get(ref: tw.Ref, seed: int) -> tuple[float, bool]:
    """Time one get; whether it delivered the pattern of ``seed`` (checked after the timing)."""
    start = time.perf_counter()
    value = tw.get(ref)
    elapsed = time.perf_counter() - start
    return elapsed, bool(torch.equal(value, pattern(value.numel(), seed)))


def echo(blob: bytes) -> bytes:
    return blob


def describe_machine() -> str:
    facts = machine()
    return f"{facts['cores']} cores, {facts['cpu']}, {facts['memory_bytes'] / 2**30:.0f} GiB, {sys.platform}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.foundation")
    parser.add_argument("--mib", type=int, default=256, help="size of the large value (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the large transfers (default 5)")
    parser.add_argument("--small-repeats", type=int, default=300, help="4 KiB round trips (default 300)")
    args = parser.parse_args(argv)
    nbytes = args.mib * MIB
    wrong: dict[str, int] = {}
    worker = Worker(env={"OMP_NUM_THREADS": "1"})
    try:
        value = pattern(nbytes)
        exports = []
        for _ in range(4):  # each new object is packed into a new segment on its first pickle
            ref = tw.put(value)
            start = time.perf_counter()
            pickle.dumps(ref)
            exports.append(time.perf_counter() - start)
        export_s = statistics.median(exports)
        result = worker.call("benchmarks.foundation:bench_consumer", ref, nbytes, args.repeats, timeout_s=600)
        gbps = result["gbps"]
        wrong.update({k: v for k, v in result["wrong"].items() if v})
        print(f"measured on: {describe_machine()}")
        print(f"{args.mib} MiB, consumer process, 1 torch thread:")
        print(f"  producer export (pack into a new segment, once per object): {nbytes / export_s / 1e9:6.2f} GB/s")
        for key, label in [
            ("shm_out", "shm get into out= (reused buffer)"),
            ("memcpy_out", "torch copy_ into reused buffer"),
            ("shm_fresh", "shm get into fresh memory"),
            ("memcpy_fresh", "torch copy_ into fresh memory"),
        ]:
            print(f"  {label:40s} {gbps[key]:6.2f} GB/s  (#wrong {result['wrong'][key]})")
        print(
            f"  ratio shm/memcpy reused: {gbps['shm_out'] / gbps['memcpy_out']:.2f}x, "
            f"fresh: {gbps['shm_fresh'] / gbps['memcpy_fresh']:.2f}x"
        )

        puts, gets, trips, pipes, small_wrong = [], [], [], [], 0
        for i in range(args.small_repeats):
            seed = i % 251
            small = pattern(4096, seed)
            start = time.perf_counter()
            r = tw.put(small)
            blob = pickle.dumps(r)
            puts.append(time.perf_counter() - start)
            start = time.perf_counter()
            seconds, ok = worker.call("benchmarks.foundation:small_get", pickle.loads(blob), seed)
            trips.append(time.perf_counter() - start)
            gets.append(seconds)
            small_wrong += not ok
            start = time.perf_counter()
            worker.call("benchmarks.foundation:echo", blob)
            pipes.append(time.perf_counter() - start)
        if small_wrong:
            wrong["small get"] = small_wrong
        us = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
        print(f"4 KiB value (inline), {args.small_repeats} round trips, #wrong {small_wrong}:")
        print(f"  put + pickle in producer: {us(puts):7.1f} us")
        print(f"  get in consumer:          {us(gets):7.1f} us")
        print(f"  send ref + get + reply:   {us(trips):7.1f} us (same call with a bare pipe echo: {us(pipes):.1f} us)")
    finally:
        worker.close()
    if wrong:
        print(f"FAILED: wrong data delivered: {wrong}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
