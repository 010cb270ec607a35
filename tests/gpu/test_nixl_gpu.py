"""nixl between two processes on one GPU: CUDA -> CUDA through NIXL's VRAM descriptors
(marked ``gpu``; ``benchmarks/device_check.sh`` runs it). Unverified until it ran on a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import tensorwire as tw
from tests.helpers.tasks import digest

INSTALLED = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not INSTALLED, reason="NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)"),
]


def test_nixl_cuda_to_cuda_between_processes_on_one_gpu(worker):
    ref, expected = worker.call("tests.helpers.gpu_tasks:put_cuda_state", seed=11)
    value = tw.get(ref, transport="nixl", device="cuda")
    assert digest(value) == expected
    assert {t.device.type for t in value.values()} == {"cuda"}
    assert tw.stats()["recent"][-1].transport == "nixl"
    out = {k: torch.empty_like(v) for k, v in value.items()}
    pointers = {k: v.data_ptr() for k, v in out.items()}
    got = tw.get(ref, out=out, transport="nixl")  # straight into registered GPU buffers
    assert digest(got) == expected and {k: v.data_ptr() for k, v in got.items()} == pointers


def test_nixl_cuda_producer_to_host_consumer(worker):
    ref, expected = worker.call("tests.helpers.gpu_tasks:put_cuda_state", seed=12)
    value = tw.get(ref, transport="nixl", device="cpu")
    assert digest(value) == expected
    assert {t.device.type for t in value.values()} == {"cpu"}
