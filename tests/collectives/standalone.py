"""Collectives and weight sync in plain processes (no Ray): what the GPU machine can run.

Each function runs in a spawned worker (``tests.helpers.procs.Worker``); members learn about
each other from the descriptions the test passes around, as the driver does with Ray.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tensorwire.collectives import sync_hooks
from tensorwire.collectives.channel import describe_self, member_from
from tensorwire.collectives.group import TensorwireGroup
from tests.helpers.tasks import digest

_kept: dict[str, object] = {}


def describe() -> tuple[bytes, int]:
    return describe_self(None)


def _tensor(rank: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(1 << 18, generator=gen).to(device)  # 1 MiB


def broadcast(name: str, rank: int, descriptions: list, device: str, src: int) -> str:
    members = [member_from(r, d) for r, d in enumerate(descriptions)]
    group = TensorwireGroup(name, rank, members, "tensorwire", 60.0)
    tensor = _tensor(rank, device)
    group.broadcast(tensor, src)
    assert tensor.device.type == torch.device(device).type
    return digest(tensor)


def expected_broadcast(src: int) -> str:
    return digest(_tensor(src, "cpu"))


def holder(tensors: int, device: str, seed: int | None) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn(1 << 16, generator=gen)) if seed is not None else (lambda: torch.zeros(1 << 16))
    weights = {f"w{i}": make().to(device) for i in range(tensors)}
    _kept["holder"] = SimpleNamespace(weights=weights)
    return _kept["holder"]


def sync_send(spec: sync_hooks.PushSpec, tensors: int, device: str) -> dict:
    actor = holder(tensors, device, seed=3)
    result = sync_hooks.send(actor, spec)
    result["digest"] = digest(actor.weights)
    return result


def sync_receive(spec: sync_hooks.PushSpec, tensors: int, device: str) -> dict:
    actor = holder(tensors, device, seed=None)
    before = [t.data_ptr() for t in actor.weights.values()]
    result = sync_hooks.receive(actor, spec)
    result["digest"] = digest(actor.weights)
    result["in_place"] = before == [t.data_ptr() for t in actor.weights.values()]
    sync_hooks.release(actor, spec.sync_id)
    return result


def release(sync_id: str) -> None:
    sync_hooks.release(None, sync_id)
