"""Layouts of published models for :mod:`.simulate` and ``tensorwire plan`` (shapes only, no
tensors): a Kimi-K2-like MoE (the 1 T push the field quotes), a Qwen3-235B-like MoE and a dense
70B, each with a trainer layout and an inference layout that people run (stated per template).

Trainers: dense matrices ``Shard(0)`` over groups of ``trainer_shard`` ranks (FSDP inside a
group, replicated across groups: HSDP), experts whole, ``experts / trainer_ep`` per rank
(replicated over ``trainer_ranks / trainer_ep``), norms whole everywhere. Receivers:
``replicas`` of ``ranks_per_replica`` ranks, attention and dense MLP tensor-parallel over
``tp`` ranks (column-parallel ``Shard(0)``, row-parallel ``Shard(1)``), experts
``experts / ranks_per_replica`` per rank, norms replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece, Replicate, Shard, placement_box

__all__ = ["TEMPLATES", "Template"]

Shapes = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, "col" | "row" | "norm" | "expert")


@dataclass(frozen=True)
class Template:
    """A model and the layouts it is trained and served in (see the module doc)."""

    name: str
    about: str
    shapes: Callable[[], Shapes]
    experts: int
    trainer_ranks: int
    trainer_shard: int
    trainer_ep: int
    replicas: int
    ranks_per_replica: int
    tp: int
    dtype: str = "bfloat16"
    receiver_dtype: str = "bfloat16"

    def trainer_layouts(self) -> list[list[ParamPiece]]:
        dense, experts = _split(self.shapes())
        per_ep = self.experts // self.trainer_ep if self.experts else 0
        boxes: dict[tuple[str, int], Box] = {}  # one Box per distinct piece, shared by the ranks holding it
        layouts = []
        for rank in range(self.trainer_ranks):
            ep, shard = rank % max(self.trainer_ep, 1), rank % self.trainer_shard
            layout = []
            for name, (shape, kind) in dense.items():
                key = (name, -1 if kind == "norm" else shard)
                box = boxes.get(key)
                if box is None:
                    whole = kind == "norm"
                    box = boxes[key] = (
                        Box.full(shape) if whole else placement_box(shape, [Shard(0)], [self.trainer_shard], [shard])
                    )
                layout.append(ParamPiece(name, shape, self.dtype, box))
            for e in range(per_ep * ep, per_ep * (ep + 1)):
                for name, shape in experts[e]:
                    layout.append(ParamPiece(name, shape, self.dtype, boxes.setdefault((name, -1), Box.full(shape))))
            layouts.append(layout)
        return layouts

    def receiver_layouts(self) -> list[list[ParamPiece]]:
        dense, experts = _split(self.shapes())
        per_rank = self.experts // self.ranks_per_replica if self.experts else 0
        placements = {"col": Shard(0), "row": Shard(1), "norm": Replicate()}
        layouts = []
        for _replica in range(self.replicas):
            for rank in range(self.ranks_per_replica):
                tp = rank % self.tp
                layout = [
                    ParamPiece(
                        name, shape, self.receiver_dtype, placement_box(shape, [placements[kind]], [self.tp], [tp])
                    )
                    for name, (shape, kind) in dense.items()
                ]
                for e in range(per_rank * rank, per_rank * (rank + 1)):
                    layout += [
                        ParamPiece(name, shape, self.receiver_dtype, Box.full(shape)) for name, shape in experts[e]
                    ]
                layouts.append(layout)
        return layouts

    @property
    def receivers(self) -> int:
        return self.replicas * self.ranks_per_replica


def _split(shapes: Shapes) -> tuple[Shapes, dict[int, list[tuple[str, tuple[int, ...]]]]]:
    """The dense parameters, and the expert matrices by expert number (every layer's)."""
    dense: Shapes = {}
    experts: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for name, (shape, kind) in shapes.items():
        if kind == "expert":  # layers.L.mlp.experts.E.<matrix>
            experts.setdefault(int(name.split(".experts.", 1)[1].split(".", 1)[0]), []).append((name, shape))
        else:
            dense[name] = (shape, kind)
    return dense, experts


def _experts(layers: range, experts: int, hidden: int, inter: int) -> Shapes:
    shapes: Shapes = {}
    for layer in layers:
        for e in range(experts):
            p = f"layers.{layer}.mlp.experts.{e}."
            shapes[p + "gate_proj.weight"] = ((inter, hidden), "expert")
            shapes[p + "up_proj.weight"] = ((inter, hidden), "expert")
            shapes[p + "down_proj.weight"] = ((hidden, inter), "expert")
    return shapes


def _gqa(p: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> Shapes:
    return {
        p + "self_attn.q_proj.weight": ((heads * head_dim, hidden), "col"),
        p + "self_attn.k_proj.weight": ((kv_heads * head_dim, hidden), "col"),
        p + "self_attn.v_proj.weight": ((kv_heads * head_dim, hidden), "col"),
        p + "self_attn.o_proj.weight": ((hidden, heads * head_dim), "row"),
        p + "input_layernorm.weight": ((hidden,), "norm"),
        p + "post_attention_layernorm.weight": ((hidden,), "norm"),
    }


def _dense_mlp(p: str, hidden: int, inter: int) -> Shapes:
    return {
        p + "mlp.gate_proj.weight": ((inter, hidden), "col"),
        p + "mlp.up_proj.weight": ((inter, hidden), "col"),
        p + "mlp.down_proj.weight": ((hidden, inter), "row"),
    }


def _ends(hidden: int, vocab: int) -> Shapes:
    return {
        "embed_tokens.weight": ((vocab, hidden), "col"),
        "lm_head.weight": ((vocab, hidden), "col"),
        "norm.weight": ((hidden,), "norm"),
    }


def kimi_k2_shapes() -> Shapes:
    """61 layers (the first dense, 60 MoE with 384 experts of 3 matrices and one shared
    expert), MLA attention, a 163,840-token vocabulary: about 1.03 T parameters."""
    hidden, inter, moe_inter, experts = 7168, 18432, 2048, 384
    shapes = _ends(hidden, 163840)
    for layer in range(61):
        p = f"layers.{layer}."
        shapes |= {
            p + "self_attn.q_a_proj.weight": ((1536, hidden), "col"),
            p + "self_attn.q_a_layernorm.weight": ((1536,), "norm"),
            p + "self_attn.q_b_proj.weight": ((64 * 192, 1536), "col"),
            p + "self_attn.kv_a_proj_with_mqa.weight": ((576, hidden), "col"),
            p + "self_attn.kv_a_layernorm.weight": ((512,), "norm"),
            p + "self_attn.kv_b_proj.weight": ((64 * 256, 512), "col"),
            p + "self_attn.o_proj.weight": ((hidden, 64 * 128), "row"),
            p + "input_layernorm.weight": ((hidden,), "norm"),
            p + "post_attention_layernorm.weight": ((hidden,), "norm"),
        }
        if layer == 0:
            shapes |= _dense_mlp(p, hidden, inter)
        else:
            shapes |= {
                p + "mlp.gate.weight": ((experts, hidden), "norm"),
                p + "mlp.gate.e_score_correction_bias": ((experts,), "norm"),
                p + "mlp.shared_experts.gate_proj.weight": ((moe_inter, hidden), "col"),
                p + "mlp.shared_experts.up_proj.weight": ((moe_inter, hidden), "col"),
                p + "mlp.shared_experts.down_proj.weight": ((hidden, moe_inter), "row"),
            }
    return shapes | _experts(range(1, 61), experts, hidden, moe_inter)


def qwen3_235b_shapes() -> Shapes:
    """94 layers of GQA attention (64 query heads, 4 key/value heads of 128) and 128 experts of
    1,536 (no shared expert), a 151,936-token vocabulary: about 235 B parameters."""
    hidden, experts = 4096, 128
    shapes = _ends(hidden, 151936)
    for layer in range(94):
        p = f"layers.{layer}."
        shapes |= _gqa(p, hidden, 64, 4, 128) | {p + "mlp.gate.weight": ((experts, hidden), "norm")}
    return shapes | _experts(range(94), experts, hidden, 1536)


def dense_70b_shapes() -> Shapes:
    """A Llama-3-70B-like dense model: 80 layers, GQA (64 query heads, 8 key/value heads of 128),
    an MLP of 28,672, a 128,256-token vocabulary: about 70.6 B parameters."""
    hidden = 8192
    shapes = _ends(hidden, 128256)
    for layer in range(80):
        p = f"layers.{layer}."
        shapes |= _gqa(p, hidden, 64, 8, 128) | _dense_mlp(p, hidden, 28672)
    return shapes


TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template(
            "kimi-k2",
            "Kimi-K2-like, 256 BF16 trainer ranks (dp 2 x ep 128, dense HSDP over 8) -> 2 replicas x 64 "
            "inference ranks (TP 8, EP 64), Perplexity's published shape; receivers BF16 (a float8 "
            "receiver gets BF16 on the wire and quantises, as the plan does)",
            kimi_k2_shapes,
            experts=384,
            trainer_ranks=256,
            trainer_shard=8,
            trainer_ep=128,
            replicas=2,
            ranks_per_replica=64,
            tp=8,
        ),
        Template(
            "qwen3-235b",
            "Qwen3-235B-like, 32 BF16 trainer ranks (FSDP over 8 per node, ep 32) -> 4 replicas x 8 "
            "inference ranks (TP 8, EP 8): 4 nodes each way (an assumed shape for vLLM's 4-node run)",
            qwen3_235b_shapes,
            experts=128,
            trainer_ranks=32,
            trainer_shard=8,
            trainer_ep=32,
            replicas=4,
            ranks_per_replica=8,
            tp=8,
        ),
        Template(
            "dense-70b",
            "dense 70B, 64 BF16 trainer ranks (FSDP over 8 per node) -> 8 replicas x TP 8",
            dense_70b_shapes,
            experts=0,
            trainer_ranks=64,
            trainer_shard=8,
            trainer_ep=1,
            replicas=8,
            ranks_per_replica=8,
            tp=8,
        ),
    )
}
