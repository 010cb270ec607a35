"""``device=`` naming a device this process does not see: a tensorwire error, before any transfer."""

from __future__ import annotations

import asyncio

import pytest
import torch

import tensorwire as tw
from tensorwire.runtime.api import get_async
from tensorwire.transport.hw import topology
from tests.helpers.tasks import digest


@pytest.fixture
def no_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only case; this machine has a CUDA device")


def test_get_on_cuda_without_cuda_is_a_tensorwire_error(no_cuda):
    value = {"w": torch.arange(12.0).reshape(3, 4)}
    ref = tw.put(value)
    for device in ("cuda", "cuda:3", torch.device("cuda", 1)):
        with pytest.raises(tw.DeviceUnavailableError) as raised:
            tw.get(ref, device=device)
        message = str(raised.value)
        assert f"device={device!r} is not available here" in message
        assert "visible: cpu." in message
        assert isinstance(raised.value, ValueError) and isinstance(raised.value, tw.TensorwireError)
    with pytest.raises(tw.DeviceUnavailableError, match="device='cuda'"):
        tw.get([ref, tw.put(torch.ones(2))], device="cuda")
    with pytest.raises(tw.DeviceUnavailableError, match="device='cuda:0'"):
        asyncio.run(get_async(ref, device="cuda:0"))
    assert digest(tw.get(ref, device="cpu")) == digest(value)  # nothing lost


def test_get_in_another_process_on_cuda_without_cuda(no_cuda, worker):
    value = torch.randn(1000)
    ref = tw.put(value)
    assert worker.call("tests.helpers.tasks:get_error", ref, device="cuda") == "DeviceUnavailableError"
    assert worker.call("tests.helpers.tasks:get_digest", ref) == digest(value)


def test_a_string_torch_does_not_know():
    ref = tw.put(torch.ones(3))
    with pytest.raises(tw.DeviceUnavailableError, match="device='gpu' is not a device torch can use here"):
        tw.get(ref, device="gpu")


def test_an_index_past_the_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(tw.DeviceUnavailableError) as raised:
        topology.checked_device("cuda:3")
    message = str(raised.value)
    assert "device='cuda:3' is not available here: this process sees 2 cuda device(s)" in message
    assert "(CUDA_VISIBLE_DEVICES='4,5'); visible: cpu, cuda:0, cuda:1" in message
    assert topology.checked_device("cuda:1") == torch.device("cuda", 1)
    assert topology.checked_device("cuda") == torch.device("cuda")


def test_cpu_and_meta_pass():
    assert topology.checked_device("cpu") == torch.device("cpu")
    assert topology.checked_device(torch.device("meta")) == torch.device("meta")


@pytest.mark.gpu
def test_get_past_the_last_gpu():
    count = torch.cuda.device_count()
    value = torch.arange(64, dtype=torch.float32)
    ref = tw.put(value)
    with pytest.raises(tw.DeviceUnavailableError, match=f"this process sees {count} cuda device"):
        tw.get(ref, device=f"cuda:{count}")
    got = tw.get(ref, device=f"cuda:{count - 1}")
    assert got.device == torch.device("cuda", count - 1) and torch.equal(got.cpu(), value)
