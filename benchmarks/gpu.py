"""GPU transports between two processes on one GPU against torch's device-to-device copy.

For 1 MiB to 4 GiB: the producer process puts a CUDA tensor, this process fetches it into
an existing CUDA buffer with ``cuda_ipc`` and with ``ucx`` (UCX over CUDA memory, when
``ucxx`` is installed), and times ``torch`` ``dst.copy_(src)`` on the same GPU in this process
as the bound. Times include ``torch.cuda.synchronize()``. Prints a markdown table.

Every timed call is checked: the producer's value is a byte pattern, the destination is
zeroed before each timed call and compared with the pattern after it (both untimed, on the
GPU). A method that fails or delivers wrong data is reported and makes the script exit 1.
Per size the methods run one after the other, each its repeats in a row (not interleaved).

Run: ``python -m benchmarks.gpu`` on a machine with an NVIDIA GPU (about a minute).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch

import tensorwire as tw
from tensorwire.bench.ops import pattern
from tensorwire.bench.schema import machine
from tests.helpers.procs import Worker

MIB = 1 << 20
SIZES = (1 * MIB, 16 * MIB, 256 * MIB, 1024 * MIB, 4096 * MIB)
FAILURES: dict[str, str] = {}


def _repeats(nbytes: int) -> int:
    return 20 if nbytes <= 16 * MIB else 8


def _time(fn, repeats: int, out: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Median seconds of ``fn()`` (which fills ``out``) and the calls that left ``out`` wrong."""
    fn()  # warm up: open handles, connect, fault in
    torch.cuda.synchronize()
    times, wrong = [], 0
    for _ in range(repeats):
        out.zero_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        wrong += not torch.equal(out, expected)
    return statistics.median(times), wrong


def _measure(producer: Worker, nbytes: int, methods: list[str]) -> tuple[dict[str, float], str]:
    """Median seconds per method for one size, every timed call checked; the automatic choice."""
    ref = producer.call("tests.helpers.gpu_tasks:put_cuda_pattern", nbytes, timeout_s=300)
    expected = pattern(nbytes, device="cuda")
    out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = expected.clone()
    repeats = _repeats(nbytes)
    seconds = {}
    for method in methods:
        transport = method.split()[0]
        if transport == "host" and nbytes > 256 * MIB:
            continue

        def fn(t: str = transport) -> object:
            return out.copy_(src) if t == "torch" else tw.get(ref, out=out, transport=t)

        try:
            seconds[method], wrong = _time(fn, 3 if transport == "host" else repeats, out, expected)
        except Exception as e:
            FAILURES.setdefault(method, f"{type(e).__name__}: {str(e)[:300]}")
            continue
        if wrong:
            FAILURES.setdefault(method, f"{wrong} timed call(s) at {_size(nbytes)} delivered wrong data")
    out.zero_()
    tw.get(ref, out=out)  # the automatic choice, checked too
    if not torch.equal(out, expected):
        FAILURES.setdefault("automatic choice", f"wrong data at {_size(nbytes)}")
    return seconds, tw.stats()["recent"][-1].reason


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs an NVIDIA GPU")
    methods = ["torch copy_ (same process)", "cuda_ipc"]
    if importlib.util.find_spec("ucxx") is not None:
        methods.append("ucx")
    methods.append("host (staged, <= 256 MiB)")
    producer = Worker(start_method="spawn")  # as verified on the H200: a fresh interpreter
    rows: dict[str, dict[int, float]] = {m: {} for m in methods}
    reasons: dict[int, str] = {}
    try:
        for nbytes in SIZES:
            seconds, reasons[nbytes] = _measure(producer, nbytes, methods)
            for method, value in seconds.items():
                rows[method][nbytes] = value
            torch.cuda.empty_cache()
    finally:
        producer.close()
    print(
        f"GB/s, median ({torch.cuda.get_device_name(0)}, {machine()['cores']} cores, {machine()['cpu']}; "
        "two processes on one GPU; times include synchronize)"
    )
    print()
    print("| method | " + " | ".join(_size(n) for n in SIZES) + " |")
    print("|---" * (len(SIZES) + 1) + "|")
    for method, by_size in rows.items():
        cells = " | ".join(f"{n / by_size[n] / 1e9:.1f}" if n in by_size else "-" for n in SIZES)
        print(f"| {method} | {cells} |")
    print()
    bound = rows["torch copy_ (same process)"]
    for method in [m for m in rows if m.startswith(("cuda_ipc", "ucx"))]:
        ratios = ", ".join(f"{_size(n)} {bound[n] / rows[method][n]:.2f}x" for n in SIZES if n in rows[method]) or "-"
        print(f"- {method} / torch copy_: {ratios}")
    if MIB in rows["cuda_ipc"]:
        print(
            f"- 1 MiB fetch latency: cuda_ipc {rows['cuda_ipc'][MIB] * 1e6:.0f} us, "
            f"torch copy_ {bound[MIB] * 1e6:.0f} us"
        )
    print(f"- automatic choice at 256 MiB: {reasons[256 * MIB]}")
    for method, error in FAILURES.items():
        print(f"- {method} FAILED: {error}")
    return 1 if FAILURES else 0


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes < 1024 * MIB else f"{nbytes // (1024 * MIB)} GiB"


if __name__ == "__main__":
    sys.exit(main())
