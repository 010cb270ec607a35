"""Two-sided transports between two processes against bare programs, in one run.

For 1, 64 and 256 MiB: tensorwire ``ucx`` (UCX over TCP, and over shared memory),
``gloo``, ``host`` and ``shm`` (one-sided, for the same-node decision), against a bare
``ucxx`` tag send/recv and a bare torch.distributed gloo send/recv written here. Both
processes claim different nodes so that the same-node shortcut does not apply. Each
tensorwire row is one ``tw.get(ref, out=buffer, transport=...)`` (request + transfer);
a bare row is one receive on an already-connected pair whose sender is already sending
(their best case), timed from posting the receive to its completion.

Every timed transfer is checked: the data is a byte pattern (for the bare rows, two that
alternate, so consecutive transfers differ), the receive buffer is zeroed before each timed transfer and compared with
the pattern after it (both untimed). Any wrong transfer makes the script exit 1.

Order (not interleaved): per UCX_TLS setting (tcp, then sm) one process pair runs, per size,
bare ucxx, tensorwire ucx, then (tcp only) tensorwire gloo and host, each method's repeats in
a row; then a new pair runs bare torch gloo for every size; then a same-node pair runs shm.
Load that changes between these loops shows in the ratios: rerun before trusting a small one.

Run: ``python -m benchmarks.two_sided`` (about a minute and a half here; ``--quick`` runs
1 MiB only, three repeats).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

import tensorwire as tw
from tensorwire.bench.ops import _state, pattern, ucx_connect, ucx_start, ucx_stop  # noqa: F401 - run by name
from tensorwire.bench.schema import machine
from tests.helpers.procs import Worker

MIB = 1 << 20
SIZES = (1 * MIB, 64 * MIB, 256 * MIB)
REPEATS = {1 * MIB: 30, 64 * MIB: 8, 256 * MIB: 5}


# ---------------------------------------------------------------- tensorwire, in the consumer


def tw_get_times(ref: tw.Ref, transport: str, repeats: int) -> dict:
    """{"times": seconds per get, "wrong": gets that did not deliver the pattern}."""
    out = torch.empty(ref.nbytes, dtype=torch.uint8)
    expected = pattern(ref.nbytes)
    tw.get(ref, out=out, transport=transport)  # connect, fault the buffer in
    times, wrong = [], 0
    for _ in range(repeats):
        out.zero_()
        start = time.perf_counter()
        tw.get(ref, out=out, transport=transport)
        times.append(time.perf_counter() - start)
        wrong += not torch.equal(out, expected)
    return {"times": times, "wrong": wrong}


def put_value(nbytes: int) -> tw.Ref:
    _state.setdefault("values", []).append(pattern(nbytes))
    return tw.put(_state["values"][-1])


# ---------------------------------------------------------------- bare ucxx


def _ucx_wait(request: Any) -> None:
    while not request.completed:
        time.sleep(0)
    request.check_error()


def _patterns(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Transfer i of a bare loop carries ``_patterns(n)[i % 2]``: consecutive ones differ."""
    return pattern(nbytes, 1), pattern(nbytes, 2)


def ucx_send(nbytes: int, repeats: int) -> None:
    from ucxx._lib.arr import Array

    api, ep = _state["ucx_api"], _state["ucx_ep"]
    data = [p.numpy() for p in _patterns(nbytes)]
    for i in range(repeats + 1):
        _ucx_wait(ep.tag_send(Array(data[i % 2]), api.UCXXTag(i)))


def ucx_recv(nbytes: int, repeats: int) -> dict:
    from ucxx._lib.arr import Array

    api, ep = _state["ucx_api"], _state["ucx_ep"]
    out, expected = np.empty(nbytes, dtype=np.uint8), _patterns(nbytes)
    _ucx_wait(ep.tag_recv(Array(out), api.UCXXTag(0)))
    times, wrong = [], 0
    for i in range(1, repeats + 1):
        out[:] = 0
        start = time.perf_counter()
        _ucx_wait(ep.tag_recv(Array(out), api.UCXXTag(i)))
        times.append(time.perf_counter() - start)
        wrong += not torch.equal(torch.from_numpy(out), expected[i % 2])
    return {"times": times, "wrong": wrong}


# ---------------------------------------------------------------- bare torch.distributed gloo


def gloo_store(rank: int, port: int = 0) -> int:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    _state["store"] = store
    return store.port


def gloo_group(rank: int) -> None:
    import torch.distributed as dist

    _state["gloo"] = dist.ProcessGroupGloo(_state["store"], rank, 2, datetime.timedelta(seconds=60))


def gloo_send(nbytes: int, repeats: int) -> None:
    data = _patterns(nbytes)
    for i in range(repeats + 1):
        _state["gloo"].send([data[i % 2]], 1, i).wait()


def gloo_recv(nbytes: int, repeats: int) -> dict:
    out, expected = torch.empty(nbytes, dtype=torch.uint8), _patterns(nbytes)
    _state["gloo"].recv([out], 0, 0).wait()
    times, wrong = [], 0
    for i in range(1, repeats + 1):
        out.zero_()
        start = time.perf_counter()
        _state["gloo"].recv([out], 0, i).wait()
        times.append(time.perf_counter() - start)
        wrong += not torch.equal(out, expected[i % 2])
    return {"times": times, "wrong": wrong}


