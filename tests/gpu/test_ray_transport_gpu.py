"""``tensor_transport="tensorwire"`` with CUDA tensors between Ray actors sharing one GPU
(marked ``gpu``: skipped without one; run by ``benchmarks/device_check.sh``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    import tensorwire as tw
    from tests.helpers.ray_sessions import ray_session

    with ray_session():
        tw.register_ray_transport()
        ray.init(num_cpus=4, num_gpus=1, include_dashboard=False)
        try:
            yield ray
        finally:
            ray.shutdown()


def test_cuda_tensors_actor_to_actor_and_to_the_driver(gpu_ray):
    ray = gpu_ray

    @ray.remote(num_gpus=0.5)
    class Producer:
        @ray.method(tensor_transport="tensorwire")
        def make(self, numel: int) -> dict:
            return {"w": torch.arange(numel, dtype=torch.float32, device="cuda"), "step": 3}

    @ray.remote(num_gpus=0.5, enable_tensor_transport=True)
    class Reader:
        def total(self, value: dict) -> tuple[float, str, int]:
            return float(value["w"].sum()), value["w"].device.type, value["step"]

    producer, reader = Producer.remote(), Reader.remote()
    ref = producer.make.remote(1 << 20)
    expected = float(torch.arange(1 << 20, dtype=torch.float64).sum())
    total, device, step = ray.get(reader.total.remote(ref), timeout=120)
    assert total == pytest.approx(expected) and device == "cuda" and step == 3
    in_driver = ray.get(ref, timeout=120)
    assert in_driver["w"].device.type == "cuda" and float(in_driver["w"].double().sum()) == pytest.approx(expected)
    on_host = producer.make.remote(1000)
    ray.experimental.set_target_device_for_ref(on_host, "cpu")
    assert ray.get(on_host, timeout=120)["w"].device.type == "cpu"
