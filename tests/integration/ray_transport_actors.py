"""Plain Ray actors written as for Ray's direct transport, with ``tensor_transport="tensorwire"``."""

from __future__ import annotations

import os

import ray
import torch

import tensorwire as tw

tw.register_ray_transport()  # before the classes: Ray checks the name when it decorates them


def this_process_manager():
    """Ray's instance of the tensorwire transport manager in this process (registering the
    transport first: this may be an actor's first call, with Ray registering it concurrently)."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    tw.register_ray_transport()
    return get_tensor_transport_manager("TENSORWIRE")


def state_dict(n: int, numel: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(numel, generator=generator) for i in range(n)}


def checksum(value) -> float:
    """The sum of every tensor and number in ``value`` (nested lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return float(value.double().sum())
    if isinstance(value, dict):
        return sum(checksum(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(checksum(v) for v in value)
    return float(value) if isinstance(value, (int, float)) else 0.0


@ray.remote(num_cpus=0, max_concurrency=4)
class Producer:
    def __init__(self) -> None:
        self.kept = torch.arange(1000, dtype=torch.float32)

    @ray.method(tensor_transport="tensorwire")
    def tensor(self, numel: int, seed: int = 0) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(seed))

    @ray.method(tensor_transport="tensorwire")
    def nested(self, numel: int) -> dict:
        return {"w": torch.ones(numel), "parts": [torch.arange(4.0), "tag", 7], "pair": (torch.full((2,), 3.0), 1.5)}

    @ray.method(tensor_transport="tensorwire")
    def state_dict(self, n: int) -> dict[str, torch.Tensor]:
        return state_dict(n)

    @ray.method(tensor_transport="tensorwire")
    def kept_tensor(self) -> torch.Tensor:
        return self.kept

    @ray.method(tensor_transport="tensorwire")
    def number(self) -> int:
        return 5

    @ray.method(tensor_transport="tensorwire")
    def on_meta_device(self) -> torch.Tensor:
        return torch.empty(4, device="meta")

    def plain(self, numel: int) -> torch.Tensor:
        return torch.full((numel,), 2.0)

    def put_tensor(self, numel: int) -> list:
        return [ray.put(torch.full((numel,), 4.0), _tensor_transport="tensorwire")]

    def wait_kept_freed(self, timeout_s: float) -> bool:
        ray.experimental.wait_tensor_freed(self.kept, timeout=timeout_s)
        return True

    def resources(self) -> dict:
        stats = tw.stats()
        return {
            "published": this_process_manager().published_count(),
            "objects": stats["objects_owned"],
            "bytes": stats["bytes_owned"],
            "fds": len(os.listdir("/proc/self/fd")),
        }

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0, max_concurrency=4, enable_tensor_transport=True)
class Consumer:
    def checksum(self, value) -> float:
        return checksum(value)

    def checksum_of_nested_refs(self, refs: list) -> float:
        return sum(checksum(v) for v in ray.get(refs, timeout=60))

    def first_value(self, value):
        return value[0] if isinstance(value, list) else value

    def recent_transports(self, n: int) -> list[tuple[str, str]]:
        return [(r.transport, r.reason) for r in tw.stats()["recent"][-n:]]

    def resources(self) -> dict:
        return {"fds": len(os.listdir("/proc/self/fd")), "objects": tw.stats()["objects_held"]}
