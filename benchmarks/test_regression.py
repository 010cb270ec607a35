"""pytest-benchmark suite over the bench core, for regression tracking (small sizes).

Run: ``python -m pytest benchmarks --benchmark-enable`` (add ``--benchmark-autosave`` and later
``--benchmark-compare`` to track changes). Without ``--benchmark-enable`` (the project's
default) each case runs once, as a smoke test. A peer process puts the values; this process
fetches them into existing buffers, as ``tensorwire bench`` does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.bench import ops
from tensorwire.peers import ask, spawn

CASES = [("inline", 4096, "same"), ("shm", 65536, "same"), ("shm", 1 << 20, "same"), ("ucx", 65536, "other"),
         ("gloo", 65536, "other"), ("host", 65536, "other")]  # fmt: skip


@pytest.fixture(scope="module")
def producers():
    from tensorwire.runtime.ray_env import agent as runtime_agent

    node = runtime_agent().peer.node_id
    with spawn(ops.dispatch, {"same": {}, "other": {"TENSORWIRE_NODE_ID": f"{node}/regression"}}) as peers:
        yield peers


@pytest.mark.parametrize(("transport", "nbytes", "where"), CASES, ids=[f"{t}-{n}" for t, n, _ in CASES])
def test_fetch(benchmark, producers, transport, nbytes, where):
    status, ref = ask(producers[where], ("hold", nbytes, 1), timeout_s=60)
    assert status == "ok", ref
    out = torch.empty(nbytes, dtype=torch.uint8)
    tw.get(ref, out=out, transport=transport, timeout_s=60)  # connect and map first
    benchmark(tw.get, ref, out=out, transport=transport, timeout_s=60)
    assert torch.equal(out, ops.pattern(nbytes))


def test_memcpy_bound(benchmark):
    src, dst = ops.pattern(1 << 20).numpy(), torch.empty(1 << 20, dtype=torch.uint8).numpy()
    benchmark(np.copyto, dst, src)
    assert (dst == src).all()
