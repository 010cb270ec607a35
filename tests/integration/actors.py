"""Actors and tasks used by the integration tests."""

from __future__ import annotations

import asyncio
import gc
import os
import time
import weakref

import torch

import tensorwire as tw
from tests.helpers.tasks import digest


def make_state(num_tensors: int, total_nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    per = max(1, total_nbytes // num_tensors // 4)
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(num_tensors)}


@tw.remote(num_cpus=0)
class Producer:
    def __init__(self) -> None:
        self.state: dict = {}
        self.last: torch.Tensor | None = None

    @tw.method
    def make(self, num_tensors: int, total_nbytes: int, seed: int = 0):
        self.state = make_state(num_tensors, total_nbytes, seed)
        return self.state

    @tw.method
    def nested(self):
        return {"a": [torch.arange(5), (torch.ones(2, 2), "tag")], "n": 3, "arr": torch.zeros(0)}

    @tw.method
    def tensor(self, nbytes: int, fill: int = 1):
        self.last = torch.full((nbytes,), fill, dtype=torch.uint8)
        return self.last

    @tw.method(transport="host")
    def tensor_over_host(self, nbytes: int, fill: int = 1):
        return torch.full((nbytes,), fill, dtype=torch.uint8)

    @tw.method(snapshot=True)
    def tensor_snapshot(self, nbytes: int, fill: int = 1):
        self.last = torch.full((nbytes,), fill, dtype=torch.uint8)
        return self.last

    @tw.method
    def fail(self, message: str):
        raise ValueError(message)

    def mutate_last(self, fill: int) -> None:
        self.last.fill_(fill)

    @tw.method
    def slow(self, seconds: float, nbytes: int):
        time.sleep(seconds)
        return torch.ones(nbytes, dtype=torch.uint8)

    def is_same_as_state(self, value: dict) -> bool:
        """A Ref passed back to its producer resolves to the very same tensors."""
        return all(value[k].data_ptr() == v.data_ptr() for k, v in self.state.items())

    def owned(self) -> int:
        from tensorwire.transport.agent.core import get_agent

        get_agent().flush()
        return get_agent().owned_objects()

    def rss_nbytes(self) -> int:
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return tw.stats()["node_id"]


@tw.remote(num_cpus=0, max_concurrency=4)
class Consumer:
    def __init__(self) -> None:
        self.kept = None

    def digest(self, value) -> str:
        return digest(value)

    def digest_and_transport(self, value) -> tuple[str, str]:
        return digest(value), tw.stats()["recent"][-1].transport

    def slow_digest(self, value, seconds: float) -> str:
        time.sleep(seconds)
        return digest(value)

    @tw.method(resolve=False)
    def keep_ref(self, ref):
        self.kept = ref
        return torch.ones(1)

    def get_kept(self) -> str:
        return digest(tw.get(self.kept))

    def digest_and_address(self, value) -> tuple[str, int]:
        return digest(value), value.data_ptr()

    def keep_argument(self, value) -> int:
        self.kept_argument = value
        return value.data_ptr()

    def kept_argument_digest(self) -> str:
        return digest(self.kept_argument)

    def device_types(self, a, b) -> list[str]:
        return [a.device.type, b["nested"].device.type]

    def kinds(self, a, b) -> list[str]:
        return [type(a).__name__, type(b).__name__]

    def fetch_error(self, value_holder) -> str:
        try:
            tw.get(value_holder["ref"], timeout_s=20)
        except tw.TensorwireError as e:  # the class of tw's hierarchy it is (a Ray-flavoured subclass: its base)
            return next(c.__name__ for c in type(e).__mro__ if c.__module__ == "tensorwire.errors")
        return "ok"

    def pid(self) -> int:
        return os.getpid()

    def ray_metrics_recorded(self) -> int:
        """Transfers this process reported through Ray's metrics API."""
        from tensorwire.runtime.ray.env import RayMetrics

        return RayMetrics.instance().recorded

    def flush(self) -> None:
        """Send queued holder messages (no garbage collection: references must die by refcount)."""
        from tensorwire.transport.agent.core import get_agent

        get_agent().flush()


@tw.remote(num_cpus=0)
class AsyncConsumer:
    async def digest(self, value) -> str:
        await asyncio.sleep(0.01)
        return digest(value)

    @tw.method
    async def produce(self, nbytes: int):
        await asyncio.sleep(0.01)
        return torch.full((nbytes,), 3, dtype=torch.uint8)

    async def await_ref(self, holder) -> str:
        value = await tw.get_async(holder["ref"])
        return digest(value)


@tw.remote(num_cpus=0)
def task_digest(value) -> str:
    return digest(value)


@tw.remote(num_cpus=0)
def task_tensor(nbytes: int, fill: int) -> torch.Tensor:
    return torch.full((nbytes,), fill, dtype=torch.uint8)


@tw.remote(num_cpus=0)
def task_make(nbytes: int) -> dict:
    inner = tw.put(torch.full((nbytes,), 9, dtype=torch.uint8))  # owned by the task's worker
    return {"inner": inner, "plain": torch.arange(4)}


@tw.remote(num_cpus=0, max_restarts=1)
class Restartable:
    @tw.method
    def tensor(self, nbytes: int, fill: int):
        return torch.full((nbytes,), fill, dtype=torch.uint8)

    def identity(self) -> tuple[int, str]:
        return os.getpid(), tw.stats()["agent_id"]


class _Node:
    """A reference cycle when it points at itself."""

    me: _Node | None = None


@tw.remote(num_cpus=0)
class HeapProbe:
    """What the garbage collector of a tensorwire actor walks (:mod:`tensorwire.runtime.ray.heap`)."""

    def __init__(self) -> None:
        self.made_in_init = [object()]  # tracked by the collector until frozen
        self.held: _Node | None = None
        self.kept: weakref.ref | None = None

    def collector_view(self) -> tuple[int, bool]:
        """(objects frozen, whether the collector still walks the list made in ``__init__``)."""
        return gc.get_freeze_count(), any(o is self.made_in_init for o in gc.get_objects())

    def make_a_cycle(self) -> None:
        """A reference cycle this actor holds until the next call drops it."""
        self.held = _Node()
        self.held.me = self.held
        self.kept = weakref.ref(self.held)

    def drop_the_cycle(self) -> bool:
        """Drop it; whether the collector freed it (not if it was frozen meanwhile)."""
        self.held = None
        gc.collect()
        return self.kept is not None and self.kept() is None
