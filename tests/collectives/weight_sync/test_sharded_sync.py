"""Sharded weight sync on actors: M trainers into N differently sharded receivers, bit-exact
(row, column and 2-D shards, fused qkv / gate_up, renames, bf16 and float8 with its scale,
DTensor layouts), exactly the plan's bytes, atomic versions under a hammering reader, and
membership: a receiver killed mid-push, one added later, a trainer killed mid-push."""

from __future__ import annotations

import socket

import pytest
import ray
import torch

import tensorwire as tw
from tensorwire.collectives.weight_sync.planning.layout import Replicate, Shard, dtype_itemsize, placement_box
from tests.collectives.actors import DTensorTrainer, Pieces, doubled, full_tensor

R, S0, S1 = Replicate(), Shard(0), Shard(1)
MESH = (2, 2)  # receivers: 2 replicas x tensor parallel 2
TRAINER_SHAPES = {
    "row.w": ((8, 6), (S0,)),
    "col.w": ((6, 8), (S1,)),
    "grid.w": ((8, 8), (S1,)),
    "q.w": ((8, 4), (S0,)),
    "k.w": ((4, 4), (S0,)),
    "v.w": ((4, 4), (S1,)),
    "gate.w": ((8, 4), (S0,)),
    "up.w": ((8, 4), (R,)),
    "norm": ((6,), (S0,)),
    "half.w": ((4, 6), (S0,)),
    "fp8.w": ((8, 6), (S1,)),
}
RENAME = {
    "row.w": "r.row",
    "col.w": "r.col",
    "grid.w": "r.grid",
    "norm": "r.norm",
    "half.w": "r.half",
    "fp8.w": "r.fp8",
}
FUSE = {"r.qkv": ["q.w", "k.w", "v.w"], "r.gate_up": ["gate.w", "up.w"]}
# receiver name -> (global shape, placements over (replica, tp), dtype, parts fused along dim 0)
RECEIVER_SHAPES = {
    "r.row": ((8, 6), (R, S1), "float32", None),
    "r.col": ((6, 8), (R, S0), "float32", None),
    "r.grid": ((8, 8), (S0, S1), "float32", None),  # 2-D: each of the 4 ranks a quarter
    "r.qkv": ((16, 4), (R, S0), "float32", ["q.w", "k.w", "v.w"]),
    "r.gate_up": ((16, 4), (R, S0), "float32", ["gate.w", "up.w"]),
    "r.norm": ((6,), (R, R), "float32", None),
    "r.half": ((4, 6), (R, S0), "bfloat16", None),
    "r.fp8": ((8, 6), (R, S0), "float8_e4m3fn", None),
    "r.fp8_scale": ((1,), (R, R), "float32", None),
}


def trainer_entries(rank: int, world: int = 2) -> dict:
    return {
        name: (shape, placements, (world,), (rank,), "float32", None)
        for name, (shape, placements) in TRAINER_SHAPES.items()
    }


def receiver_entries(coord: tuple[int, int]) -> dict:
    entries = {}
    for name, (shape, placements, dtype, parts) in RECEIVER_SHAPES.items():
        local = None
        if parts:
            pieces = [placement_box(TRAINER_SHAPES[p][0], placements, MESH, coord).sizes for p in parts]
            local = (sum(p[0] for p in pieces), pieces[0][1])
        entries[name] = (shape, placements, MESH, coord, dtype, local)
    return entries


