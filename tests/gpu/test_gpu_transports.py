"""GPU transports on real hardware (marked ``gpu`` / ``multi_gpu``; skipped without GPUs).

Run them with ``benchmarks/device_check.sh`` on a machine with an NVIDIA GPU. Every case
checks a digest of what arrived and where it landed.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

import tensorwire as tw
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest

pytestmark = pytest.mark.gpu


@pytest.fixture
def producer():
    w = Worker(start_method="spawn")  # as verified on the H200: a fresh interpreter
    yield w
    w.close()


def test_cuda_ipc_same_gpu_between_processes(producer):
    ref, expected = producer.call("tests.helpers.gpu_tasks:put_cuda_state", seed=1)
    value = tw.get(ref, transport="cuda_ipc")
    assert digest(value) == expected
    assert {t.device.type for t in value.values()} == {"cuda"}
    assert tw.stats()["recent"][-1].transport == "cuda_ipc"
    again = tw.get(ref)  # automatic choice on one node, one GPU
    assert digest(again) == expected
    assert tw.stats()["recent"][-1].transport == "cuda_ipc", tw.stats()["recent"][-1].reason


def test_cuda_ipc_into_existing_gpu_buffers(producer):
    ref, expected = producer.call("tests.helpers.gpu_tasks:put_cuda_state", seed=2)
    out = {k: torch.empty_like(v) for k, v in tw.get(ref, transport="cuda_ipc").items()}
    pointers = {k: v.data_ptr() for k, v in out.items()}
    got = tw.get(ref, out=out, transport="cuda_ipc")
    assert digest(got) == expected
    assert {k: v.data_ptr() for k, v in got.items()} == pointers


def test_cuda_ipc_zero_copy_view_shares_the_producers_memory(producer):
    ref = producer.call("tests.helpers.gpu_tasks:put_cuda_filled", 1 << 20, fill=5)
    consumer = Worker(start_method="spawn")
    try:
        seen = consumer.call("tests.helpers.gpu_tasks:get_view_and_write", ref)
        assert seen == {"zero_copy": True, "first": 5, "device": "cuda:0"}
        assert producer.call("tests.helpers.gpu_tasks:read_first", "filled") == 99  # documented: views share memory
    finally:
        consumer.close()


def test_stream_ordering_producer_kernel_still_running(producer):
    ref = producer.call("tests.helpers.gpu_tasks:put_after_slow_kernel", 64 << 20, fill=9)
    value = tw.get(ref, transport="cuda_ipc")  # sent while the producer's kernel may still run
    torch.cuda.synchronize()
    assert int(value.min()) == 9 and int(value.max()) == 9


def test_cuda_value_to_a_process_without_gpu_lands_on_cpu(producer):
    ref, expected = producer.call("tests.helpers.gpu_tasks:put_cuda_state", seed=3)
    cpu_only = Worker(env={"CUDA_VISIBLE_DEVICES": ""}, start_method="spawn")
    try:
        got = cpu_only.call("tests.helpers.gpu_tasks:get_on_device", ref, transport="host")
        assert got == {"digest": expected, "transport": "host", "devices": ["cpu"]}
    finally:
        cpu_only.close()


def test_device_argument_is_honored(producer):
    ref, expected = producer.call("tests.helpers.gpu_tasks:put_cuda_state", seed=4)
    value = tw.get(ref, device="cpu")
    assert digest(value) == expected
    assert {t.device.type for t in value.values()} == {"cpu"}


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed on this machine")
def test_ucx_moves_cuda_memory(producer):
    ref, expected = producer.call("tests.helpers.gpu_tasks:put_cuda_state", seed=5)
    value = tw.get(ref, transport="ucx")
    assert digest(value) == expected
    assert {t.device.type for t in value.values()} == {"cuda"}


def test_producer_killed_after_export_never_yields_garbage(producer):
    """Killed once its export provably reached this consumer (a fetch through the handle
    succeeded): what arrived stays intact, and every later fetch is a clear error, not garbage.
    (A kill in the middle of one cuda_ipc copy cannot be aimed at: it lasts microseconds.)"""
    ref = producer.call("tests.helpers.gpu_tasks:put_cuda_filled", 256 << 20, fill=3)
    first = tw.get(ref, transport="cuda_ipc", timeout_s=30)  # the handle is exported and opened here
    torch.cuda.synchronize()
    assert tw.stats()["recent"][-1].transport == "cuda_ipc"
    assert (int(first.min()), int(first.max())) == (3, 3)
    producer.kill()
    with pytest.raises((tw.OwnerDiedError, tw.TransportError)):
        tw.get(ref, transport="cuda_ipc", timeout_s=10)
    assert (int(first.min()), int(first.max())) == (3, 3)  # the private copy outlives the producer


def test_ray_actors_with_fractional_gpus_share_one_gpu():
    """Needs Ray, which the GPU check machine lacks (see docs/performance.md, "What the GPU
    check cannot run"): it then skips saying so."""
    ray = pytest.importorskip("ray", reason="ray is not installed on this machine")
    from tests.helpers.ray_sessions import ray_session

    @tw.remote(num_gpus=0.5)
    class Holder:
        def make(self) -> dict:
            import torch as t

            return {"w": t.arange(1 << 20, dtype=t.int64, device="cuda")}

        def where(self) -> tuple[int, str]:
            import os

            import torch as t

            return os.getpid(), str(t.cuda.get_device_properties(0).uuid)

        def total(self, state: dict) -> int:
            return int(state["w"].sum().item())  # integers: exact whatever the summation order

    with ray_session():
        tw.init(address="local", num_gpus=1, include_dashboard=False)
        try:
            a, b = Holder.remote(), Holder.remote()
            (pid_a, gpu_a), (pid_b, gpu_b) = ray.get([a.where.remote(), b.where.remote()])
            assert pid_a != pid_b and gpu_a == gpu_b  # two processes on one GPU
            assert ray.get(b.total.remote(a.make.remote())) == (1 << 20) * ((1 << 20) - 1) // 2
        finally:
            ray.shutdown()


@pytest.mark.multi_gpu
def test_cuda_ipc_and_nccl_between_two_gpus(producer):
    ref, expected = producer.call("tests.helpers.gpu_tasks:put_cuda_state", seed=6)
    for transport in ("cuda_ipc", "nccl"):
        value = tw.get(ref, transport=transport, device="cuda:1")
        assert digest(value) == expected
        assert {str(t.device) for t in value.values()} == {"cuda:1"}


def _wait_owned(producer, expected: int) -> tuple[int, int]:
    deadline = time.monotonic() + 15
    while True:
        owned, allocated = producer.call("tests.helpers.gpu_tasks:owned_and_allocated")
        if owned == expected or time.monotonic() > deadline:
            return owned, allocated


def test_cuda_ipc_mappings_hold_the_object_until_released(producer):
    import gc

    base_owned, base_allocated = _wait_owned(producer, 0)
    ref = producer.call("tests.helpers.gpu_tasks:put_cuda_unkept", 64 << 20)
    copy = tw.get(ref, transport="cuda_ipc")
    view = tw.get(ref, transport="cuda_ipc", view=True)
    assert int(copy[0]) == 4 and int(view[-1]) == 4
    del ref, copy
    gc.collect()
    from tensorwire.transport.agent.core import get_agent

    assert get_agent().flush()  # a (wrong) release of the copy's hold has reached the producer now
    owned, _ = producer.call("tests.helpers.gpu_tasks:owned_and_allocated")
    assert owned == base_owned + 1  # the view still holds the object
    del view
    gc.collect()
    owned, allocated = _wait_owned(producer, base_owned)
    assert owned == base_owned  # released, then freed by the producer
    assert allocated <= base_allocated + (1 << 20)  # its GPU memory went back (no IPC limbo)


def test_cupy_arrays_travel_and_arrive_as_cupy(producer):
    cupy = pytest.importorskip("cupy", reason="cupy is not installed on this machine")
    ref, expected = producer.call("tests.helpers.gpu_tasks:put_cupy", 1 << 20)
    value = tw.get(ref)  # cupy's own memory: not cuda_ipc (torch cannot share it), ucx or host
    assert isinstance(value["c"], cupy.ndarray)
    assert digest({"c": torch.from_dlpack(value["c"])}) == expected
    assert tw.stats()["recent"][-1].transport in ("ucx", "host")
