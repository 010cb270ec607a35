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

    def weights_of(self, names: list[str]) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {n: state[n].clone() for n in names}


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


EXPERTS, HIDDEN = 8, (4, 6)  # 8 experts of 4 x 6


def global_experts(version: int) -> torch.Tensor:
    """Every expert's weights at ``version``: expert e is filled with 100 * version + e (and a
    ramp, so that rows and columns are told apart)."""
    ramp = torch.arange(HIDDEN[0] * HIDDEN[1], dtype=torch.float32).reshape(HIDDEN) / 100
    return torch.stack([ramp + 100 * version + e for e in range(EXPERTS)])


@tw.remote(num_cpus=0)
class ExpertTrainer:
    """Expert-parallel rank ``rank`` of ``ranks``: a contiguous block of the experts."""

    def __init__(self, rank: int, ranks: int) -> None:
        self.per = EXPERTS // ranks
        self.rank = rank
        self.version = 1
        self.block = global_experts(1)[rank * self.per : (rank + 1) * self.per].clone()

    def weights(self) -> dict:
        offsets = (self.rank * self.per, 0, 0)
        return {"experts": tw.collective.Sharded.at(self.block, (EXPERTS, *HIDDEN), offsets)}

    def step(self) -> None:
        self.version += 1
        self.block.copy_(global_experts(self.version)[self.rank * self.per : (self.rank + 1) * self.per])


@tw.remote(num_cpus=0)
class ExpertEngine:
    """An inference rank holding the experts its map names, slot by slot."""

    def __init__(self, experts: list[int]) -> None:
        self.experts = experts
        self.slots = torch.zeros(len(experts), *HIDDEN)

    def weights(self) -> dict:
        return {"experts": tw.collective.Sharded.experts(self.slots, self.experts, EXPERTS)}

    def holds(self, version: int) -> bool:
        """Whether every slot holds its expert as of ``version``."""
        return torch.equal(self.slots, global_experts(version)[self.experts])


@tw.remote(num_cpus=0)
class HalfEngine:
    """Tensor-parallel rank ``rank`` of 2 whose loader takes pieces: rows ``rank`` half of each
    projection (declared as ``Sharded`` meta tensors), loaded into its own buffers."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.rows = {n: torch.zeros(DIM // 2, DIM) for n in ("q.weight", "k.weight", "v.weight", "o.weight")}
        self.fed: list[tuple[str, tuple[int, ...]]] = []

    def checkpoint_layout(self) -> dict:
        piece = (DIM // 2, DIM)
        return {
            n: tw.collective.Sharded.of(torch.empty(piece, device="meta"), [tw.collective.Shard(0)], (2,), (self.rank,))
            for n in self.rows
        }

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.fed.append((name, tuple(tensor.shape)))
            self.rows[name].copy_(tensor)

    def pieces(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.rows.items()}

    def fed_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self.fed)
