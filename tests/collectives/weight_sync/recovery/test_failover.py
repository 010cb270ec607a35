"""Failover: a trainer that dies or stalls mid-push is replaced by the trainers holding the same
bytes, and only what is missing is read again; without one the push fails and the receivers keep
their version."""

from __future__ import annotations

import pytest
import ray

import tensorwire as tw
from tensorwire.collectives.weight_sync.commit import receiver as receiver_state
from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import Plan
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.collectives.weight_sync.recovery import arrivals
from tensorwire.collectives.weight_sync.recovery.failover import common_to_replicas
from tests.collectives.actors import Holder, digests

NBYTES = 8 << 20


@pytest.mark.parametrize("commit", ["all", "each"])
def test_a_replica_trainer_killed_mid_push_is_replaced_and_the_push_completes_exact(ray_local, commit):
    trainers = [Holder.remote(32, NBYTES, seed=1) for _ in range(2)]  # data-parallel replicas
    receivers = [Holder.remote(32, NBYTES, seed=None) for _ in range(3)]
    sync = tw.WeightSync(trainers, receivers, source="weights", bucket_bytes=1 << 20, commit=commit)
    assert {k[0] for k in sync.push().pairs} == {"trainer 0", "trainer 1"}  # both serve
    ray.get([t.step.remote(7) for t in trainers])
    ray.get(trainers[1].die_at.remote("trainer", 1))  # after 2 of its buckets
    report = sync.push()
    assert report.ok, report.failed
    assert list(report.replaced) == ["trainer 1"] and "died during the push" in report.replaced["trainer 1"]
    assert digests(receivers) == [ray.get(trainers[0].digest.remote())] * 3  # exact, version 2
    assert sync.versions() == [2, 2, 2] and len(sync.trainers) == 1
    lost = {k: p for k, p in report.pairs.items() if k[0] == "trainer 1" and k[2] == "-"}
    assert sorted(k[1] for k in lost) == ["receiver 0", "receiver 1", "receiver 2"]
    assert all(p.failovers == 1 and not p.transfers for p in lost.values())
    if commit == "all":
        # covered while the push ran (recovery/cover.py): one try; what trainer 1 had not
        # delivered, and only that, read from trainer 0 beside trainer 0's own streams
        assert report.kept_nbytes == 0 and 0 < report.covered_nbytes < report.plan_nbytes // 2
        assert report.moved_nbytes == report.plan_nbytes
        retried = {k: p for k, p in report.pairs.items() if p.retries}
        assert {k[0] for k in retried} == {"trainer 0"} and sorted(k[1] for k in retried) == [
            "receiver 0",
            "receiver 1",
            "receiver 2",
        ]
    else:
        # only what the first try had not delivered was read again, all of it from trainer 0; the
        # receivers read all of trainer 0's half in the first try, after trainer 1 was gone
        assert report.plan_nbytes // 2 <= report.kept_nbytes < report.plan_nbytes
        assert report.moved_nbytes + report.kept_nbytes == report.plan_nbytes and report.covered_nbytes == 0
        read = {k: p for k, p in report.pairs.items() if p.transfers}
        assert {k[0] for k in read} == {"trainer 0"} and all(p.retries == p.transfers for p in read.values())
    ray.get(trainers[0].step.remote(8))
    assert sync.push().ok and digests(receivers) == [ray.get(trainers[0].digest.remote())] * 3
    sync.close()


