"""The driver side of groups and weight sync: ``GroupInfo`` (``world_size``, ``destroy()``),
the argument errors of ``collectives/groups/api.py``, and ``tw.collective.weight_version`` inside
receivers."""

from __future__ import annotations

import pytest
import ray

import tensorwire as tw
from tests.collectives.actors import Holder, Member


@pytest.fixture(scope="module")
def actors(ray_local):
    return [Member.remote(rank) for rank in range(2)]


def test_group_info_world_size_and_destroy(actors):
    info = tw.collective.create_group(actors, backend="gloo", name="g-info")
    assert (info.name, info.backend, info.world_size) == ("g-info", "gloo", 2)
    assert ray.get([a.groups.remote() for a in actors]) == [["g-info"]] * 2
    assert info.destroy() == []  # every member reached
    assert ray.get([a.groups.remote() for a in actors]) == [[]] * 2
    with pytest.raises(ValueError, match="no group named 'g-info' was created here"):
        tw.collective.destroy_group("g-info")
    again = tw.collective.create_group(actors, backend="gloo", name="g-info")  # the name is free again
    assert again.world_size == 2 and again.destroy() == []


def test_create_group_argument_errors(actors):
    with pytest.raises(ValueError, match="needs at least one actor"):
        tw.collective.create_group([], name="x")
    for name in ("", "n" * 101, 7):
        with pytest.raises(ValueError, match="a group name is a non-empty string of at most 100 characters"):
            tw.collective.create_group(actors, name=name)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        tw.collective.create_group(actors, name="x", timeout_s=0)
    with pytest.raises(ValueError, match="no group named 'never' was created here"):
        tw.collective.destroy_group("never")
    assert ray.get([a.groups.remote() for a in actors]) == [[]] * 2  # nothing was half made


def test_weight_version_inside_receivers_follows_the_pushes(ray_local):
    trainer = Holder.remote(4, 1 << 16, seed=3)
    receivers = [Holder.remote(4, 1 << 16, seed=None) for _ in range(2)]
    assert ray.get([r.version.remote("w-version") for r in receivers]) == [0, 0]
    sync = tw.WeightSync(trainer, receivers, source="weights", name="w-version")
    try:
        for version in (1, 2):
            report = sync.push()
            assert report.ok, report.failed
            assert ray.get([r.version.remote("w-version") for r in receivers]) == [version, version]
        assert ray.get([r.version.remote("weights") for r in receivers]) == [0, 0]  # another sync's name
        assert ray.get([r.digest.remote() for r in receivers]) == [ray.get(trainer.digest.remote())] * 2
    finally:
        sync.close()
