"""Receivers that load through their own function (``load=``): each version is assembled aside
and fed to the engine's ``load_weights`` inside its fence, in the names it declared; the
engine fuses and transposes as it loads; all-or-none holds; subsets feed their own names."""

from __future__ import annotations

import pytest
import ray
import torch

import tensorwire as tw
from tests.collectives.engine_actors import DIM, Engine, Trainer

NAMES = ["k.weight", "norm", "o.weight", "q.weight", "v.weight"]


@pytest.fixture
def pair(ray_local):
    trainer, engines = Trainer.remote(3), [Engine.remote() for _ in range(2)]
    sync = tw.WeightSync(
        trainer, engines, source="model", target="checkpoint_layout", load="load_weights", progress=False
    )
    yield trainer, engines, sync
    sync.close()


def _same_outputs(trainer, engines) -> bool:
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(0))
    want = ray.get(trainer.forward.remote(x), timeout=60)
    return all(torch.allclose(got, want, atol=1e-6) for got in ray.get([e.forward.remote(x) for e in engines]))


def test_the_engine_loads_each_version_through_its_loader_inside_the_fence(pair):
    trainer, engines, sync = pair
    assert not _same_outputs(trainer, engines)  # zeros before the first push
    for step in (1, 2):
        report = sync.push()
        assert report.ok and report.version == step
        assert _same_outputs(trainer, engines)  # fused and transposed by the engine, as it loads
        ray.get(trainer.step.remote(step), timeout=60)
    for loads in ray.get([e.loads_seen.remote() for e in engines], timeout=60):
        assert [(sorted(names), fenced) for names, fenced in loads] == [(NAMES, True)] * 2  # the rehearsal fed nothing
    assert sync.versions() == [2, 2]


def test_a_subset_push_feeds_the_loader_its_names_only(pair):
    trainer, engines, sync = pair
    sync.push()
    ray.get(trainer.step.remote(5), timeout=60)
    report = sync.push(names=["o.weight"])
    assert report.ok and report.moved_nbytes == 2 * DIM * DIM * 4
    assert [loads[-1][0] for loads in ray.get([e.loads_seen.remote() for e in engines], timeout=60)] == [
        ["o.weight"]
    ] * 2
    assert not _same_outputs(trainer, engines)  # q, k, v and norm stayed at v1
    assert sync.push().ok and _same_outputs(trainer, engines)


def test_a_missing_loader_fails_every_receiver_before_any_loads(ray_local):
    trainer, engines = Trainer.remote(3), [Engine.remote() for _ in range(2)]
    with pytest.raises(ValueError, match="load="):
        tw.WeightSync(trainer, engines, source="model", target="checkpoint_layout", load="", progress=False)
    sync = tw.WeightSync(
        trainer, engines, source="model", target="checkpoint_layout", load="load_everything", progress=False
    )
    try:
        report = sync.push()
        assert not report.ok and all("no loader method 'load_everything'" in why for why in report.failed.values())
        assert ray.get([e.loads_seen.remote() for e in engines], timeout=60) == [[], []]
    finally:
        sync.close()


def test_a_sharded_engine_is_fed_its_declared_pieces(ray_local):
    """Each tensor-parallel rank declares its rows of each projection; its loader gets exactly
    those pieces, in the trainer's names."""
    from tests.collectives.engine_actors import HalfEngine

    trainer, engines = Trainer.remote(4), [HalfEngine.remote(rank) for rank in range(2)]
    sync = tw.WeightSync(
        trainer, engines, source="model", target="checkpoint_layout", load="load_weights", progress=False
    )
    try:
        report = sync.push()
        assert report.ok and report.moved_nbytes == 4 * DIM * DIM * 4  # each rank its half of 4 projections
        full = ray.get(trainer.weights_of.remote(["q.weight", "k.weight", "v.weight", "o.weight"]), timeout=60)
        for rank, pieces in enumerate(ray.get([e.pieces.remote() for e in engines], timeout=60)):
            half = slice(rank * DIM // 2, (rank + 1) * DIM // 2)
            assert all(torch.equal(pieces[n], full[n][half]) for n in full)
        fed = ray.get(engines[0].fed_shapes.remote(), timeout=60)
        assert sorted(fed) == sorted((n, (DIM // 2, DIM)) for n in full)
    finally:
        sync.close()
