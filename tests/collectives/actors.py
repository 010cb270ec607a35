"""Actors of the collective and weight-sync tests."""

from __future__ import annotations

import os
import time

import torch

import tensorwire as tw


def member_input(rank: int, shape: tuple[int, ...] = (6, 5), dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, so sums and products are exact in any order."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype)


@tw.remote(num_cpus=0)
class Member:
    """A member that runs one collective of a group on its ``member_input`` and returns the result."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def pid(self) -> int:
        return os.getpid()

    def groups(self) -> list[str]:
        return tw.collective.group_names()

    def run(self, name: str, op: str, **kwargs):
        group = tw.collective.get_group(name)
        world = group.world_size
        mine = member_input(self.rank)
        if op == "broadcast":
            group.broadcast(mine, kwargs["src"])
            return mine
        if op == "broadcast_transposed":  # a non-contiguous tensor, changed in place
            view = mine.t()
            group.broadcast(view, kwargs["src"])
            return view
        if op == "all_reduce":
            group.all_reduce(mine, op=kwargs.get("reduce", "sum"))
            return mine
        if op == "all_gather":
            out = [torch.empty_like(mine) for _ in range(world)]
            group.all_gather(out, mine)
            return out
        if op == "reduce_scatter":
            inputs = [member_input(self.rank * world + r) for r in range(world)]
            out = torch.empty_like(inputs[0])
            group.reduce_scatter(out, inputs, op=kwargs.get("reduce", "sum"))
            return out
        if op == "barrier":
            time.sleep(0.3 * self.rank)
            group.barrier()
            return time.time()
        if op == "send":
            group.send(mine * 10, kwargs["dst"], tag=kwargs.get("tag", 0))
            return None
        if op == "recv":
            out = torch.zeros_like(mine)
            group.recv(out, kwargs["src"], tag=kwargs.get("tag", 0))
            return out
        raise ValueError(op)

    def run_catching(self, name: str, op: str, **kwargs):
        start = time.monotonic()
        try:
            self.run(name, op, **kwargs)
        except Exception as e:
            return type(e).__name__, str(e), time.monotonic() - start
        return None, "", time.monotonic() - start


@tw.remote(num_cpus=0)
class Holder:
    """Trainer or receiver of weight-sync tests: a dict of tensors (``weights``)."""

    def __init__(self, num_tensors: int, total_nbytes: int, seed: int | None) -> None:
        per = max(1, total_nbytes // num_tensors // 4)
        gen = torch.Generator().manual_seed(seed or 0)
        make = (lambda: torch.randn(per, generator=gen)) if seed is not None else (lambda: torch.zeros(per))
        self.weights = {f"layer{i}.weight": make() for i in range(num_tensors)}

    def pid(self) -> int:
        return os.getpid()

    def sizes(self) -> list[int]:
        return [t.numel() * t.element_size() for t in self.weights.values()]

    def data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.weights.values()]

    def digest(self) -> str:
        from tests.helpers.tasks import digest

        return digest(self.weights)

    def step(self, seed: int) -> None:
        """Change every weight in place, like an optimizer step."""
        gen = torch.Generator().manual_seed(seed)
        for tensor in self.weights.values():
            tensor.add_(torch.randn(tensor.shape, generator=gen))

    def reshape_first(self) -> None:
        """Break the layout the sync was made with."""
        self.weights["layer0.weight"] = torch.zeros(3)

    def version(self, name: str = "weights") -> int:
        return tw.collective.weight_version(name)
