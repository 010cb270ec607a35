"""Layouts and the weight-sync plan as pure metadata: boxes, coverage, errors naming the
parameter, load spreading, fused interleaving, streams, and the plan at Kimi-K2 scale."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tensorwire.collectives.weight_sync.planning.layout import (
    Box,
    ParamPiece,
    Replicate,
    Shard,
    Sharded,
    describe_value,
    placement_box,
)
from tensorwire.collectives.weight_sync.planning.plan import Fuse, NameMap, plan_sync


def held(name, shape, box=None, dtype="float32", placements=None, mesh=None, coord=None):
    return ParamPiece(name, tuple(shape), dtype, box or Box.full(shape), placements, mesh, coord)


def sharded(name, shape, placements, mesh, coord, dtype="float32"):
    return held(name, shape, placement_box(shape, placements, mesh, coord), dtype, tuple(placements), mesh, coord)


def test_shard_splits_like_torch_chunk_and_nested_mesh_dims_split_in_order():
    for size, parts in [(10, 4), (7, 3), (2, 4), (16, 4)]:
        pieces = torch.arange(size).chunk(parts)
        for index in range(parts):
            box = placement_box((size,), [Shard(0)], [parts], [index])
            expected = pieces[index].tolist() if index < len(pieces) else []
            assert torch.arange(size)[box.slices()].tolist() == expected
    box = placement_box((8, 6), [Shard(0), Shard(0)], [2, 2], [1, 0])  # rows 4:8, then its first half
    assert box == Box((4, 0), (2, 6))
    box = placement_box((8, 6), [Replicate(), Shard(1)], [2, 3], [1, 2])
    assert box == Box((0, 4), (8, 2))


def test_sharded_descriptions_and_their_errors():
    local = torch.zeros(2, 3)
    layout, tensors = describe_value({"w": Sharded.of(local, [Shard(0)], (4,), (3,)), "b": torch.ones(3)}, "source")
    assert layout[0].global_shape == (8, 3) and layout[0].box == Box((6, 0), (2, 3))
    assert layout[1].box == Box.full((3,)) and tensors[0].data_ptr() == local.data_ptr()
    with pytest.raises(ValueError, match=r"'w'.*does not fit the global shape"):
        describe_value({"w": Sharded.at(local, (3, 3), (2, 0))}, "source")
    with pytest.raises(TypeError, match="'x' is str"):
        describe_value({"x": "nope"}, "target")


def test_row_sharded_trainers_into_column_sharded_receivers():
    trainers = [[sharded("w", (8, 6), [Shard(0)], (2,), (t,))] for t in range(2)]
    receivers = [[sharded("w", (8, 6), [Shard(1)], (2,), (r,))] for r in range(2)]
    plan = plan_sync(trainers, receivers)
    for r in range(2):
        transfers = plan.receivers[r]
        assert [(t.trainer, t.src, t.dst) for t in transfers] == [
            (0, Box((0, 3 * r), (4, 3)), Box((0, 0), (4, 3))),
            (1, Box((0, 3 * r), (4, 3)), Box((4, 0), (4, 3))),
        ]
    assert plan.nbytes == 8 * 6 * 4 * 2 // 2 and plan.pair_nbytes() == {(t, r): 48 for t in range(2) for r in range(2)}
    text = str(plan)
    assert "2 trainer(s) -> 2 receiver(s)" in text and "192 B per push" in text


def test_a_gap_an_overlap_and_mismatches_name_the_parameter():
    half = [[held("w", (8, 4), Box((0, 0), (4, 4)))]]  # nobody holds rows 4:8
    with pytest.raises(ValueError, match=r"receiver 0's 'w': no trainer holds \[4:8, 0:4\] of 'w' \(gap\)"):
        plan_sync(half, [[held("w", (8, 4))]])
    two = [[held("a", (4,)), held("b", (4,))]]
    with pytest.raises(ValueError, match="'a' and 'b' both map to it \\(overlap\\)"):
        plan_sync(two, [[held("x", (4,))]], NameMap.build(rename={"a": "x", "b": "x"}))
    with pytest.raises(ValueError, match="receiver 0's 'c': no trainer parameter maps to it"):
        plan_sync(two, [[held("c", (4,))]])
    with pytest.raises(ValueError, match="receiver 0's 'a' has global shape \\[5\\], its source 'a' \\[4\\]"):
        plan_sync(two, [[held("a", (5,))]])
    with pytest.raises(ValueError, match="'a': cannot convert float32 to int32"):
        plan_sync(two, [[held("a", (4,), dtype="int32")]])
    with pytest.raises(ValueError, match="'a' is float8_e4m3fn: name its per-tensor scale"):
        plan_sync(two, [[held("a", (4,), dtype="float8_e4m3fn")]])
    with pytest.raises(ValueError, match="trainer parameter 'a': trainer 0 has \\[4\\] float32, trainer 1 \\[6\\]"):
        plan_sync([[held("a", (4,))], [held("a", (6,))]], [])
    wrong = held("w", (8, 4), Box((4, 0), (3, 4)), placements=(Shard(0),), mesh=(2,), coord=(1,))
    with pytest.raises(ValueError, match=r"receiver 0's 'w': its local piece \[4:7, 0:4\].*give .*\[4:8, 0:4\]"):
        plan_sync([[held("w", (8, 4))]], [[wrong]])
    with pytest.raises(ValueError, match="lists a part twice"):
        NameMap.build(fuse={"qkv": ["q", "q"]})


def test_pieces_held_by_several_trainers_are_read_from_different_ones():
    trainers = [[held(f"w{i}", (1024,)) for i in range(4)] for _ in range(2)]  # two data-parallel replicas
    receivers = [[held(f"w{i}", (1024,)) for i in range(4)] for _ in range(4)]
    plan = plan_sync(trainers, receivers)
    assert plan.trainer_nbytes() == [8 * 4096, 8 * 4096]
    assert plan.modelled_push_s(1.0) == pytest.approx(plan.bound_s(1.0))
    plan.remove_receiver(3)
    plan.remove_receiver(2)
    assert sum(plan.trainer_nbytes()) == 8 * 4096 and plan.nbytes == 8 * 4096
    plan.add_receiver(7, receivers[0])  # a new one: planned alone, the others kept
    assert sorted(plan.receivers) == [0, 1, 7] and sum(plan.trainer_nbytes()) == 12 * 4096


def test_fused_qkv_takes_each_ranks_rows_of_every_part():
    trainers = [[held("q", (8, 4)), held("k", (4, 4)), held("v", (4, 4))]]
    mapping = NameMap.build(fuse={"qkv": Fuse(("q", "k", "v"))})
    receivers = [[sharded("qkv", (16, 4), [Shard(0)], (2,), (r,))] for r in range(2)]
    plan = plan_sync(trainers, receivers, mapping)
    rank1 = [(t.source, str(t.src), str(t.dst)) for t in plan.receivers[1]]
    assert rank1 == [
        ("q", "[4:8, 0:4]", "[0:4, 0:4]"),
        ("k", "[2:4, 0:4]", "[4:6, 0:4]"),
        ("v", "[2:4, 0:4]", "[6:8, 0:4]"),
    ]
    bad = [[held("qkv", (15, 4))]]
    with pytest.raises(ValueError, match="parts \\['q', 'k', 'v'\\] add up to 16 along dim 0, it has 15"):
        plan_sync(trainers, bad, mapping)


def test_streams_share_identical_reads_and_cut_buckets():
    trainers = [[held(f"w{i}", (256,)) for i in range(8)]]
    receivers = [[held(f"w{i}", (256,)) for i in range(8)] for _ in range(3)]
    plan = plan_sync(trainers, receivers)
    (stream,) = plan.streams([0, 1, 2], bucket_bytes=2048)
    assert stream.readers == (0, 1, 2) and stream.buckets == [[0, 1], [2, 3], [4, 5], [6, 7]]
    (big,) = plan_sync([[held("w", (1024, 4))]], [[held("w", (1024, 4))]]).streams([0], bucket_bytes=4096)
    assert len(big.transfers[0]) == 4 and all(t.nbytes == 4096 for t in big.transfers[0])  # split by rows
    assert [t.src.offsets for t in big.transfers[0]] == [(0, 0), (256, 0), (512, 0), (768, 0)]


_SCALE = """
import json, math, resource, time
from tensorwire.collectives.weight_sync.model.cluster import Cluster, Placement
from tensorwire.collectives.weight_sync.model.flows import flows_of
from tensorwire.collectives.weight_sync.model.simulate import simulate
from tensorwire.collectives.weight_sync.model.templates import TEMPLATES
from tensorwire.collectives.weight_sync.planning.plan import plan_sync
start = time.perf_counter()
kimi = TEMPLATES["kimi-k2"]
trainers, receivers = kimi.trainer_layouts(), kimi.receiver_layouts()
described = time.perf_counter()
plan = plan_sync(trainers, receivers)
planned = time.perf_counter()
placement = Placement(Cluster(), len(trainers), len(receivers))  # H100 nodes: 8 GPUs, 8 x 400 Gb/s NICs
modelled = simulate(flows_of(plan, placement, 64 << 20), placement)
gbps = 50.0
needed = [sum(p.nbytes for p in layout) for layout in receivers]
print(json.dumps({
    "describe_s": described - start, "plan_s": planned - described, "model_s": time.perf_counter() - planned,
    "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "tensors": len({p.name for layout in trainers for p in layout}),
    "params": sum(math.prod(p.global_shape) for p in {q.name: q for t in trainers for q in t}.values()),
    "covered": plan.receiver_nbytes() == dict(enumerate(needed)),
    "modelled_s": plan.modelled_push_s(gbps), "bound_s": plan.bound_s(gbps),
    "links_modelled_s": modelled.seconds, "links_bound_s": modelled.bound_s,
    "busiest": str(modelled.busiest[0][0]),
    "trainer_spread": max(plan.trainer_nbytes()) / (plan.nbytes / len(trainers)),
    "summary": plan.summary(gbps, max_pairs=4),
}))
"""


def test_kimi_k2_like_plan_from_layouts_alone():
    """256 BF16 trainer ranks into 128 receiver ranks, ~1 T parameters in ~70,000 tensors:
    planned without tensors, in a fresh process (its peak memory is the whole cost)."""
    root = str(pathlib.Path(__file__).resolve().parents[4])
    out = subprocess.run(
        [sys.executable, "-c", _SCALE],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
        env={**os.environ, "PYTHONPATH": root},
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(result["summary"])
    print({k: v for k, v in result.items() if k != "summary"})
    assert 60_000 < result["tensors"] < 80_000 and 0.95e12 < result["params"] < 1.1e12
    assert result["covered"]
    assert result["maxrss_mib"] < 2048
    assert result["modelled_s"] <= 1.2 * result["bound_s"]
    assert result["trainer_spread"] <= 1.2  # replicas share the reads
    # on the links (NVLink in a node, a NIC per GPU between nodes, buckets pipelined): the plan
    # leaves no link the bound counts idle for long (issue 55's target: within 1.1x)
    assert result["links_bound_s"] <= result["links_modelled_s"] <= 1.1 * result["links_bound_s"]
    assert " nic " in result["busiest"]
