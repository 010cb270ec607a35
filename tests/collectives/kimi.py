"""Kimi-K2-like layouts (shapes only, no tensors) for the plan-at-scale test and benchmark.

61 layers (the first dense, 60 MoE with 384 experts of 3 matrices and one shared expert), MLA
attention, 163,840-token vocabulary: about 1.03 T parameters in about 70,000 tensors.

Trainers (256 ranks, BF16): a (dp=2, ep=128) mesh: each expert lives whole on one ep rank (3
per rank), replicated over dp; dense matrices Shard(0) over groups of 8 ranks (HSDP: sharded
inside a node, replicated across the 32 nodes); norms and biases whole on every rank.
Receivers (128 ranks, 2 replicas x 64): experts 6 per rank (EP 64), attention and dense MLP
tensor-parallel over 8 ranks (column-parallel Shard(0), row-parallel Shard(1)), each TP group
repeated 8 times per replica (attention data parallel); norms replicated.
"""

from __future__ import annotations

from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece, Replicate, Shard, placement_box

HIDDEN, LAYERS, EXPERTS, MOE_INTER, DENSE_INTER, VOCAB = 7168, 61, 384, 2048, 18432, 163840
TRAINERS, TRAINER_EP, TRAINER_SHARD = 256, 128, 8
REPLICAS, RANKS_PER_REPLICA, TP = 2, 64, 8


def dense_shapes() -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind): kind "col" (Shard(0) on receivers), "row" (Shard(1)), "norm"."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "embed_tokens.weight": ((VOCAB, HIDDEN), "col"),
        "lm_head.weight": ((VOCAB, HIDDEN), "col"),
        "norm.weight": ((HIDDEN,), "norm"),
    }
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        shapes |= {
            p + "self_attn.q_a_proj.weight": ((1536, HIDDEN), "col"),
            p + "self_attn.q_a_layernorm.weight": ((1536,), "norm"),
            p + "self_attn.q_b_proj.weight": ((64 * 192, 1536), "col"),
            p + "self_attn.kv_a_proj_with_mqa.weight": ((576, HIDDEN), "col"),
            p + "self_attn.kv_a_layernorm.weight": ((512,), "norm"),
            p + "self_attn.kv_b_proj.weight": ((64 * 256, 512), "col"),
            p + "self_attn.o_proj.weight": ((HIDDEN, 64 * 128), "row"),
            p + "input_layernorm.weight": ((HIDDEN,), "norm"),
            p + "post_attention_layernorm.weight": ((HIDDEN,), "norm"),
        }
        if layer == 0:
            shapes |= {
                p + "mlp.gate_proj.weight": ((DENSE_INTER, HIDDEN), "col"),
                p + "mlp.up_proj.weight": ((DENSE_INTER, HIDDEN), "col"),
                p + "mlp.down_proj.weight": ((HIDDEN, DENSE_INTER), "row"),
            }
        else:
            shapes |= {
                p + "mlp.gate.weight": ((EXPERTS, HIDDEN), "norm"),
                p + "mlp.gate.e_score_correction_bias": ((EXPERTS,), "norm"),
                p + "mlp.shared_experts.gate_proj.weight": ((MOE_INTER, HIDDEN), "col"),
                p + "mlp.shared_experts.up_proj.weight": ((MOE_INTER, HIDDEN), "col"),
                p + "mlp.shared_experts.down_proj.weight": ((HIDDEN, MOE_INTER), "row"),
            }
    return shapes


def expert_shapes(experts: range) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for layer in range(1, LAYERS):
        for e in experts:
            p = f"layers.{layer}.mlp.experts.{e}."
            shapes[p + "gate_proj.weight"] = (MOE_INTER, HIDDEN)
            shapes[p + "up_proj.weight"] = (MOE_INTER, HIDDEN)
            shapes[p + "down_proj.weight"] = (HIDDEN, MOE_INTER)
    return shapes


def trainer_layouts(dtype: str = "bfloat16") -> list[list[ParamPiece]]:
    dense = dense_shapes()
    per_ep = EXPERTS // TRAINER_EP
    boxes: dict[tuple[str, int], Box] = {}  # one Box object per distinct piece, shared by replicas
    layouts = []
    for rank in range(TRAINERS):
        ep = rank % TRAINER_EP
        shard = rank % TRAINER_SHARD
        layout = []
        for name, (shape, kind) in dense.items():
            if kind == "norm":
                box = boxes.setdefault((name, -1), Box.full(shape))
            else:
                box = boxes.get((name, shard)) or boxes.setdefault(
                    (name, shard), placement_box(shape, [Shard(0)], [TRAINER_SHARD], [shard])
                )
            layout.append(ParamPiece(name, shape, dtype, box))
        for name, shape in expert_shapes(range(ep * per_ep, (ep + 1) * per_ep)).items():
            layout.append(ParamPiece(name, shape, dtype, boxes.setdefault((name, -1), Box.full(shape))))
        layouts.append(layout)
    return layouts


def receiver_layouts(dtype: str = "bfloat16") -> list[list[ParamPiece]]:
    dense = dense_shapes()
    per_rank = EXPERTS // RANKS_PER_REPLICA
    layouts = []
    for _replica in range(REPLICAS):
        for rank in range(RANKS_PER_REPLICA):
            tp = rank % TP
            layout = []
            for name, (shape, kind) in dense.items():
                placement = {"col": Shard(0), "row": Shard(1), "norm": Replicate()}[kind]
                box = placement_box(shape, [placement], [TP], [tp])
                layout.append(ParamPiece(name, shape, dtype, box))  # placements are only needed for fused ones
            for name, shape in expert_shapes(range(rank * per_rank, (rank + 1) * per_rank)).items():
                layout.append(ParamPiece(name, shape, dtype, Box.full(shape)))
            layouts.append(layout)
    return layouts
