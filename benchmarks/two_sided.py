"""Two-sided transports between two processes against bare programs, in one run.

For 1, 64 and 256 MiB: tensorwire ``ucx`` (UCX over TCP, and over shared memory),
``gloo``, ``host`` and ``shm`` (one-sided, for the same-node decision), against a bare
``ucxx`` tag send/recv and a bare torch.distributed gloo send/recv written here. Both
processes claim different nodes so that the same-node shortcut does not apply. Each
tensorwire row is one ``tw.get(ref, out=buffer, transport=...)`` (request + transfer);
the bare rows are back-to-back transfers on an already-connected pair (their best case).

Run: ``python -m benchmarks.two_sided`` (about a minute and a half here).
"""

from __future__ import annotations

import datetime
import statistics
import time
from typing import Any

import numpy as np
import torch

import tensorwire as tw
from tensorwire.bench.ops import _state, ucx_connect, ucx_start, ucx_stop  # noqa: F401 - bare ucxx set-up, run by name
from tests.helpers.procs import Worker

MIB = 1 << 20
SIZES = (1 * MIB, 64 * MIB, 256 * MIB)
REPEATS = {1 * MIB: 30, 64 * MIB: 8, 256 * MIB: 5}


# ---------------------------------------------------------------- tensorwire, in the consumer


def tw_get_times(ref: tw.Ref, transport: str, repeats: int) -> list[float]:
    out = torch.empty(ref.nbytes, dtype=torch.uint8)
    tw.get(ref, out=out, transport=transport)  # connect, fault the buffer in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tw.get(ref, out=out, transport=transport)
        times.append(time.perf_counter() - start)
    assert int(out[-1]) == 7
    return times


def put_value(nbytes: int) -> tw.Ref:
    _state.setdefault("values", []).append(torch.full((nbytes,), 7, dtype=torch.uint8))
    return tw.put(_state["values"][-1])


# ---------------------------------------------------------------- bare ucxx


def _ucx_wait(request: Any) -> None:
    while not request.completed:
        time.sleep(0)
    request.check_error()


def ucx_send(nbytes: int, repeats: int) -> None:
    from ucxx._lib.arr import Array

    api, ep = _state["ucx_api"], _state["ucx_ep"]
    data = np.full(nbytes, 7, dtype=np.uint8)
    for i in range(repeats + 1):
        _ucx_wait(ep.tag_send(Array(data), api.UCXXTag(i)))


def ucx_recv(nbytes: int, repeats: int) -> list[float]:
    from ucxx._lib.arr import Array

    api, ep = _state["ucx_api"], _state["ucx_ep"]
    out = np.empty(nbytes, dtype=np.uint8)
    _ucx_wait(ep.tag_recv(Array(out), api.UCXXTag(0)))
    start = time.perf_counter()
    for i in range(1, repeats + 1):
        _ucx_wait(ep.tag_recv(Array(out), api.UCXXTag(i)))
    assert int(out[-1]) == 7
    return [(time.perf_counter() - start) / repeats]


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
    data = torch.full((nbytes,), 7, dtype=torch.uint8)
    for i in range(repeats + 1):
        _state["gloo"].send([data], 1, i).wait()


def gloo_recv(nbytes: int, repeats: int) -> list[float]:
    out = torch.empty(nbytes, dtype=torch.uint8)
    _state["gloo"].recv([out], 0, 0).wait()
    start = time.perf_counter()
    for i in range(1, repeats + 1):
        _state["gloo"].recv([out], 0, i).wait()
    assert int(out[-1]) == 7
    return [(time.perf_counter() - start) / repeats]


# ---------------------------------------------------------------- driver


def _pair(env: dict[str, str]) -> tuple[Worker, Worker]:
    base = {"OMP_NUM_THREADS": "1", **env}
    return Worker(env={**base, "TENSORWIRE_NODE_ID": "bench-a"}), Worker(env={**base, "TENSORWIRE_NODE_ID": "bench-b"})


def _both(pair: tuple[Worker, Worker], kind: str, nbytes: int, repeats: int) -> list[float]:
    """Bare ``kind`` ("ucx" or "gloo"): the producer sends while the consumer receives and times."""
    producer, consumer = pair
    producer.send(f"benchmarks.two_sided:{kind}_send", nbytes, repeats)
    times = consumer.call(f"benchmarks.two_sided:{kind}_recv", nbytes, repeats, timeout_s=300)
    producer.result(timeout_s=300)
    return times


def measure() -> dict[str, dict[int, float]]:
    """Median seconds per transfer, by method and size."""
    results: dict[str, dict[int, float]] = {}

    def record(method: str, nbytes: int, times: list[float]) -> None:
        results.setdefault(method, {})[nbytes] = statistics.median(times)

    for tls in ("tcp", "sm"):
        producer, consumer = _pair({"UCX_TLS": f"{tls},self"})
        try:
            consumer_address = consumer.call("benchmarks.two_sided:ucx_start")
            producer_address = producer.call("benchmarks.two_sided:ucx_start")
            producer.call("benchmarks.two_sided:ucx_connect", consumer_address)
            consumer.call("benchmarks.two_sided:ucx_connect", producer_address)
            for nbytes in SIZES:
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
        for nbytes in SIZES:
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
        for nbytes in SIZES:
            ref = tw.put(torch.full((nbytes,), 7, dtype=torch.uint8))
            record(
                "tensorwire shm (same node)",
                nbytes,
                same_node.call("benchmarks.two_sided:tw_get_times", ref, "shm", REPEATS[nbytes], timeout_s=300),
            )
            del ref
    finally:
        same_node.close()
    return results


def main() -> None:
    results = measure()
    header = "| method | " + " | ".join(f"{n // MIB} MiB" for n in SIZES) + " |"
    print("GB/s (median of repeats; 2-core CPU VM, two processes)")
    print(header)
    print("|---" * (len(SIZES) + 1) + "|")
    for method, by_size in results.items():
        cells = " | ".join(f"{n / by_size[n] / 1e9:.2f}" for n in SIZES)
        print(f"| {method} | {cells} |")
    print()
    for ours, bare in (
        ("tensorwire ucx (tcp)", "bare ucxx (tcp)"),
        ("tensorwire ucx (sm)", "bare ucxx (sm)"),
        ("tensorwire gloo", "bare torch gloo"),
    ):
        ratios = ", ".join(f"{n // MIB} MiB {results[bare][n] / results[ours][n]:.2f}x" for n in SIZES)
        print(f"{ours} vs {bare}: {ratios}")


if __name__ == "__main__":
    main()
