"""Sharded weight sync: 2 trainer shards -> 2 inference replicas of 2 tensor-parallel ranks.

* A small transformer language model (torch.nn: embeddings, causal attention with separate
  q/k/v/o projections, a SwiGLU MLP with separate gate/up/down, RMS norms) learns a toy task:
  predict the next token of sequences that count up modulo the vocabulary.
* Training: 2 trainer actors, each holding half (rows) of every parameter, FSDP-style: before
  each step they all-gather the full parameters (``tw.collective`` over gloo), compute the
  gradient on their own batch, average it, and each updates its own half.
* Inference: 4 receiver actors form 2 replicas x tensor parallel 2, with the layout inference
  engines use: fused ``qkv_proj`` (each rank's q, k and v heads, interleaved) and
  ``gate_up_proj``, column-parallel in, row-parallel out (``o_proj``, ``down_proj``, with an
  all-reduce per replica), other parameter names, replicated norms and embeddings.
* After every step ``sync.push()`` moves each receiver exactly its bytes, straight from the two
  trainers' halves (no gather on a trainer); then each replica's output on a fixed input is
  checked against the trainers' full model.

Run: ``python examples/rl_sharded_sync.py`` (CPU, no downloads; about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import tensorwire as tw
from tensorwire.collectives import Fuse, Replicate, Shard, Sharded

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ = 32, 64, 4, 128, 2, 16
TP, REPLICAS, TRAINERS = 2, 2, 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention of (batch, seq, heads * head_dim) inputs."""
    b, t, _ = q.shape
    q, k, v = (z.view(b, t, heads, -1).transpose(1, 2) for z in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, t, -1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.Parameter(torch.ones(DIM)), nn.Parameter(torch.ones(DIM))
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.norm1)
        x = x + self.o(attention(self.q(h), self.k(h), self.v(h), HEADS))
        h = rms_norm(x, self.norm2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    """The trainers' model (the names the trainers know)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.ones(DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(rms_norm(x, self.norm))


def batch(seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, VOCAB, (size, 1), generator=torch.Generator().manual_seed(seed))
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


@tw.remote
class Trainer:
    """One of the trainer ranks: keeps its half (rows) of every parameter."""

    def __init__(self, rank: int) -> None:
        torch.manual_seed(0)  # the same initial model on every rank; each keeps its half
        self.rank, self.model = rank, TinyLM()
        self.halves = {n: p.detach().chunk(TRAINERS)[rank].clone() for n, p in self.model.named_parameters()}
        for half in self.halves.values():
            half.requires_grad_(True)
        self.optimizer = torch.optim.Adam(self.halves.values(), lr=3e-3)

    def state_dict(self) -> dict[str, Sharded]:
        """What WeightSync reads: its halves, described as Shard(0) of the whole parameters."""
        shapes = {n: p.shape for n, p in self.model.named_parameters()}
        return {
            n: Sharded.of(h.detach(), [Shard(0)], (TRAINERS,), (self.rank,), shapes[n]) for n, h in self.halves.items()
        }

    def _gather(self) -> None:
        group = tw.collective.get_group("trainers")
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                half = self.halves[name].detach()
                parts = [torch.empty_like(half) for _ in range(TRAINERS)]
                group.all_gather(parts, half.contiguous())
                param.copy_(torch.cat(parts))

    def step(self, iteration: int) -> float:
        self._gather()
        tokens, targets = batch(1000 * iteration + self.rank)
        loss = F.cross_entropy(self.model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        self.model.zero_grad()
        loss.backward()
        group = tw.collective.get_group("trainers")
        for name, param in self.model.named_parameters():
            grad = param.grad.contiguous()
            group.all_reduce(grad, op="avg")
            self.halves[name].grad = grad.chunk(TRAINERS)[self.rank].clone()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.detach())

    def reference(self, tokens: torch.Tensor) -> torch.Tensor:
        """The full model's logits now (every trainer calls it: the parameters are gathered)."""
        self._gather()
        with torch.no_grad():
            return self.model(tokens)


def rename(name: str) -> str:
    """Trainer names -> the inference engine's (q/k/v and gate/up go into fused ones: ``fused()``)."""
    fixed = {"embed.weight": "tok_embeddings.weight", "head.weight": "output.weight", "norm": "final_norm.weight"}
    if name in fixed:
        return fixed[name]
    prefix, _, rest = name.partition(".")  # "blocks.<i>.<rest>"
    layer, _, rest = rest.partition(".")
    theirs = {
        "norm1": "input_layernorm.weight",
        "norm2": "post_attention_layernorm.weight",
        "o.weight": "self_attn.o_proj.weight",
        "down.weight": "mlp.down_proj.weight",
    }
    return f"layers.{layer}.{theirs[rest]}" if prefix == "blocks" and rest in theirs else name


def fused() -> dict[str, Fuse]:
    result = {}
    for i in range(LAYERS):
        result[f"layers.{i}.self_attn.qkv_proj.weight"] = Fuse(tuple(f"blocks.{i}.{p}.weight" for p in "qkv"))
        result[f"layers.{i}.mlp.gate_up_proj.weight"] = Fuse((f"blocks.{i}.gate.weight", f"blocks.{i}.up.weight"))
    return result


def mark_served(rank: InferenceRank, version: int) -> None:
    """The sync's ``on_commit`` hook, run in each receiver once a version is its own (a plain
    function of this script: the sync ships it by value)."""
    rank.served = version


@tw.remote
class InferenceRank:
    """Tensor-parallel rank ``tp`` of replica ``replica``: its own parameters, other names."""

    def __init__(self, replica: int, tp: int) -> None:
        self.replica, self.tp = replica, tp
        self.served = 0  # the weight version it serves (set by mark_served)
        heads = HEADS // TP
        self.weights: dict[str, torch.Tensor] = {
            "tok_embeddings.weight": torch.zeros(VOCAB, DIM),
            "output.weight": torch.zeros(VOCAB, DIM),
            "final_norm.weight": torch.zeros(DIM),
        }
        for i in range(LAYERS):
            p = f"layers.{i}."
            self.weights |= {
                p + "input_layernorm.weight": torch.zeros(DIM),
                p + "post_attention_layernorm.weight": torch.zeros(DIM),
                p + "self_attn.qkv_proj.weight": torch.zeros(3 * heads * DIM // HEADS, DIM),  # [its q; its k; its v]
                p + "self_attn.o_proj.weight": torch.zeros(DIM, DIM // TP),  # row parallel: its input columns
                p + "mlp.gate_up_proj.weight": torch.zeros(2 * HIDDEN // TP, DIM),  # [its gate; its up]
                p + "mlp.down_proj.weight": torch.zeros(DIM, HIDDEN // TP),
            }

    def state_dict(self) -> dict[str, Sharded]:
        mesh, coord = (REPLICAS, TP), (self.replica, self.tp)
        result = {}
        for name, tensor in self.weights.items():
            if "qkv_proj" in name or "gate_up_proj" in name:
                rows = 3 * DIM if "qkv" in name else 2 * HIDDEN
                result[name] = Sharded.of(tensor, [Replicate(), Shard(0)], mesh, coord, (rows, DIM))
            elif "o_proj" in name or "down_proj" in name:
                result[name] = Sharded.of(tensor, [Replicate(), Shard(1)], mesh, coord)
            else:
                result[name] = Sharded.of(tensor, [Replicate(), Replicate()], mesh, coord)
        return result

    def served_version(self) -> int:
        return self.served

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the replica (both of its ranks call this at once: two all-reduces per layer)."""
        group, w, heads = tw.collective.get_group(f"replica{self.replica}"), self.weights, HEADS // TP
        x = F.embedding(tokens, w["tok_embeddings.weight"])
        for i in range(LAYERS):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"])
            q, k, v = (h @ w[p + "self_attn.qkv_proj.weight"].T).chunk(3, dim=-1)
            partial = attention(q, k, v, heads) @ w[p + "self_attn.o_proj.weight"].T
            group.all_reduce(partial)
            x = x + partial
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
            gate, up = (h @ w[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
            partial = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
            group.all_reduce(partial)
            x = x + partial
        return rms_norm(x, w["final_norm.weight"]) @ w["output.weight"].T


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    tw.init(include_dashboard=False)
    trainers = [Trainer.remote(rank) for rank in range(TRAINERS)]
    replicas = [[InferenceRank.remote(r, tp) for tp in range(TP)] for r in range(REPLICAS)]
    tw.collective.create_group(trainers, backend="gloo", name="trainers")
    for r, ranks in enumerate(replicas):
        tw.collective.create_group(ranks, backend="gloo", name=f"replica{r}")
    receivers = [rank for ranks in replicas for rank in ranks]
    sync = tw.WeightSync(
        trainers, receivers, rename=rename, fuse=fused(), bucket_bytes=64 << 10, progress=False, on_commit=mark_served
    )
    print(sync.plan)
    probe, _ = batch(seed=12345, size=4)
    worst = 0.0
    for step in range(1, args.steps + 1):
        loss = ray.get([t.step.remote(step) for t in trainers])[0]
        report = sync.push()
        if not report.ok:
            print(f"step {step}: push failed: {report.failed}", file=sys.stderr)
            return 1
        served = ray.get([rank.served_version.remote() for rank in receivers])
        if served != [report.version] * len(receivers):
            print(f"step {step}: on_commit saw versions {served}, not v{report.version}", file=sys.stderr)
            return 1
        expected = ray.get([t.reference.remote(probe) for t in trainers])[0]
        for r, ranks in enumerate(replicas):
            outputs = ray.get([rank.forward.remote(probe) for rank in ranks])
            error = max(float((out - expected).abs().max()) for out in outputs)
            worst = max(worst, error)
            if error > 1e-4:
                print(f"step {step}: replica {r} differs from the trainers' model by {error:.2e}", file=sys.stderr)
                return 1
        if step == 1 or step % 5 == 0:
            print(
                f"step {step:3d}  loss {loss:.3f}  push v{report.version}: {report.moved_nbytes / 1024:.0f} KiB "
                f"(plan {report.plan_nbytes / 1024:.0f} KiB) in {report.seconds * 1e3:.1f} ms; replicas match "
                f"the trainers (max |diff| {worst:.1e})"
            )
    print(f"done: {args.steps} pushes, every replica matched the trainers' model after each (max |diff| {worst:.1e})")
    print(f"on_commit (a function of this script) marked every receiver: serving v{served[0]}")
    sync.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
