"""Collectives over actor groups: every operation against torch.distributed (gloo) on the same
inputs, on both the gloo backend (torch.distributed's own) and ours; membership; a member
that dies."""

from __future__ import annotations

import os
import signal

import pytest
import ray
import torch

import tensorwire as tw
from tensorwire.collectives.groups.channel import Member as GroupMember
from tensorwire.collectives.groups.tensorwire_group import broadcast_parents
from tensorwire.transport.contract import PeerInfo
from tests.collectives.actors import Member, member_input

WORLD = 3


@pytest.fixture(scope="module")
def members(ray_local):
    actors = [Member.remote(rank) for rank in range(WORLD)]
    tw.collective.create_group(actors, backend="gloo", name="g-gloo")
    tw.collective.create_group(actors, backend="tensorwire", name="g-tw")
    yield actors
    for name in ("g-gloo", "g-tw"):
        tw.collective.destroy_group(name)


def run_all(actors, name: str, op: str, per_rank: dict[int, dict] | None = None, **kwargs):
    per_rank = per_rank or {}
    refs = [a.run.remote(name, op, **{**kwargs, **per_rank.get(r, {})}) for r, a in enumerate(actors)]
    return ray.get(refs, timeout=120)


def both(actors, op: str, **kwargs):
    """The results of ``op`` on torch.distributed gloo and on our backend; asserts they agree."""
    reference = run_all(actors, "g-gloo", op, **kwargs)
    ours = run_all(actors, "g-tw", op, **kwargs)
    for ref_value, our_value in zip(reference, ours, strict=True):
        if isinstance(ref_value, list):
            assert all(torch.equal(a, b) for a, b in zip(ref_value, our_value, strict=True))
        else:
            assert torch.equal(ref_value, our_value)
    return reference


def test_a_process_is_in_several_groups(members):
    assert ray.get([a.groups.remote() for a in members]) == [["g-gloo", "g-tw"]] * WORLD


@pytest.mark.parametrize("src", [0, 2])
def test_broadcast(members, src):
    results = both(members, "broadcast", src=src)
    assert all(torch.equal(r, member_input(src)) for r in results)


def test_broadcast_into_a_non_contiguous_tensor(members):
    results = both(members, "broadcast_transposed", src=1)
    assert all(torch.equal(r, member_input(1).t()) for r in results)


@pytest.mark.parametrize("reduce", ["sum", "product", "min", "max", "avg"])
def test_all_reduce(members, reduce):
    """Against plain torch over every rank's input (not tensorwire's own reduction): "avg" is
    the mean, which neither backend computes this way (gloo has no AVG; both sum, then divide)."""
    results = both(members, "all_reduce", reduce=reduce)
    inputs = torch.stack([member_input(r) for r in range(WORLD)])
    expected = {
        "sum": inputs.sum(0),
        "product": inputs.prod(0),
        "min": inputs.amin(0),
        "max": inputs.amax(0),
        "avg": inputs.mean(0),
    }[reduce]
    for r in results:
        if reduce == "avg":  # sum / 3 and mean may round apart in the last bit
            torch.testing.assert_close(r, expected, rtol=1e-15, atol=0)
        else:  # small integers: exact in any order
            assert torch.equal(r, expected)


def test_all_reduce_accepts_torch_reduce_ops(members):
    results = both(members, "all_reduce", reduce=torch.distributed.ReduceOp.MAX)
    assert torch.equal(results[0], torch.stack([member_input(r) for r in range(WORLD)]).amax(0))


def test_all_gather(members):
    results = both(members, "all_gather")
    assert all(torch.equal(r[i], member_input(i)) for r in results for i in range(WORLD))


def test_reduce_scatter(members):
    results = both(members, "reduce_scatter")
    for rank, result in enumerate(results):
        expected = sum(member_input(src * WORLD + rank) for src in range(WORLD))
        assert torch.equal(result, expected)


def test_barrier_waits_for_the_slowest(members):
    for name in ("g-gloo", "g-tw"):
        finished = run_all(members, name, "barrier")  # rank r sleeps 0.3 r s before the barrier
        # every member left after the last one (rank 2, 0.6 s late) arrived
        assert max(finished) - min(finished) < 0.3


def test_send_recv_with_tags(members):
    for name in ("g-gloo", "g-tw"):
        refs = [
            members[0].run.remote(name, "send", dst=2, tag=7),
            members[2].run.remote(name, "recv", src=0, tag=7),
        ]
        _, got = ray.get(refs, timeout=60)
        assert torch.equal(got, member_input(0) * 10)


def test_bad_arguments_are_clear(members):
    with pytest.raises(ValueError, match="exists"):
        tw.collective.create_group(members, backend="gloo", name="g-gloo")
    with pytest.raises(ValueError, match="unknown backend"):
        tw.collective.create_group(members, backend="mpi", name="x")
    with pytest.raises(ValueError, match="twice"):
        tw.collective.create_group([members[0], members[0]], name="x")
    with pytest.raises(TypeError, match=r"@tw\.remote"):
        tw.collective.create_group(["not an actor"], name="x")
    with pytest.raises(ValueError, match="not in a group named 'nope'"):
        tw.collective.get_group("nope")  # the driver is in no group
    with pytest.raises(ray.exceptions.RayTaskError, match="unsupported reduce op"):
        ray.get(members[0].run.remote("g-tw", "all_reduce", reduce="median"), timeout=30)


def test_broadcast_tree_reads_the_source_node_directly_and_relays_across_nodes():
    def member(rank: int, node: str) -> GroupMember:
        return GroupMember(rank, PeerInfo(f"a{rank}", node, "m", "h", 1, 1), 0)

    members = [member(0, "A"), member(1, "A"), member(2, "B"), member(3, "B"), member(4, "C"), member(5, "D")]
    parents = broadcast_parents(members, 1)
    assert parents[0] == 1  # same node as the source: straight from it
    assert parents[2] == 1 and parents[3] == 2  # node B: leader 2 from the source, 3 from its leader
    assert parents[4] == 1 and parents[5] == 2  # leaders form a binary tree under the source
    assert 1 not in parents


@pytest.mark.parametrize("backend", ["gloo", "tensorwire"])
def test_a_dead_member_fails_the_others_fast_and_the_group_can_be_made_again(ray_local, backend):
    actors = [Member.remote(rank) for rank in range(WORLD)]
    tw.collective.create_group(actors, backend=backend, name=f"doomed-{backend}")
    os.kill(ray.get(actors[2].pid.remote()), signal.SIGKILL)
    outcomes = ray.get([a.run_catching.remote(f"doomed-{backend}", "all_reduce") for a in actors[:2]], timeout=120)
    for error, message, seconds in outcomes:
        assert error == "PeerLostError", message
        assert seconds < 30
    assert tw.collective.destroy_group(f"doomed-{backend}") == [2]
    replacement = Member.remote(2)
    tw.collective.create_group([actors[0], actors[1], replacement], backend=backend, name=f"doomed-{backend}")
    results = run_all([actors[0], actors[1], replacement], f"doomed-{backend}", "all_reduce")
    assert all(torch.equal(r, sum(member_input(i) for i in range(WORLD))) for r in results)
    tw.collective.destroy_group(f"doomed-{backend}")
