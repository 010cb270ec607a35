"""All-or-none without shadows (``aside="none"``): receivers vote before the first write, write
in place inside their fence held until they publish, and a lost trainer is replaced from its
replica; nothing is kept aside."""

from __future__ import annotations

import threading
import time

import pytest
import ray

import tensorwire as tw
from tensorwire.collectives.weight_sync.commit.fence import FenceHold
from tests.collectives.actors import Holder, digests

NBYTES = 8 << 20


@pytest.mark.parametrize("aside", ["none", "shadow"])
def test_in_place_versions_are_written_inside_the_fence_with_nothing_aside(ray_local, aside):
    trainers = [Holder.remote(16, NBYTES, seed=1) for _ in range(2)]  # data-parallel replicas
    receivers = [Holder.remote(16, NBYTES, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainers, receivers, source="weights", bucket_bytes=1 << 20, aside=aside)
    try:
        ptrs = ray.get([r.data_ptrs.remote() for r in receivers])
        ray.get([r.watch_fence_at.remote(1) for r in receivers])
        report = sync.push()
        assert report.ok, report.failed
        assert digests(receivers) == [ray.get(trainers[0].digest.remote())] * 2 and sync.versions() == [1, 1]
        assert ray.get([r.data_ptrs.remote() for r in receivers]) == ptrs
        held = ray.get([r.fence_held.remote() for r in receivers])
        if aside == "none":  # held while it wrote, let go once published; no shadow
            assert held == [[True, False]] * 2 and report.aside_nbytes == 0
        else:  # readers wait only for the commit's copy out of a shadow as large as the parameters
            assert held == [[False, False]] * 2 and report.aside_nbytes == NBYTES
    finally:
        sync.close()


def test_in_place_a_trainer_killed_mid_push_is_replaced_and_every_receiver_commits_once(ray_local):
    trainers = [Holder.remote(32, NBYTES, seed=1) for _ in range(2)]
    receivers = [Holder.remote(32, NBYTES, seed=None) for _ in range(3)]
    sync = tw.WeightSync(
        trainers, receivers, source="weights", bucket_bytes=1 << 20, aside="none", on_commit="note_commit"
    )
    try:
        assert sync.push().ok
        ray.get([t.step.remote(7) for t in trainers])
        ray.get(trainers[1].die_at.remote("trainer", 1))
        report = sync.push()
        assert report.ok, report.failed
        assert list(report.replaced) == ["trainer 1"] and report.kept_nbytes > 0 and report.aside_nbytes == 0
        assert digests(receivers) == [ray.get(trainers[0].digest.remote())] * 3 and sync.versions() == [2, 2, 2]
        assert ray.get([r.commits_seen.remote() for r in receivers]) == [[("method", 1), ("method", 2)]] * 3
        assert ray.get([r.fence_held.remote() for r in receivers]) == [[False]] * 3  # let go after the failover
        assert sync.committed == 2
        for rid in list(sync.receiver_ids):  # a newcomer then catches up from the trainer left (one source)
            sync.remove_receiver(rid)
        late = Holder.remote(32, NBYTES, seed=None)
        sync.add_receiver(late)
        assert sync.caught_up[3] == "trainers" and digests([late]) == [ray.get(trainers[0].digest.remote())]
        assert ray.get(late.aside_nbytes.remote(sync.sync_id)) == 0  # in place (it served nothing yet): no shadow
    finally:
        sync.close()


def test_in_place_a_receiver_failing_before_its_vote_leaves_all_at_the_version_they_had(ray_local):
    trainers = [Holder.remote(16, NBYTES, seed=1) for _ in range(2)]
    receivers = [Holder.remote(16, NBYTES, seed=None) for _ in range(3)]
    ray.get([r.own_fence.remote(True) for r in receivers])
    sync = tw.WeightSync(trainers, receivers, source="weights", bucket_bytes=1 << 20, aside="none", fence="own")
    try:
        assert sync.push().ok
        before = digests(receivers)
        ray.get([t.step.remote(3) for t in trainers])
        ray.get(receivers[1].own_fence.remote(False))  # fails its check before it votes
        report = sync.push()
        assert "has no fence attribute 'own'" in report.failed[1]
        assert all("not committed" in report.failed[r] for r in (0, 2))
        assert digests(receivers) == before and sync.versions() == [1, 1, 1]  # nobody wrote
        assert sync.committed == 1
        assert ray.get([receivers[r].own_fence_free.remote() for r in (0, 2)]) == [True, True]  # let go
    finally:
        sync.close()


def test_in_place_a_trainer_failing_after_the_vote_is_replaced_too(ray_local, tmp_path):
    trainers = [Holder.remote(16, NBYTES, seed=1) for _ in range(2)]
    receivers = [Holder.remote(16, NBYTES, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainers, receivers, source="weights", bucket_bytes=1 << 20, aside="none")
    try:
        assert sync.push().ok
        ray.get([t.step.remote(6) for t in trainers])
        flag = str(tmp_path / "a receiver wrote")  # (offering bucket 1 can come before the vote)
        ray.get([r.mark_written.remote(flag) for r in receivers])
        ray.get(trainers[0].fail_once_a_receiver_wrote.remote(1, flag))  # raises after the receivers began to write
        report = sync.push()
        assert report.ok and "injected failure" in report.replaced["trainer 0"]
        assert digests(receivers) == [ray.get(trainers[1].digest.remote())] * 2 and sync.versions() == [2, 2]
    finally:
        sync.close()


def test_in_place_newcomers_catch_up_one_after_another(ray_local):
    trainers = [Holder.remote(8, NBYTES, seed=1) for _ in range(2)]
    first = Holder.remote(8, NBYTES, seed=None)
    sync = tw.WeightSync(trainers, [first], source="weights", bucket_bytes=1 << 20, aside="none", timeout_s=10)
    try:
        assert sync.push().ok
        expected = ray.get(trainers[0].digest.remote())
        for _ in range(2):  # each from the trainers (nobody else holds the version), each voting on its own
            sync.remove_receiver(sync.receiver_ids[0])
            late = Holder.remote(8, NBYTES, seed=None)
            rid = sync.add_receiver(late)
            assert sync.caught_up[rid] == "trainers" and digests([late]) == [expected]
            assert ray.get(late.version.remote()) == 1 and ray.get(late.fence_held.remote()) == [False]
    finally:
        sync.close()


def test_in_place_a_receiver_killed_after_the_vote_does_not_stop_the_others(ray_local):
    trainers = [Holder.remote(16, NBYTES, seed=1) for _ in range(2)]
    receivers = [Holder.remote(16, NBYTES, seed=None) for _ in range(3)]
    sync = tw.WeightSync(trainers, receivers, source="weights", bucket_bytes=1 << 20, aside="none")
    try:
        assert sync.push().ok
        ray.get([t.step.remote(4) for t in trainers])
        ray.get(receivers[2].die_at.remote("receiver", 1))  # it voted, then wrote part of v2
        report = sync.push()
        assert "died" in report.failed[2]
        live = receivers[:2]
        assert digests(live) == [ray.get(trainers[0].digest.remote())] * 2  # forward: v2 whole
        assert ray.get([r.version.remote() for r in live]) == [2, 2] and sync.committed == 2
    finally:
        sync.close()


def test_in_place_with_no_source_left_the_receivers_say_they_are_torn_and_let_go(ray_local):
    trainers = [Holder.remote(16, NBYTES, seed=1) for _ in range(2)]
    receivers = [Holder.remote(16, NBYTES, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainers, receivers, source="weights", bucket_bytes=1 << 20, aside="none")
    try:
        assert sync.push().ok
        ray.get([t.step.remote(5) for t in trainers])
        ray.get([t.die_at.remote("trainer", 1) for t in trainers])  # both copies of every byte
        with pytest.raises(tw.TensorwireError, match="no failover"):
            sync.push()
        assert ray.get([r.version.remote() for r in receivers]) == [tw.collective.TORN] * 2
        assert ray.get([r.fence_held.remote() for r in receivers]) == [[False]] * 2  # readers are not stuck
    finally:
        sync.close()


def test_aside_is_checked_and_none_needs_commit_all_and_a_second_source(ray_local):
    trainer, receiver = Holder.remote(2, 1024, seed=1), Holder.remote(2, 1024, seed=None)
    with pytest.raises(ValueError, match="aside='copy'"):
        tw.WeightSync(trainer, [receiver], source="weights", aside="copy")
    with pytest.raises(ValueError, match="'none' with commit='all'"):
        tw.WeightSync(trainer, [receiver], source="weights", commit="each", aside="none")
    with pytest.raises(ValueError, match="held by two trainers"):
        tw.WeightSync(trainer, [receiver], source="weights", aside="none")


def _until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_fence_hold_keeps_readers_out_until_let_go_even_a_reentrant_lock():
    lock, expired = threading.RLock(), []
    hold = FenceHold(lambda: lock, "test", lambda: expired.append(True))
    hold.take(timeout_s=5.0, limit_s=60.0)
    assert hold.held and not lock.acquire(timeout=0.05)  # another thread holds it
    hold.let_go()
    assert lock.acquire(timeout=5.0) and not expired
    lock.release()


def test_a_fence_hold_past_its_limit_lets_go_and_says_so():
    lock, expired = threading.Lock(), []
    hold = FenceHold(lambda: lock, "test", lambda: expired.append(lock.locked()))
    hold.take(timeout_s=5.0, limit_s=60.0)
    hold.extend(0.0)  # as between a failover's tries, once the driver is gone
    assert _until(lambda: hold.expired and not lock.locked())
    assert expired == [True]  # told while still inside the fence, before readers get in


def test_a_fence_readers_keep_is_not_taken_and_says_why():
    lock = threading.Lock()
    lock.acquire()
    hold = FenceHold(lambda: lock, "test", lambda: None)
    with pytest.raises(tw.TensorwireError, match=r"the fence was not free within 0\.1 s"):
        hold.take(timeout_s=0.1, limit_s=60.0)
    lock.release()
    assert _until(lambda: not hold.held and not lock.locked())  # it left at once when it got in