# ---------------------------------------------------------------- driver


def _pair(env: dict[str, str]) -> tuple[Worker, Worker]:
    base = {"OMP_NUM_THREADS": "1", **env}
    return Worker(env={**base, "TENSORWIRE_NODE_ID": "bench-a"}), Worker(env={**base, "TENSORWIRE_NODE_ID": "bench-b"})


def _both(pair: tuple[Worker, Worker], kind: str, nbytes: int, repeats: int) -> dict:
    """Bare ``kind`` ("ucx" or "gloo"): the producer sends while the consumer receives and times."""
    producer, consumer = pair
    producer.send(f"benchmarks.two_sided:{kind}_send", nbytes, repeats)
    times = consumer.call(f"benchmarks.two_sided:{kind}_recv", nbytes, repeats, timeout_s=300)
    producer.result(timeout_s=300)
    return times


def measure(sizes: tuple[int, ...] = SIZES, repeats_of: dict[int, int] | None = None) -> tuple[dict, dict]:
    """Median seconds per transfer by method and size, and wrong transfers by method."""
    results: dict[str, dict[int, float]] = {}
    wrong: dict[str, int] = {}
    REPEATS.update(repeats_of or {})

    def record(method: str, nbytes: int, result: dict) -> None:
        results.setdefault(method, {})[nbytes] = statistics.median(result["times"])
        if result["wrong"]:
            wrong[method] = wrong.get(method, 0) + result["wrong"]

    for tls in ("tcp", "sm"):
        producer, consumer = _pair({"UCX_TLS": f"{tls},self"})
        try:
            consumer_address = consumer.call("benchmarks.two_sided:ucx_start")
            producer_address = producer.call("benchmarks.two_sided:ucx_start")
            producer.call("benchmarks.two_sided:ucx_connect", consumer_address)
            consumer.call("benchmarks.two_sided:ucx_connect", producer_address)
            for nbytes in sizes:
                repeats = REPEATS[nbytes]
                record(
                    f"bare ucxx ({tls})",
                    nbytes,
                    _both((producer, consumer), "ucx", nbytes, repeats),
                )
                ref = producer.call("benchmarks.two_sided:put_value", nbytes)
                record(
                    f"tensorwire ucx ({tls})",
                    nbytes,
                    consumer.call("benchmarks.two_sided:tw_get_times", ref, "ucx", repeats, timeout_s=300),
                )
                if tls == "tcp":
                    for transport in ("gloo", "host"):
                        record(
                            f"tensorwire {transport}",
                            nbytes,
                            consumer.call("benchmarks.two_sided:tw_get_times", ref, transport, repeats, timeout_s=300),
                        )
            producer.call("benchmarks.two_sided:ucx_stop")
            consumer.call("benchmarks.two_sided:ucx_stop")
        finally:
            producer.close()
            consumer.close()

    producer, consumer = _pair({})
    try:
        port = producer.call("benchmarks.two_sided:gloo_store", 0)
        consumer.call("benchmarks.two_sided:gloo_store", 1, port)
        producer.send("benchmarks.two_sided:gloo_group", 0)
        consumer.call("benchmarks.two_sided:gloo_group", 1)
        producer.result(timeout_s=60)
        for nbytes in sizes:
            repeats = REPEATS[nbytes]
            record(
                "bare torch gloo",
                nbytes,
                _both((producer, consumer), "gloo", nbytes, repeats),
            )
    finally:
        producer.close()
        consumer.close()

    same_node = Worker(env={"OMP_NUM_THREADS": "1"})
    try:  # same node: the one-sided shm path, for the same-node decision
        for nbytes in sizes:
            ref = tw.put(pattern(nbytes))
            record(
                "tensorwire shm (same node)",
                nbytes,
                same_node.call("benchmarks.two_sided:tw_get_times", ref, "shm", REPEATS[nbytes], timeout_s=300),
            )
            del ref
    finally:
        same_node.close()
    return results, wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.two_sided")
    parser.add_argument("--quick", action="store_true", help="1 MiB only, three repeats (a check, not a measurement)")
    quick = parser.parse_args(argv).quick
    sizes = (MIB,) if quick else SIZES
    results, wrong = measure(sizes, {MIB: 3} if quick else None)
    facts = machine()
    header = "| method | " + " | ".join(f"{n // MIB} MiB" for n in sizes) + " |"
    print(f"GB/s (median of repeats; two processes; measured on {facts['cores']} cores, {facts['cpu']})")
    print(header)
    print("|---" * (len(sizes) + 1) + "|")
    for method, by_size in results.items():
        cells = " | ".join(f"{n / by_size[n] / 1e9:.2f}" for n in sizes)
        print(f"| {method} | {cells} |")
    print()
    for ours, bare in (
        ("tensorwire ucx (tcp)", "bare ucxx (tcp)"),
        ("tensorwire ucx (sm)", "bare ucxx (sm)"),
        ("tensorwire gloo", "bare torch gloo"),
    ):
        ratios = ", ".join(f"{n // MIB} MiB {results[bare][n] / results[ours][n]:.2f}x" for n in sizes)
        print(f"{ours} vs {bare}: {ratios}")
    if wrong:
        print(f"FAILED: wrong data delivered by {wrong}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
