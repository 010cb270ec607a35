"""A push of some parameters only (``push(names=...)``, ``push(changed=...)``): only their bytes
move, the receivers keep the others as they were, the version applies to the whole model;
fused receiver parameters are pushed whole; bad subsets are refused."""

from __future__ import annotations

import pytest
import ray

import tensorwire as tw
from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import Fuse, NameMap, Plan
from tensorwire.collectives.weight_sync.planning.subsets import left_out, merged, subset_of
from tests.collectives.actors import Holder

NBYTES = 64 << 10  # 4 tensors of 16 KiB


def whole(name: str, shape: tuple[int, ...]) -> ParamPiece:
    return ParamPiece(name, shape, "float32", Box.full(shape))


def fused_plan() -> Plan:
    trainer = [whole(n, (4, 8)) for n in ("q", "k", "v", "o")]
    receiver = [whole("qkv", (12, 8)), whole("o", (4, 8))]
    plan = Plan([trainer], NameMap.build(None, {"qkv": Fuse(("q", "k", "v"))}, None))
    plan.add_receiver(0, receiver)
    return plan


def test_a_fused_parameter_is_pushed_whole_and_the_rest_is_held():
    plan = fused_plan()
    only = subset_of(plan, ["q"], None)
    assert only == {0: frozenset({"qkv"})}  # q feeds qkv: all of qkv (q, k and v) is pushed
    held = left_out(plan, only)[0]
    assert set(held) == {("o", "float32")}
    assert subset_of(plan, None, lambda n: n == "o") == {0: frozenset({"o"})}
    assert subset_of(plan, None, None) is None  # a whole push
    both = merged({0: {("qkv", "float32"): ["box"]}}, {0: held})[0]
    assert set(both) == {("qkv", "float32"), ("o", "float32")}


def test_bad_subsets_are_refused_with_what_is_wrong():
    plan = fused_plan()
    with pytest.raises(ValueError, match=r"do not sync: \['qq'\].*did you mean q"):
        subset_of(plan, ["qq"], None)
    with pytest.raises(ValueError, match="not both"):
        subset_of(plan, ["q"], lambda n: True)
    with pytest.raises(ValueError, match="empty"):
        subset_of(plan, None, lambda n: False)
    with pytest.raises(TypeError, match="not one string"):
        subset_of(plan, "q", None)


@pytest.mark.parametrize("mode", ["all-copy", "all-swap", "each-in-place"])
def test_only_the_named_parameters_move_and_the_others_keep_their_version(ray_local, mode):
    """After full pushes of v1 and v2, a subset push of layer1 and layer2 (v3) moves their bytes
    only: layer0 and layer3 hold v2's values (with publish='swap' too, whose shadows hold v1's
    memory: publishing them would bring back v1)."""
    settings = {
        "all-copy": {},
        "all-swap": {"publish": "swap"},
        "each-in-place": {"commit": "each"},
    }[mode]
    trainer = Holder.remote(4, NBYTES, 1)
    receivers = [Holder.remote(4, NBYTES, None) for _ in range(2)]
    sync = tw.WeightSync(trainer, receivers, source="weights", progress=False, **settings)
    try:
        sync.push()
        ray.get(trainer.step.remote(1), timeout=60)
        sync.push()
        v2 = ray.get(trainer.digests_by_name.remote(), timeout=60)
        ray.get(trainer.step.remote(2), timeout=60)
        v3 = ray.get(trainer.digests_by_name.remote(), timeout=60)
        report = sync.push(names=["layer1.weight", "layer2.weight"])
        assert report.ok and report.version == 3
        assert report.moved_nbytes == report.plan_nbytes == 2 * (NBYTES // 2)  # 2 of 4 tensors, 2 receivers
        expected = {"layer0.weight": v2["layer0.weight"], "layer3.weight": v2["layer3.weight"]}
        expected |= {"layer1.weight": v3["layer1.weight"], "layer2.weight": v3["layer2.weight"]}
        assert ray.get([r.digests_by_name.remote() for r in receivers], timeout=60) == [expected] * 2
        assert sync.versions() == [3, 3]
        report = sync.push(changed=lambda name: name in ("layer0.weight", "layer3.weight"))
        assert report.ok and report.moved_nbytes == 2 * (NBYTES // 2)
        assert ray.get([r.digests_by_name.remote() for r in receivers], timeout=60) == [v3] * 2
    finally:
        sync.close()
