"""Foundation measurements: shm vs single-thread memcpy, and the small put->get round trip.

Run: ``python -m benchmarks.foundation`` (prints a table; numbers are from this machine).
"""

from __future__ import annotations

import pickle
import statistics
import sys
import time

import torch

import tensorwire as tw
from tests.helpers.procs import Worker

MIB = 1 << 20


def bench_consumer(ref: tw.Ref, nbytes: int, repeats: int) -> dict[str, float]:
    """Runs in the consumer: shm get into a reused buffer and into fresh memory, vs torch memcpy."""
    torch.set_num_threads(1)
    out = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    results: dict[str, list[float]] = {"shm_out": [], "shm_fresh": [], "memcpy_out": [], "memcpy_fresh": []}
    tw.get(ref, out=out)  # warm up: map once, fault the buffer in
    out.copy_(src)
    for _ in range(repeats):
        start = time.perf_counter()
        tw.get(ref, out=out, transport="shm")
        results["shm_out"].append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh = tw.get(ref, transport="shm")
        results["shm_fresh"].append(time.perf_counter() - start)
        del fresh
        start = time.perf_counter()
        out.copy_(src)
        results["memcpy_out"].append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh = torch.empty(nbytes, dtype=torch.uint8).copy_(src)
        results["memcpy_fresh"].append(time.perf_counter() - start)
        del fresh
    return {k: nbytes / statistics.median(v) / 1e9 for k, v in results.items()}


def small_get(ref: tw.Ref) -> float:
    start = time.perf_counter()
    tw.get(ref)
    return time.perf_counter() - start


def echo(blob: bytes) -> bytes:
    return blob


def main() -> None:
    nbytes = 256 * MIB
    worker = Worker(env={"OMP_NUM_THREADS": "1"})
    try:
        value = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        exports = []
        for _ in range(4):  # each new object is packed into a new segment on its first pickle
            ref = tw.put(value)
            start = time.perf_counter()
            pickle.dumps(ref)
            exports.append(time.perf_counter() - start)
        export_s = statistics.median(exports)
        gbps = worker.call("benchmarks.foundation:bench_consumer", ref, nbytes, 5, timeout_s=600)
        print(f"256 MiB, consumer process, 1 torch thread ({sys.platform}, 2-core VM):")
        print(f"  producer export (pack into a new segment, once per object): {nbytes / export_s / 1e9:6.2f} GB/s")
        for key, label in [
            ("shm_out", "shm get into out= (reused buffer)"),
            ("memcpy_out", "torch copy_ into reused buffer"),
            ("shm_fresh", "shm get into fresh memory"),
            ("memcpy_fresh", "torch copy_ into fresh memory"),
        ]:
            print(f"  {label:40s} {gbps[key]:6.2f} GB/s")
        print(
            f"  ratio shm/memcpy reused: {gbps['shm_out'] / gbps['memcpy_out']:.2f}x, "
            f"fresh: {gbps['shm_fresh'] / gbps['memcpy_fresh']:.2f}x"
        )

        small = torch.randint(0, 255, (4096,), dtype=torch.uint8)
        puts, gets, trips, pipes = [], [], [], []
        for _ in range(300):
            start = time.perf_counter()
            r = tw.put(small)
            blob = pickle.dumps(r)
            puts.append(time.perf_counter() - start)
            start = time.perf_counter()
            gets.append(worker.call("benchmarks.foundation:small_get", pickle.loads(blob)))
            trips.append(time.perf_counter() - start)
            start = time.perf_counter()
            worker.call("benchmarks.foundation:echo", blob)
            pipes.append(time.perf_counter() - start)
        us = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
        print("4 KiB value (inline):")
        print(f"  put + pickle in producer: {us(puts):7.1f} us")
        print(f"  get in consumer:          {us(gets):7.1f} us")
        print(f"  send ref + get + reply:   {us(trips):7.1f} us (same call with a bare pipe echo: {us(pipes):.1f} us)")
    finally:
        worker.close()


if __name__ == "__main__":
    main()