def expected(coord: tuple[int, int], version: int) -> dict[str, torch.Tensor]:
    """What receiver ``coord`` must hold, from the whole tensors."""
    source = {v: k for k, v in RENAME.items()}
    result = {}
    for name, (shape, placements, dtype, parts) in RECEIVER_SHAPES.items():
        if parts:
            pieces = []
            for part in parts:
                part_shape = TRAINER_SHAPES[part][0]
                pieces.append(
                    full_tensor(part, part_shape, version)[placement_box(part_shape, placements, MESH, coord).slices()]
                )
            result[name] = torch.cat(pieces)
        elif name != "r.fp8_scale":
            piece = full_tensor(source[name], shape, version)[placement_box(shape, placements, MESH, coord).slices()]
            result[name] = piece.to(getattr(torch, dtype)) if dtype != "float8_e4m3fn" else piece
    high = result.pop("r.fp8")
    scale = (high.abs().max() / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    result["r.fp8"] = (high / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    result["r.fp8_scale"] = scale.reshape(1)
    return result


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-exact (a float8 tensor arrives as its bytes)."""
    if want.dtype == torch.float8_e4m3fn:
        want = want.view(torch.uint8)
    return got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


COORDS = [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("reads", ["ring", "in-place"])
def test_two_trainers_into_four_differently_sharded_receivers_bit_exact(ray_local, reads):
    options = {"runtime_env": {"env_vars": {"TENSORWIRE_SYNC_READS": reads}}}
    trainers = [Pieces.options(**options).remote(trainer_entries(r), version=1) for r in range(2)]
    receivers = [Pieces.remote(receiver_entries(c)) for c in COORDS]
    pointers = ray.get([r.data_ptrs.remote() for r in receivers])
    sync = tw.WeightSync(
        trainers, receivers, rename=RENAME, fuse=FUSE, scales={"r.fp8": "r.fp8_scale"}, bucket_bytes=256, verify=True
    )
    text = str(sync.plan)
    assert "2 trainer(s) -> 4 receiver(s)" in text and "per trainer" in text
    for version in (1, 2):
        if version == 2:
            ray.get([t.become.remote(2) for t in trainers])
        report = sync.push()
        assert report.ok, report.failed
        assert report.version == version and sync.versions() == [version] * 4
        for coord, got in zip(COORDS, ray.get([r.tensors.remote() for r in receivers]), strict=True):
            want = expected(coord, version)
            wrong = [name for name in want if not same(got[name], want[name])]
            assert not wrong, f"receiver {coord}: {wrong} differ"
    assert ray.get([r.data_ptrs.remote() for r in receivers]) == pointers  # in place
    # exactly the plan's bytes, and that is each receiver's bytes once (fp8 on the wire as float32)
    need = 0
    for coord in COORDS:
        for name, (shape, placements, mesh, c, dtype, local) in receiver_entries(coord).items():
            if name == "r.fp8_scale":
                continue
            numel = torch.Size(local or placement_box(shape, placements, mesh, c).sizes).numel()
            need += numel * (4 if dtype == "float8_e4m3fn" else dtype_itemsize(dtype))
    assert report.moved_nbytes == report.plan_nbytes == sync.plan.nbytes == need
    if reads == "ring":
        assert report.in_place_nbytes == 0
    else:  # rows and whole tensors read in place; columns, conversions and float8 through the ring
        assert 0 < report.in_place_nbytes < need
    assert sum(sync.plan.trainer_nbytes()) == need
    sync.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dtensor_trainers_give_their_layouts(ray_local):
    shapes = {"a": (8, 6), "b": (6, 8), "c": (5,)}
    placements = {"a": (S0,), "b": (S1,), "c": (R,)}
    port = free_port()
    trainers = [DTensorTrainer.remote(rank, 2, port, shapes, placements) for rank in range(2)]
    entries = {
        "a": ((8, 6), (S1,), (2,), (0,), "float32", None),
        "b": ((6, 8), (S0,), (2,), (1,), "float32", None),
        "c": ((5,), (R,), (2,), (0,), "float32", None),
    }
    receiver = Pieces.remote(entries)
    sync = tw.WeightSync(trainers, [receiver])  # state_dict() by default, DTensor layouts derived
    # each trainer holds half of a's rows and of b's columns: 4x3 and 3x4 float32 of each; c (5) once
    assert sync.plan.pair_nbytes() == {(0, 0): 12 * 4 + 12 * 4 + 5 * 4, (1, 0): 12 * 4 + 12 * 4}
    report = sync.push()
    assert report.ok, report.failed
    got = ray.get(receiver.tensors.remote())
    assert torch.equal(got["a"], full_tensor("a", (8, 6))[:, :3])
    assert torch.equal(got["b"], full_tensor("b", (6, 8))[3:])
    assert torch.equal(got["c"], full_tensor("c", (5,)))
    sync.close()


def flat_entries(rank: int, world: int, tensors: int = 8, rows: int = 256) -> dict:
    return {f"w{i}": ((rows, 1024), (S0,), (world,), (rank,), "float32", None) for i in range(tensors)}


def test_atomic_receivers_are_never_seen_mid_update(ray_local):
    trainers = [Pieces.remote(flat_entries(r, 2), version=1) for r in range(2)]
    receivers = [Pieces.remote(flat_entries(0, 1)) for _ in range(2)]  # each holds everything
    ray.get([r.fill.remote(0.0) for r in receivers])
    ray.get([r.start_reader.remote() for r in receivers])
    sync = tw.WeightSync(trainers, receivers, atomic=True, bucket_bytes=64 << 10)
    for version in range(1, 6):
        ray.get([t.fill.remote(float(version)) for t in trainers])
        report = sync.push()
        assert report.ok and report.buckets > 8, report
    readings = ray.get([r.stop_reader.remote() for r in receivers])
    for reading in readings:
        assert reading["mixed"] == [] and reading["reads"] > 20, reading
        assert set(reading["versions"]) <= set(range(6)) and reading["versions"][-1] == 5
    assert sync.versions() == [5, 5]
    sync.close()


def test_receiver_killed_mid_push_then_removed_and_another_added(ray_local):
    trainers = [Pieces.remote(flat_entries(r, 2, tensors=32), version=1) for r in range(2)]
    receivers = [Pieces.remote(flat_entries(0, 1, tensors=32)) for _ in range(3)]
    sync = tw.WeightSync(trainers, receivers, bucket_bytes=256 << 10, commit="each")  # the others commit
    ray.get(receivers[1].die_at.remote("receiver", 2))
    report = sync.push()
    assert list(report.failed) == [1] and "died" in report.failed[1]
    want = {f"w{i}": full_tensor(f"w{i}", (256, 1024)) for i in range(32)}
    for r in (receivers[0], receivers[2]):
        got = ray.get(r.tensors.remote())
        assert all(torch.equal(got[n], want[n]) for n in want)
    kept = {rid: sync.plan.receivers[rid] for rid in (0, 2)}
    sync.remove_receiver(1)
    newcomer = Pieces.remote(flat_entries(0, 1, tensors=32))
    assert sync.add_receiver(newcomer) == 3
    assert all(sync.plan.receivers[rid] is kept[rid] for rid in (0, 2))  # the others were not replanned
    ray.get([t.become.remote(2) for t in trainers])
    report = sync.push()
    assert report.ok and set(report.receivers) == {0, 2, 3}, report.failed
    want = {f"w{i}": full_tensor(f"w{i}", (256, 1024), 2) for i in range(32)}
    for r in (receivers[0], receivers[2], newcomer):
        got = ray.get(r.tensors.remote())
        assert all(torch.equal(got[n], want[n]) for n in want)
    assert sync.versions() == [2, 2, 2]
    sync.close()


def test_trainer_killed_mid_push_fails_it_by_name_and_atomic_receivers_keep_the_last_version(ray_local):
    trainers = [Pieces.remote(flat_entries(r, 2, tensors=16), version=1) for r in range(2)]
    receivers = [Pieces.remote(flat_entries(0, 1, tensors=16)) for _ in range(2)]
    sync = tw.WeightSync(
        trainers,
        receivers,
        atomic=True,
        bucket_bytes=64 << 10,
        timeout_s=60,
    )
    assert sync.push().ok
    ray.get([t.become.remote(2) for t in trainers])
    ray.get(trainers[1].die_at.remote("trainer", 2))  # after it offered 3 of its 16 buckets
    with pytest.raises(tw.TensorwireError, match=r"trainer 1 .* died during the push") as failure:
        sync.push()
    assert set(failure.value.report.failed) == {0, 1}  # neither receiver completed version 2
    assert sync.versions() == [1, 1]
    want = {f"w{i}": full_tensor(f"w{i}", (256, 1024), 1) for i in range(16)}
    for r in receivers:
        got = ray.get(r.tensors.remote())
        assert all(torch.equal(got[n], want[n]) for n in want)  # still whole version 1
    sync.close()


def test_a_transform_on_the_trainer_and_a_fence_of_the_receiver(ray_local):
    entries = {"w": ((64, 32), (S0,), (1,), (0,), "float32", None), "b": ((32,), (R,), (1,), (0,), "bfloat16", None)}
    trainer = Pieces.remote({"w": entries["w"], "b": ((32,), (R,), (1,), (0,), "float32", None)}, version=1)
    receiver = Pieces.remote(entries)
    sync = tw.WeightSync(trainer, [receiver], transform=doubled, atomic=True, fence="publish_fence")
    assert sync.push().ok and sync.push().ok
    got = ray.get(receiver.tensors.remote())
    assert torch.equal(got["w"], full_tensor("w", (64, 32)) * 2)
    assert torch.equal(got["b"], (full_tensor("b", (32,)) * 2).to(torch.bfloat16))  # doubled, then converted
    assert ray.get(receiver.fence_entries.remote()) == 2  # one publication per push, inside the receiver's fence
    sync.close()


@pytest.mark.parametrize("commit", ["all", "each"])
def test_a_replica_killed_mid_push_leaves_float8_and_every_layout_exact(ray_local, commit):
    """Failover reads only what had not arrived (or, all-or-none, the lost trainer's share beside
    the try): a float8 parameter that arrived whole before is quantised from what arrived, not
    from what the receiver held before."""
    trainers = [Pieces.remote(trainer_entries(0, world=1), version=1) for _ in range(2)]  # two whole replicas
    receivers = [Pieces.remote(receiver_entries(c)) for c in COORDS]
    sync = tw.WeightSync(
        trainers, receivers, rename=RENAME, fuse=FUSE, scales={"r.fp8": "r.fp8_scale"}, bucket_bytes=64, commit=commit
    )
    first = sync.push()
    assert first.ok
    levels = 1 + max(s.bucket for s in first.timeline if s.source == "trainer 1")
    assert levels >= 4  # so that it dies with buckets left
    ray.get([t.become.remote(2) for t in trainers])
    ray.get(trainers[1].die_at.remote("trainer", levels // 2 - 1))
    report = sync.push()
    assert report.ok, report.failed
    assert list(report.replaced) == ["trainer 1"]
    # all-or-none: covered within the try (the float8 staging filled by both); each: a second try
    assert (report.covered_nbytes > 0, report.kept_nbytes > 0) == ((True, False) if commit == "all" else (False, True))
    for coord, got in zip(COORDS, ray.get([r.tensors.remote() for r in receivers]), strict=True):
        want = expected(coord, 2)
        wrong = [name for name in want if not same(got[name], want[name])]
        assert not wrong, f"receiver {coord}: {wrong} differ"
    sync.close()
