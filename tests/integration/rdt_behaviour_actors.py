"""Actors for the Ray-RDT behaviour suite on ``tensor_transport="tensorwire"``: plain Ray
actors shaped like the ones Ray's own direct-transport tests use."""

from __future__ import annotations

import asyncio
import os
import threading

import ray
import torch

import tensorwire as tw
from tests.integration.ray_transport_actors import this_process_manager

tw.register_ray_transport()


@ray.remote(num_cpus=0, max_concurrency=4, enable_tensor_transport=True)
class Worker:
    def __init__(self) -> None:
        self.saved: torch.Tensor | None = None
        self.attempts = 0
        self.release = threading.Event()

    @ray.method(tensor_transport="tensorwire")
    def echo(self, data):
        return data

    @ray.method(tensor_transport="tensorwire")
    def save(self, numel: int) -> torch.Tensor:
        self.saved = torch.full((numel,), 1.0)
        return self.saved

    def increment_saved(self, timeout_s: float) -> float:
        """Write into the returned tensor once every reference to it is gone."""
        ray.experimental.wait_tensor_freed(self.saved, timeout=timeout_s)
        self.saved += 1
        return float(self.saved.sum())

    @ray.method(tensor_transport="tensorwire")
    def fail(self, message: str):
        raise ValueError(message)

    @ray.method(tensor_transport="tensorwire", max_task_retries=1, retry_exceptions=[ValueError])
    def flaky(self, failures: int) -> torch.Tensor:
        self.attempts += 1
        if self.attempts <= failures:
            raise ValueError(f"attempt {self.attempts} fails")
        return torch.tensor([1.0, 2.0, 3.0])

    @ray.method(tensor_transport="tensorwire")
    def block_then_make(self, numel: int) -> torch.Tensor:
        self.release.wait(120)
        return torch.ones(numel)

    def busy(self, seconds: float) -> bool:
        """Keep this actor's threads busy in Python (the transfer must not need them)."""
        self.release.wait(seconds)
        return True

    def unblock(self) -> None:
        self.release.set()

    def double(self, data):
        if isinstance(data, torch.Tensor):
            return data * 2
        if isinstance(data, (list, tuple)):
            return type(data)(self.double(v) for v in data)
        if isinstance(data, dict):
            return {k: self.double(v) for k, v in data.items()}
        return data * 2

    def add(self, a, b):
        return a + b

    def increment(self, data: torch.Tensor) -> torch.Tensor:
        data += 1
        return data

    def lose(self, object_id: str) -> None:
        """Release the tensorwire object behind a reference while Ray still holds it (as if
        this process had lost it): a read must fail cleanly."""
        this_process_manager().garbage_collect(object_id, None, [])

    def published(self) -> int:
        return this_process_manager().published_count()

    def pid(self) -> int:
        return os.getpid()

    def make_pair_and_hand_over(self, numel: int) -> float:
        """This actor creates two actors and moves a tensor between them (not the driver)."""
        a, b = Worker.remote(), Worker.remote()
        return float(ray.get(b.double.remote(a.echo.remote(torch.ones(numel))), timeout=60).sum())


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class AsyncWorker:
    @ray.method(tensor_transport="tensorwire")
    async def send(self, numel: int) -> torch.Tensor:
        await asyncio.sleep(0)
        return torch.arange(numel, dtype=torch.float32)

    @ray.method(tensor_transport="tensorwire")
    async def forward(self, data: torch.Tensor) -> torch.Tensor:
        return data + 1

    async def total(self, data: torch.Tensor) -> tuple[float, str]:
        return float(data.sum()), str(data.device)