def test_without_another_source_the_push_fails_and_says_why(ray_local):
    trainer = Holder.remote(32, NBYTES, seed=1)
    receivers = [Holder.remote(32, NBYTES, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=1 << 20)
    assert sync.push().ok
    before = digests(receivers)
    ray.get(trainer.step.remote(7))
    ray.get(trainer.die_at.remote("trainer", 1))
    with pytest.raises(tw.TrainerLost, match="no failover: it was the only trainer; the receivers keep") as lost:
        sync.push()
    assert lost.value.rank == 0 and "died during the push" in lost.value.why  # the trainer, typed
    assert set(lost.value.report.failed) == {0, 1}  # what the receivers did: none committed
    assert digests(receivers) == before and sync.versions() == [1, 1] and sync.committed == 1


def test_a_cover_that_loses_its_trainer_too_fails_the_push_and_the_receivers_keep_their_version(ray_local):
    trainers = [Holder.remote(32, NBYTES, seed=1) for _ in range(2)]
    receivers = [Holder.remote(32, NBYTES, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainers, receivers, source="weights", bucket_bytes=1 << 20)
    assert sync.push().ok
    before = digests(receivers)
    ray.get([t.step.remote(7) for t in trainers])
    ray.get(trainers[0].die_in_second_send.remote())  # it dies as it starts to cover for trainer 1
    ray.get(trainers[1].die_at.remote("trainer", 1))
    with pytest.raises(tw.TrainerLost, match="no failover: it was the only trainer"):
        sync.push()
    assert digests(receivers) == before and sync.versions() == [1, 1] and sync.committed == 1
    sync.close()


def test_a_stalled_trainer_is_detected_by_progress_and_replaced(ray_local):
    trainers = [Holder.remote(16, NBYTES, seed=1) for _ in range(2)]
    receivers = [Holder.remote(16, NBYTES, seed=None) for _ in range(2)]
    sync = tw.WeightSync(
        trainers, receivers, source="weights", bucket_bytes=1 << 20, timeout_s=60, stall_s=3, on_commit="note_commit"
    )
    try:
        assert sync.push().ok
        ray.get([t.step.remote(5) for t in trainers])
        ray.get(trainers[1].stall_at.remote("trainer", 1))  # alive, sends nothing after its second bucket
        report = sync.push()
        assert report.ok, report.failed
        assert list(report.replaced) == ["trainer 1"] and "stalled" in report.replaced["trainer 1"]
        assert digests(receivers) == [ray.get(trainers[0].digest.remote())] * 2
        # covered while the push ran: one try, trainer 1's share read from trainer 0 beside it
        assert sync.versions() == [2, 2] and 0 < report.covered_nbytes < report.plan_nbytes // 2
        assert report.moved_nbytes == report.plan_nbytes  # (the cover skipped what trainer 1 had sent)
        # on_commit ran once per version
        assert ray.get([r.commits_seen.remote() for r in receivers]) == [[("method", 1), ("method", 2)]] * 2
    finally:
        sync.close()
        ray.kill(trainers[1].ray_handle)


def test_stall_s_must_be_below_timeout_s(ray_local):
    trainer, receiver = Holder.remote(2, 1024, seed=1), Holder.remote(2, 1024, seed=None)
    with pytest.raises(ValueError, match="stall_s=5 must be below timeout_s=5"):
        tw.WeightSync(trainer, [receiver], source="weights", timeout_s=5, stall_s=5)


def test_streams_leave_out_the_pieces_a_receiver_holds():
    held = [ParamPiece(name, (8, 4), "float32", Box.full((8, 4)), None) for name in ("a", "b")]
    plan = Plan([held])
    plan.add_receiver(0, held)
    plan.add_receiver(1, held)
    everything = plan.streams([0, 1], bucket_bytes=32)  # pieces of 2 rows (16 bytes a row)
    assert sum(len(t) for s in everything for t in s.transfers.values()) == 16
    have = {0: {("a", "float32"): [Box((0, 0), (8, 4))], ("b", "float32"): [Box((2, 0), (4, 4))]}}
    streams = plan.streams([0, 1], bucket_bytes=32, have=have)
    mine = [t for s in streams if 0 in s.readers for t in s.transfers[0]]
    assert sorted((t.target, t.dst.offsets[0]) for t in mine) == [("b", 0), ("b", 6)]  # only what it lacks
    other = [t for s in streams if 1 in s.readers for t in s.transfers[1]]
    assert len(other) == 8  # receiver 1 holds nothing: everything
    partly = {0: {("b", "float32"): [Box((1, 0), (2, 4))]}}  # covers half of rows 0-1 and of 2-3: read both
    assert len([t for s in plan.streams([0], 32, partly) for t in s.transfers[0]]) == 8
    wrong_dtype = {0: {("a", "bfloat16"): [Box((0, 0), (8, 4))]}}
    assert len([t for s in plan.streams([0], 32, wrong_dtype) for t in s.transfers[0]]) == 8


def _spec(version: int, sync_id: str = "s1") -> PushSpec:
    return PushSpec(sync_id, "failover-test", version, "", (), 0, None, (), (), False, "", 1.0)


def test_a_receiver_remembers_the_pieces_of_the_version_in_flight_only():
    spec = _spec(3)
    arrivals.start_receiving(spec)
    arrivals.note_received(spec, [("a", "float32", (0, 0), (2, 4))])
    arrivals.start_receiving(spec)  # the same version again (a failover's try): kept
    arrivals.note_received(spec, [("b", "float32", (0,), (5,))])
    assert arrivals.received("s1", 3) == [("a", "float32", (0, 0), (2, 4)), ("b", "float32", (0,), (5,))]
    assert arrivals.received("s1", 2) == [] and arrivals.received("s2", 3) == []
    arrivals.start_receiving(_spec(4))  # the next version: forgotten
    assert arrivals.received("s1", 3) == [] and arrivals.received("s1", 4) == []
    arrivals.release("s1")


def test_commit_of_a_version_already_committed_runs_on_commit_once():
    seen = []
    spec = _spec(7, "s-commit")
    spec = PushSpec(**{**spec.__dict__, "on_commit": lambda actor, v: seen.append(v)})
    receiver_state.commit(object(), spec, [])
    receiver_state.commit(object(), spec, [])  # the try after a failover, nothing new read
    assert seen == [7] and receiver_state.weight_version("failover-test") == 7
    other = PushSpec(**{**spec.__dict__, "sync_id": "s-other"})  # another sync of the same name, same number
    receiver_state.commit(object(), other, [])
    assert seen == [7, 7]


def test_replicas_skip_only_what_every_one_of_them_holds():
    """After a failed try, receivers of one layout (replicas) read the rest together, as one
    stream: each skips only the pieces all of them hold (the intersection), never a piece
    another replica lacks (a union would leave that replica without it)."""
    replica = (ParamPiece("a", (8, 4), "float32", Box.full((8, 4))),)
    other = (ParamPiece("a", (8, 4), "float32", Box((0, 0), (4, 4))),)
    rows = [("a", "float32", (row, 0), (2, 4)) for row in (0, 2, 4, 6)]
    held = {0: set(rows[:3]), 1: set(rows[1:]), 2: {rows[0]}}  # 0 and 1 replicas; 2 another layout
    skip = common_to_replicas(held, {0: replica, 1: replica, 2: other})
    both = sorted(b.offsets for b in skip[0][("a", "float32")])
    assert both == [(2, 0), (4, 0)] and skip[1] == skip[0]  # rows 0 and 6: one replica lacks each
    assert skip[2] == {("a", "float32"): [Box((0, 0), (2, 4))]}  # alone in its layout: all it holds
    assert common_to_replicas({0: set(rows), 1: set()}, {0: replica, 1: replica}) == {0: {}, 1: {}}
