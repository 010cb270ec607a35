"""pytest-benchmark suite over the bench core, for regression tracking (small sizes).

Run: ``python -m pytest benchmarks --benchmark-enable`` (add ``--benchmark-autosave`` and later
``--benchmark-compare`` to track changes). Without ``--benchmark-enable`` (the project's
default) each case runs once, as a smoke test. A peer process puts the values; this process
fetches them into existing buffers, as ``tensorwire bench`` does. Every timed fetch is checked:
the buffer is zeroed before each round (untimed, pytest-benchmark's ``setup``) and compared
with the pattern after it, so a fetch that writes nothing fails the case.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.bench import ops
from tensorwire.peers import ask, spawn

_ROUNDS = 50  # timed rounds per case with --benchmark-enable (one without)
CASES = [
    ("inline", 4096, "same"),
    ("shm", 65536, "same"),
    ("shm", 1 << 20, "same"),
    ("ucx", 65536, "other"),
    ("gloo", 65536, "other"),
    ("host", 65536, "other"),
]


@pytest.fixture(scope="module")
def producers():
    from tensorwire.runtime.agent import agent as runtime_agent

    node = runtime_agent().peer.node_id
    with spawn(ops.dispatch, {"same": {}, "other": {"TENSORWIRE_NODE_ID": f"{node}/regression"}}) as peers:
        yield peers


class _CheckedRounds:
    """pytest-benchmark ``setup``: checks the round before (the buffer must hold the pattern),
    then zeroes the buffer for the next; :meth:`finish` checks the last round."""

    def __init__(self, out: torch.Tensor, expected: torch.Tensor) -> None:
        self.out, self.expected, self.rounds, self.wrong = out, expected, 0, 0

    def _check(self) -> None:
        if self.rounds and not torch.equal(self.out, self.expected):
            self.wrong += 1

    def __call__(self) -> None:
        self._check()
        self.out.zero_()
        self.rounds += 1

    def finish(self) -> None:
        self._check()
        assert self.rounds >= 1, "no timed round ran"
        assert self.wrong == 0, f"{self.wrong} of {self.rounds} timed round(s) delivered wrong data"


@pytest.mark.parametrize(("transport", "nbytes", "where"), CASES, ids=[f"{t}-{n}" for t, n, _ in CASES])
def test_fetch(benchmark, producers, transport, nbytes, where):
    status, ref = ask(producers[where], ("hold", nbytes, 1), timeout_s=60)
    assert status == "ok", ref
    out = torch.empty(nbytes, dtype=torch.uint8)
    tw.get(ref, out=out, transport=transport, timeout_s=60)  # connect and map first
    rounds = _CheckedRounds(out, ops.pattern(nbytes))
    benchmark.pedantic(
        tw.get,
        args=(ref,),
        kwargs={"out": out, "transport": transport, "timeout_s": 60},
        setup=rounds,
        rounds=_ROUNDS,
        warmup_rounds=1,
    )
    rounds.finish()


def test_memcpy_bound(benchmark):
    src, dst = ops.pattern(1 << 20).numpy(), np.empty(1 << 20, dtype=np.uint8)
    rounds = _CheckedRounds(torch.from_numpy(dst), torch.from_numpy(src))
    benchmark.pedantic(np.copyto, args=(dst, src), setup=rounds, rounds=_ROUNDS * 10, warmup_rounds=1)
    rounds.finish()
