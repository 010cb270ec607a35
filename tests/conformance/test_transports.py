"""One suite run against every registered transport, the test-only plug-in included.

Each transport is forced for the fetch; the consumer is this process (``local``), a spawned
process on this node, or a spawned process that claims another node (``host``, ``inline``).
Every case compares a checksum of what arrived with the original.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.transport import get_transport_class, registered_transports
from tensorwire.transport.base import MemoryKind
from tests.helpers import file_transport
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest

file_transport.register()

CROSS_NODE = {"inline", "host", "gloo", "ucx"}  # transports that can reach another node


@pytest.fixture(scope="module")
def consumers():
    """A same-node and a cross-node consumer, both with the test transport registered."""
    same = Worker()
    other = Worker(env={"TENSORWIRE_NODE_ID": "conformance-node-b"})
    for w in (same, other):
        assert "testfile" in w.call("tests.helpers.tasks:register_test_transport")
    yield {"same": same, "other": other}
    same.close()
    other.close()


@pytest.fixture(params=sorted(set(registered_transports())))
def transport(request, agent):
    name = request.param
    if MemoryKind.HOST not in get_transport_class(name).capabilities.memory:
        pytest.skip(f"{name} moves CUDA memory only; tests/gpu/test_gpu_transports.py (marked gpu) covers it")
    if name == "inline":
        agent.set_config(replace(agent.config, inline_max_nbytes=512 << 20))
    return name


def fetch_digest(transport: str, consumers, value, where: str = "same") -> str:
    ref = tw.put(value)
    if transport == "local":
        got = tw.get(ref, transport="local")
        return digest(got)
    got_digest, used = consumers[where].call("tests.helpers.tasks:get_transport", ref, transport=transport)
    assert used == transport
    return got_digest


DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.uint8,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.complex64,
]  # fmt: skip


def test_dtypes(transport, consumers):
    gen = torch.Generator().manual_seed(1)
    value = {}
    for dtype in DTYPES:
        base = torch.randn(3, 5, generator=gen) * 100
        value[str(dtype)] = base > 0 if dtype == torch.bool else base.to(dtype)
    assert fetch_digest(transport, consumers, value) == digest(value)


def test_zero_dim_empty_and_noncontiguous(transport, consumers):
    value = [
        torch.tensor(3.5),
        torch.empty(0, 4),
        torch.arange(20, dtype=torch.int64).reshape(4, 5).t(),  # not contiguous
        torch.arange(30.0).reshape(5, 6)[:, ::2],
        np.arange(12, dtype=np.int32).reshape(3, 4)[:, 1:],
        torch.arange(10.0)[::5][:1],  # one element of a strided view ("contiguous", stride 5)
        np.arange(10.0)[::5][:1],
        np.array(2.5),  # 0-d numpy
    ]
    assert fetch_digest(transport, consumers, value) == digest(value)


def test_nested_structure(transport, consumers):
    value = {
        "a": [torch.ones(3), (torch.zeros(2, 2), "text")],
        "b": {"c": np.arange(5, dtype=np.float32), "d": None, "e": 7},
        "f": (),
    }
    assert fetch_digest(transport, consumers, value) == digest(value)


@pytest.mark.parametrize(
    "nbytes", [1, 4096, 1 << 20, 64 << 20, 256 << 20], ids=["1B", "4KiB", "1MiB", "64MiB", "256MiB"]
)
def test_sizes(transport, consumers, nbytes):
    value = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert fetch_digest(transport, consumers, value) == digest(value)


def test_out_buffers(transport, consumers):
    value = torch.randn(257, 33, generator=torch.Generator().manual_seed(2))
    ref = tw.put(value)
    if transport == "local":
        out = torch.zeros_like(value)
        got = tw.get(ref, out=out, transport="local")
        assert got is out
        assert torch.equal(out, value)
        return
    got_digest, same_buffer = consumers["same"].call("tests.helpers.tasks:get_into_out", ref, transport=transport)
    assert got_digest == digest(value)
    assert same_buffer


def test_cross_node(transport, consumers):
    value = {"w": torch.randn(1000, 100), "b": torch.arange(7)}
    ref = tw.put(value)
    if transport not in CROSS_NODE:
        error = consumers["other"].call("tests.helpers.tasks:get_error", ref, transport=transport)
        assert error == "NoTransportError"
        return
    got_digest, used = consumers["other"].call("tests.helpers.tasks:get_transport", ref, transport=transport)
    assert (got_digest, used) == (digest(value), transport)
