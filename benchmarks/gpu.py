"""GPU transports between two processes on one GPU against torch's device-to-device copy.

For 1 MiB to 4 GiB: the producer process puts a CUDA tensor, this process fetches it into
an existing CUDA buffer with ``cuda_ipc`` and with ``ucx`` (UCX over CUDA memory, when
``ucxx`` is installed), and times ``torch`` ``dst.copy_(src)`` on the same GPU in this process
as the bound. Times include ``torch.cuda.synchronize()``. Prints a markdown table.

Run: ``python -m benchmarks.gpu`` on a machine with an NVIDIA GPU (about a minute).
"""

from __future__ import annotations

import importlib.util
import statistics
import time

import torch

import tensorwire as tw
from tests.helpers.procs import Worker

MIB = 1 << 20
SIZES = (1 * MIB, 16 * MIB, 256 * MIB, 1024 * MIB, 4096 * MIB)
FAILURES: dict[str, str] = {}


def _repeats(nbytes: int) -> int:
    return 20 if nbytes <= 16 * MIB else 8


def _time(fn, repeats: int) -> float:
    fn()  # warm up: open handles, connect, fault in
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(producer: Worker, nbytes: int, methods: list[str]) -> dict[str, float]:
    """Median seconds per method for one size; the last fetch is automatic and checked."""
    ref = producer.call("tests.helpers.gpu_tasks:put_cuda_filled", nbytes, fill=7, timeout_s=300)
    out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    repeats = _repeats(nbytes)
    seconds = {"torch copy_ (same process)": _time(lambda: out.copy_(src), repeats)}
    for method in methods[1:]:
        transport = method.split()[0]
        if transport == "host" and nbytes > 256 * MIB:
            continue
        try:
            seconds[method] = _time(
                lambda t=transport: tw.get(ref, out=out, transport=t), 3 if transport == "host" else repeats
            )
        except Exception as e:
            FAILURES.setdefault(method, f"{type(e).__name__}: {str(e)[:300]}")
    tw.get(ref, out=out)
    assert int(out.min()) == 7 and int(out.max()) == 7, "data arrived corrupted"
    return seconds


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs an NVIDIA GPU")
    methods = ["torch copy_ (same process)", "cuda_ipc"]
    if importlib.util.find_spec("ucxx") is not None:
        methods.append("ucx")
    methods.append("host (staged, <= 256 MiB)")
    producer = Worker()
    rows: dict[str, dict[int, float]] = {m: {} for m in methods}
    reasons: dict[int, str] = {}
    try:
        for nbytes in SIZES:
            for method, seconds in _measure(producer, nbytes, methods).items():
                rows[method][nbytes] = seconds
            reasons[nbytes] = tw.stats()["recent"][-1].reason
            torch.cuda.empty_cache()
    finally:
        producer.close()
    print(f"GB/s, median ({torch.cuda.get_device_name(0)}; two processes on one GPU; times include synchronize)")
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
    print(
        f"- 1 MiB fetch latency: cuda_ipc {rows['cuda_ipc'][MIB] * 1e6:.0f} us, torch copy_ {bound[MIB] * 1e6:.0f} us"
    )
    print(f"- automatic choice at 256 MiB: {reasons[256 * MIB]}")
    for method, error in FAILURES.items():
        print(f"- {method} FAILED: {error}")


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes < 1024 * MIB else f"{nbytes // (1024 * MIB)} GiB"


if __name__ == "__main__":
    main()
