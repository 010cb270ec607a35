"""Experts placed by the engine's expert map (``Sharded.experts``): permuted and redundant
experts are read straight from whichever trainer holds them, each byte once per slot, with
nothing gathered first; pushes are exact."""

from __future__ import annotations

import pytest
import ray
import torch

import tensorwire as tw
from tensorwire.collectives.weight_sync.planning.experts import runs
from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece, describe_value
from tensorwire.collectives.weight_sync.planning.plan import plan_sync
from tests.collectives.engine_actors import EXPERTS, HIDDEN, ExpertEngine, ExpertTrainer

MAPS = [[5, 0, 7], [2, 3, 4, 5], [1, 6]]  # permuted; expert 5 on two ranks
EXPERT_NBYTES = HIDDEN[0] * HIDDEN[1] * 4


def test_runs_group_consecutive_experts_in_consecutive_slots():
    assert runs([5, 0, 7]) == [(0, 5, 1), (1, 0, 1), (2, 7, 1)]
    assert runs([2, 3, 4, 5]) == [(0, 2, 4)]
    assert runs([1, 2, 2, 3]) == [(0, 1, 2), (2, 2, 2)]


def test_the_plan_reads_each_slot_from_the_trainer_that_holds_its_expert():
    trainers = [
        (ParamPiece("experts", (EXPERTS, *HIDDEN), "float32", Box((4 * r, 0, 0), (4, *HIDDEN))),) for r in range(2)
    ]
    receivers = [
        (ParamPiece("experts", (EXPERTS, *HIDDEN), "float32", Box((0, 0, 0), (len(m), *HIDDEN)), rows=tuple(m)),)
        for m in MAPS
    ]
    plan = plan_sync(trainers, receivers)
    minimum = sum(len(m) for m in MAPS) * EXPERT_NBYTES  # each slot's expert, once
    assert plan.nbytes == minimum  # a gather would move every expert to every trainer first: 8 x 2 more
    for r, expert_map in enumerate(MAPS):
        for t in plan.receivers[r]:
            slot, count = t.dst.offsets[0], t.dst.sizes[0]
            first = t.src.offsets[0] + 4 * t.trainer  # the trainer's local row -> the global expert
            assert expert_map[slot : slot + count] == list(range(first, first + count))
            assert first // 4 == t.trainer  # from the trainer that holds it
        assert sum(t.dst.sizes[0] for t in plan.receivers[r]) == len(expert_map)


@pytest.mark.parametrize(
    ("slots", "experts", "message"),
    [
        ((2, *HIDDEN), [1, 8], "not among the 8 experts"),
        ((2, *HIDDEN), [1, 2, 3], "lists 3 experts for 2 slots"),
        ((2, 5, 6), [1, 2], "each slot must hold a whole expert"),
    ],
)
def test_bad_expert_maps_are_refused(slots, experts, message):
    local = torch.zeros(slots)
    described = tw.collective.Sharded(local, (EXPERTS, *HIDDEN), (0, 0, 0), rows=tuple(experts))
    with pytest.raises(ValueError, match=message):
        describe_value({"experts": described}, "receiver")


def test_a_push_places_permuted_and_redundant_experts_exactly(ray_local):
    trainers = [ExpertTrainer.remote(r, 2) for r in range(2)]
    engines = [ExpertEngine.remote(m) for m in MAPS]
    sync = tw.WeightSync(trainers, engines, source="weights", progress=False)
    try:
        for version in (1, 2):
            report = sync.push()
            assert report.ok and report.moved_nbytes == sum(len(m) for m in MAPS) * EXPERT_NBYTES
            assert ray.get([e.holds.remote(version) for e in engines], timeout=60) == [True] * 3
            ray.get([t.step.remote() for t in trainers], timeout=60)
    finally:
        sync.close()


def test_a_trainer_cannot_describe_its_experts_by_a_map():
    """An expert map places experts in a receiver; a trainer's map would be planned as the block
    at offset 0 (wrong bytes), so it is refused."""
    described = tw.collective.Sharded.experts(torch.zeros(3, *HIDDEN), torch.tensor([5, 2, 7]), EXPERTS)
    assert described.rows == (5, 2, 7) and all(type(e) is int for e in described.rows)  # (a tensor of ids too)
    with pytest.raises(ValueError, match="describe a trainer's experts by the block it holds"):
        describe_value({"experts": described}, "source")
