"""Load: 4 processes exchange random values (1 B to 64 MiB, random nesting) concurrently.

Every payload is checksummed; memory, open file descriptors, owned objects and shared-memory
segments are sampled after every round. The default suite runs 45 s; the slow one runs
``TENSORWIRE_SOAK_S`` seconds (default 600): ``python -m pytest -m slow tests/reliability``.

Memory is "flat" when the second half of the run peaks no higher than the first half (after two
warm-up rounds) plus a margin: the allocators of torch, gRPC and glibc keep a few hundred MiB
of caches that fill during the first rounds (seen here: a plateau after about 5 rounds), but
nothing may grow with the traffic. The workers fix glibc's mmap threshold first
(``tests/helpers/soak.py: fix_mmap_threshold``): with glibc's moving threshold, random sizes
fragment the heap and RSS creeps up with the rounds whatever tensorwire does.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.observe import segment_count, wait_until
from tests.helpers.procs import Worker

MIB = 1 << 20


def soak(duration_s: float, *, peers: int = 4, per_round: int = 3, max_nbytes: int = 64 * MIB) -> dict:
    workers = [Worker() for _ in range(peers)]
    segments_before = segment_count()
    try:
        assert all(w.call("tests.helpers.soak:fix_mmap_threshold", 128 << 10) == 1 for w in workers)
        rounds = wrong = payloads = 0
        samples: list[list[dict]] = []
        start = time.monotonic()
        while True:
            for i, w in enumerate(workers):
                w.send("tests.helpers.soak:produce", per_round, rounds * 100 + i, max_nbytes)
            produced = [w.result(timeout_s=300) for w in workers]
            for i, w in enumerate(workers):  # each consumes what the next two produced, all at once
                items = produced[(i + 1) % peers] + produced[(i + 2) % peers]
                w.send("tests.helpers.soak:consume", items, rounds * 100 + i)
            wrong += sum(w.result(timeout_s=300) for w in workers)
            payloads += 2 * per_round * peers
            del produced, items
            rounds += 1
            samples.append([w.call("tests.helpers.soak:resources") for w in workers])
            if rounds >= 6 and time.monotonic() - start >= duration_s:
                break
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            final = [w.call("tests.helpers.soak:resources") for w in workers]
            if all(f["owned"] == 0 for f in final):
                break
            time.sleep(0.2)
        return {
            "rounds": rounds,
            "payloads": payloads,
            "wrong": wrong,
            "samples": samples,
            "final": final,
            "segments_before": segments_before,
        }
    finally:
        for w in workers:
            w.close()


def rss_halves_mib(result: dict, worker: int) -> tuple[float, float]:
    """Peak RSS of one worker in the first and second half of the rounds after warm-up."""
    rss = [round_samples[worker]["rss"] / MIB for round_samples in result["samples"][2:]]
    half = len(rss) // 2
    return max(rss[:half]), max(rss[half:])


def check(result: dict, margin_mib: float) -> None:
    assert result["wrong"] == 0, f"{result['wrong']} of {result['payloads']} payloads arrived wrong"
    first = result["samples"][1]
    for worker, after in enumerate(result["final"]):
        assert after["owned"] == 0, f"objects still owned after the soak: {after}"
        before_fds = first[worker]["fds"]
        assert after["fds"] <= before_fds + 4, f"file descriptors leaked: {before_fds} -> {after['fds']}"
        early, late = rss_halves_mib(result, worker)
        assert late <= early + margin_mib, f"worker {worker} RSS kept growing: peak {early:.0f} -> {late:.0f} MiB"
    assert wait_until(lambda: segment_count() <= result["segments_before"]), "shared-memory segments left behind"


def report(result: dict) -> None:
    print(f"soak: {result['rounds']} rounds, {result['payloads']} payloads, {result['wrong']} wrong")
    for worker in range(len(result["final"])):
        early, late = rss_halves_mib(result, worker)
        print(f"  worker {worker}: peak RSS {early:.0f} MiB (first half) -> {late:.0f} MiB (second half)")


def test_soak_short():
    result = soak(45)
    report(result)
    check(result, margin_mib=128)


@pytest.mark.slow
def test_soak_long():
    result = soak(float(os.environ.get("TENSORWIRE_SOAK_S", "600")))
    report(result)
    check(result, margin_mib=64)
