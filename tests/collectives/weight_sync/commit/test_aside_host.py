"""``aside="host"``: all-or-none versions assembled in host memory, published into the
receivers' tensors inside the fence, so a GPU receiver keeps one copy of its weights on the
GPU. Here (no GPU) the shadows' placement is checked with receiver tensors on the ``meta``
device, which host memory is not; the push itself runs between CPU actors. The GPU path is in
``tests/gpu`` (device_check.sh)."""

from __future__ import annotations

import pytest
import ray
import torch

import tensorwire as tw
from tensorwire.collectives.weight_sync.commit import aside
from tensorwire.collectives.weight_sync.planning.layout import Box
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec, Region, Role
from tests.collectives.actors import Holder


def spec(sync_id: str, *, on_host: bool) -> PushSpec:
    role = Role(0, 0, (), ((Region(0, Box((0,), (8,)), "float32"), Region(1, Box((0,), (4,)), "float32")),), 64)
    return PushSpec(sync_id, "w", 1, "", (), 1, None, (), (role,), False, "", 10.0, shadow=True, shadow_on_host=on_host)


def test_host_shadows_are_in_host_memory_not_beside_the_tensors():
    cuda, meta, cpu = torch.device("cuda", 1), torch.device("meta"), torch.device("cpu")  # (no GPU needed)
    host, beside = spec("host", on_host=True), spec("beside", on_host=False)
    assert aside.shadow_device(host, cuda)[0] == cpu  # pinned too where CUDA is (the GPU test checks)
    assert aside.shadow_device(beside, cuda) == (cuda, False)
    assert aside.shadow_device(host, cpu) == (cpu, False) and aside.shadow_device(beside, cpu) == (cpu, False)
    assert aside.shadow_device(beside, meta)[0] == cpu  # a loader's layout in meta tensors: real memory aside
    targets = [torch.empty(8, device="meta"), torch.empty(4, dtype=torch.float16, device="meta")]
    try:
        on_host = aside.destinations(host, targets)
        assert [(t.device.type, t.shape, t.dtype) for t in on_host] == [("cpu", t.shape, t.dtype) for t in targets]
        assert aside.shadow_of(host, targets, 1) is on_host[1]  # kept between pushes
        assert aside.aside_nbytes("host") == 8 * 4 + 4 * 2
    finally:
        aside.release("host")


def test_a_push_with_host_shadows_is_exact_and_in_place(ray_local):
    trainer = Holder.remote(3, 48 << 10, 5)
    receivers = [Holder.remote(3, 48 << 10, None) for _ in range(2)]
    sync = tw.WeightSync(trainer, receivers, source="weights", aside="host", progress=False)
    try:
        pointers = ray.get([r.data_ptrs.remote() for r in receivers], timeout=60)
        for seed in (1, 2):
            ray.get(trainer.step.remote(seed), timeout=60)
            report = sync.push()
            assert report.ok and report.aside_nbytes == 48 << 10  # one host copy of each receiver's weights
            want = ray.get(trainer.digest.remote(), timeout=60)
            assert ray.get([r.digest.remote() for r in receivers], timeout=60) == [want, want]
        assert ray.get([r.data_ptrs.remote() for r in receivers], timeout=60) == pointers  # published by copy
    finally:
        sync.close()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"aside": "host", "commit": "each"}, "needs commit='all' or atomic"),
        ({"aside": "host", "publish": "swap"}, "publish='swap'"),
        ({"aside": "gpu"}, "expected 'shadow', 'host'"),
    ],
)
def test_host_aside_refuses_what_cannot_work(ray_local, settings, message):
    trainer, receiver = Holder.remote(1, 1024, 1), Holder.remote(1, 1024, None)
    with pytest.raises(ValueError, match=message):
        tw.WeightSync(trainer, [receiver], source="weights", progress=False, **settings)
