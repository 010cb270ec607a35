"""Collectives and weight sync in plain processes (no Ray): what the GPU machine can run.

Each function runs in a spawned worker (``tests.helpers.procs.Worker``); members learn about
each other from the descriptions the test passes around, as the driver does with Ray.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from tensorwire.collectives.groups.channel import describe_self, member_from
from tensorwire.collectives.groups.tensorwire_group import TensorwireGroup
from tensorwire.collectives.weight_sync.commit import aside
from tensorwire.collectives.weight_sync.members import common, receiver, trainer
from tensorwire.collectives.weight_sync.planning.layout import Shard, Sharded
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
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


def sync_send(spec: PushSpec, tensors: int, device: str) -> dict:
    actor = holder(tensors, device, seed=3)
    result = dataclasses.asdict(trainer.send(actor, spec))
    result["digest"] = digest(actor.weights)
    return result


def sync_receive(spec: PushSpec, tensors: int, device: str) -> dict:
    actor = holder(tensors, device, seed=None)
    before = [t.data_ptr() for t in actor.weights.values()]
    result = dataclasses.asdict(receiver.receive(actor, spec))
    result["digest"] = digest(actor.weights)
    result["in_place"] = before == [t.data_ptr() for t in actor.weights.values()]
    if spec.shadow:  # where the version was assembled (the shadows kept between pushes)
        kept = aside.destinations(spec, list(actor.weights.values()))
        result["shadows"] = [(t.device.type, t.is_pinned()) for t in kept]
    common.release_hook(actor, spec.sync_id)
    return result


def release(sync_id: str) -> None:
    common.release_hook(None, sync_id)


def _sharded_weights(role: str, rank: int, device: str) -> dict:
    """Trainer rank ``rank`` of 2: rows of ``w`` (64 x 32, float32) and all of ``b``; the
    receiver: columns 16:32 of ``w`` in bfloat16 and all of ``b``."""
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    b = torch.randn(32, generator=torch.Generator().manual_seed(6))
    if role == "trainer":
        return {"w": Sharded.of(w.chunk(2)[rank].contiguous().to(device), [Shard(0)], (2,), (rank,)), "b": b.to(device)}
    return {
        "w": Sharded.of(torch.zeros(64, 16, dtype=torch.bfloat16, device=device), [Shard(1)], (2,), (1,)),
        "b": torch.zeros(32, device=device),
        "expected": (w[:, 16:].to(torch.bfloat16), b),
    }


def sharded_send(spec: PushSpec, rank: int, device: str) -> dict:
    actor = SimpleNamespace(weights=_sharded_weights("trainer", rank, device))
    _kept[f"trainer{rank}"] = actor
    return dataclasses.asdict(trainer.send(actor, spec))


def sharded_receive(spec: PushSpec, device: str) -> dict:
    weights = _sharded_weights("receiver", 0, device)
    expected_w, expected_b = weights.pop("expected")
    actor = SimpleNamespace(weights=weights)
    result = dataclasses.asdict(receiver.receive(actor, spec))
    result["exact"] = torch.equal(weights["w"].tensor.cpu(), expected_w) and torch.equal(weights["b"].cpu(), expected_b)
    common.release_hook(actor, spec.sync_id)
    return result
