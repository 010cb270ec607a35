"""Standalone mode (no Ray): two plain Python processes exchange a state dict by reference.

The parent puts a value and sends the small reference through a multiprocessing pipe; the
child fetches the bytes directly from the parent (shared memory on one machine).
Run: ``python examples/standalone.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

import tensorwire as tw


def child(conn) -> None:
    ref = conn.recv()  # a tw.Ref: metadata only
    start = time.perf_counter()
    state = tw.get(ref)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    total = float(sum(t.double().sum() for t in state.values()))
    conn.send((total, tw.stats()["recent"][-1].transport, elapsed_ms))


def main() -> None:
    state = {f"layer{i}.weight": torch.randn(512, 512) for i in range(32)}  # 32 MiB
    ref = tw.put(state)
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(target=child, args=(child_end,))
    process.start()
    parent_end.send(ref)
    total, transport, elapsed_ms = parent_end.recv()
    process.join(30)
    expected = float(sum(t.double().sum() for t in state.values()))
    print(
        f"child fetched {ref.nbytes / 2**20:.0f} MiB via {transport} in {elapsed_ms:.1f} ms; "
        f"sum {'matches' if abs(total - expected) < 1e-6 else 'DIFFERS'}"
    )


if __name__ == "__main__":
    main()
