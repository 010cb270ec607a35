"""A trainer and an inference engine with its own loader, as engines load weights: the engine
fuses q/k/v into one transposed matrix and keeps other names."""

from __future__ import annotations

import torch
from torch import nn

import tensorwire as tw

DIM = 16


class Attention(nn.Module):
    """The trainer's model: separate q, k, v, o projections and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.norm = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.norm
        scores = torch.softmax(self.q(x) @ self.k(x).T, dim=-1)
        return self.o(scores @ self.v(x))


@tw.remote(num_cpus=0)
class Trainer:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = Attention()

    def step(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@tw.remote(num_cpus=0)
class Engine:
    """Holds ``qkv_t`` ([q; k; v] transposed, (DIM, 3 DIM)), ``out`` and ``scale``; takes the
    trainer's names through :meth:`load_weights` (declared by :meth:`checkpoint_layout`)."""

    def __init__(self) -> None:
        self.qkv_t = torch.zeros(DIM, 3 * DIM)
        self.out = torch.zeros(DIM, DIM)
        self.scale = torch.zeros(DIM)
        self.loads: list[tuple[list[str], bool]] = []  # (names fed, whether the fence was held)

    def checkpoint_layout(self) -> dict[str, torch.Tensor]:
        """What the loader takes, in the trainer's names: shapes and dtypes only (meta tensors)."""
        names = ["q.weight", "k.weight", "v.weight", "o.weight"]
        layout = {n: torch.empty(DIM, DIM, device="meta") for n in names}
        return layout | {"norm": torch.empty(DIM, device="meta")}

    def load_weights(self, weights) -> None:
        names = []
        for name, tensor in weights:
            names.append(name)
            if name[0] in "qkv" and name.endswith(".weight"):
                part = "qkv".index(name[0])
                self.qkv_t[:, part * DIM : (part + 1) * DIM].copy_(tensor.T)  # fused and transposed
            elif name == "o.weight":
                self.out.copy_(tensor)
            elif name == "norm":
                self.scale.copy_(tensor)
            else:
                raise KeyError(name)
        self.loads.append((names, tw.collective.weight_fence("weights").locked()))

    def loads_seen(self) -> list[tuple[list[str], bool]]:
        return list(self.loads)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        q, k, v = (x @ self.qkv_t).chunk(3, dim=-1)
        return (torch.softmax(q @ k.T, dim=-1) @ v) @ self.out.T
