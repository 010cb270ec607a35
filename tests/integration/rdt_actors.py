"""Actors for the Ray-idiom and migration tests: the shape of an actor written for Ray's
direct transport, with ``@ray.method(tensor_transport=...)`` swapped for ``@tw.method``."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import torch
from torch.utils import _pytree

import tensorwire as tw


class Box:
    """A container of the user's own, registered with torch's pytree utilities."""

    def __init__(self, first, second, tag: str) -> None:
        self.first, self.second, self.tag = first, second, tag


_pytree.register_pytree_node(Box, lambda b: ([b.first, b.second], b.tag), lambda ch, tag: Box(ch[0], ch[1], tag))


def doubled(value):
    """``value`` with every tensor and number doubled, structure kept (lists, dicts, Box, TensorDict)."""
    if isinstance(value, (list, tuple)):
        return type(value)(doubled(v) for v in value)
    if isinstance(value, dict):
        return {k: doubled(v) for k, v in value.items()}
    if isinstance(value, Box):
        return Box(doubled(value.first), doubled(value.second), value.tag)
    if type(value).__name__ == "TensorDict":
        return value.apply(lambda t: t * 2)
    return value * 2


@tw.remote(num_cpus=0, max_concurrency=4)
class Echo:
    def __init__(self) -> None:
        self.last = None

    @tw.method
    def echo(self, data):
        self.last = data
        return data

    def plain_echo(self, data):  # undecorated: by reference only with .options(tensor_transport=...)
        return data

    def double(self, data):
        return doubled(data)

    def add(self, a, b):
        return a + b

    def types(self, data) -> list[str]:
        return [type(v).__name__ for v in data] if isinstance(data, (list, tuple)) else [type(data).__name__]

    @tw.method
    def make(self, nbytes: int, fill: int):
        self.last = torch.full((nbytes,), fill, dtype=torch.uint8)
        return self.last

    def fill_last(self, value: int) -> None:
        self.last.fill_(value)

    @tw.method
    def fail(self, message: str):
        raise RuntimeError(message)

    def fail_on(self, data, message: str):
        raise RuntimeError(f"{message}: got {tuple(data.shape)}")

    @tw.method
    def slow(self, seconds: float, nbytes: int):
        time.sleep(seconds)
        return torch.ones(nbytes, dtype=torch.uint8)

    def wait_freed(self, timeout_s: float) -> str:
        """Wait until no reference to the last returned tensor is left (RDT's wait_tensor_freed)."""
        try:
            tw.wait_tensor_freed(self.last, timeout_s=timeout_s)
        except tw.TransferTimeoutError as e:
            return type(e).__name__
        return "freed"

    def owned(self) -> int:
        from tensorwire.transport.agent.core import get_agent

        get_agent().flush()
        return get_agent().owned_objects()

    def pid(self) -> int:
        return os.getpid()


@tw.remote(num_cpus=0)
class AsyncEcho:
    """An async actor: tensorwire itself must not call a blocking ``ray.get`` in it."""

    def __init__(self) -> None:
        self.records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: self.records.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("ray").addHandler(handler)

    @tw.method
    async def make(self, nbytes: int, fill: int):
        await asyncio.sleep(0.01)
        return torch.full((nbytes,), fill, dtype=torch.uint8)

    async def total(self, value) -> int:
        return int(value.sum())

    async def total_nested(self, holder) -> int:
        return int(holder["ref"].sum())

    async def await_nested(self, holder) -> int:
        value = await tw.get_async(holder["ref"])
        return int(value.sum())

    async def blocking_get(self) -> int:
        """The user's own blocking ray.get: Ray warns (the control that the detector sees it)."""
        import ray

        return ray.get(ray.put(1))

    async def warnings(self) -> list[str]:
        return [m for m in self.records if "blocking ray.get" in m]


@tw.remote(num_cpus=0)
class Weights:
    """A trainer or receiver that exposes its weights through ``state_dict()`` (WeightSync's default)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.net = torch.nn.Linear(64, 32)

    def state_dict(self):
        return self.net.state_dict()

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.net.parameters()))


@tw.remote(num_cpus=0)
class ModelOnly:
    """A receiver with only a ``model`` attribute (the fallback default)."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(64, 32)
        torch.nn.init.zeros_(self.model.weight)

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.parameters()))
