"""``sync.push_async()``: it returns while the push runs, the trainers train meanwhile (their
own calls run beside the push), and the receivers get the version as it was when the push
started; one push at a time."""

from __future__ import annotations

import threading

import pytest
import ray

import tensorwire as tw
from tests.collectives.actors import Holder

NBYTES = 64 << 10


@pytest.fixture
def members(ray_local):
    trainer = Holder.remote(4, NBYTES, 1)
    receivers = [Holder.remote(4, NBYTES, None) for _ in range(2)]
    # 4 KiB buckets: 16 of them, at most two staged per stream, so a trainer whose reader waits
    # has most of its buckets still to read from its tensors when it trains the next step
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=4 << 10, progress=False)
    yield trainer, receivers, sync
    sync.close()


def _release_later(path, seconds: float) -> threading.Timer:
    """A safety net: a push_async that blocked would be released (and fail the test) here."""
    timer = threading.Timer(seconds, path.touch)
    timer.daemon = True
    timer.start()
    return timer


def test_the_trainer_trains_while_the_push_moves_the_version_it_started_with(members, tmp_path):
    trainer, receivers, sync = members
    started_with = ray.get(trainer.digest.remote(), timeout=60)
    go = tmp_path / "go"
    blocked = receivers[0].block_until.remote(str(go))  # receiver 0 takes nothing until released
    safety = _release_later(go, 90)
    handle = sync.push_async()
    assert not handle.done() and handle.version == 1  # it returned with the push still running
    assert handle.snapshot_nbytes == sum(ray.get(trainer.sizes.remote(), timeout=60))
    ray.get(trainer.step.remote(7), timeout=60)  # the next step runs beside the push being served
    assert not handle.done() and handle.report is None
    with pytest.raises(RuntimeError, match="in flight"):
        sync.push()
    with pytest.raises(RuntimeError, match="in flight"):
        sync.push_async()
    with pytest.raises(RuntimeError, match="in flight"):
        sync.add_receiver(Holder.remote(4, NBYTES, None))
    go.touch()
    assert ray.get(blocked, timeout=60)
    safety.cancel()
    report = handle.result(timeout_s=120)
    assert report.ok and report.version == 1 and handle.report is report
    assert ray.get([r.digest.remote() for r in receivers], timeout=60) == [started_with] * 2  # not the step's
    assert ray.get([r.version.remote() for r in receivers], timeout=60) == [1, 1]
    trained = ray.get(trainer.digest.remote(), timeout=60)
    assert trained != started_with
    assert sync.push().ok  # the next push: the trained weights
    assert ray.get([r.digest.remote() for r in receivers], timeout=60) == [trained] * 2


def test_without_a_snapshot_nothing_is_copied_and_the_handle_gives_the_report(members):
    trainer, receivers, sync = members
    handle = sync.push_async(snapshot=False)  # the caller leaves the trainer's tensors alone
    assert handle.snapshot_nbytes == 0
    report = handle.result(timeout_s=120)
    assert report.ok and handle.done() and repr(handle) == "PushHandle(v1, done)"
    now = ray.get(trainer.digest.remote(), timeout=60)
    assert ray.get([r.digest.remote() for r in receivers], timeout=60) == [now] * 2


def test_a_trainer_that_cannot_copy_refuses_and_a_failed_push_raises_from_its_handle(members):
    trainer, _receivers, sync = members
    ray.get(trainer.reshape_first.remote(), timeout=60)  # its tensors no longer match the plan
    with pytest.raises(tw.TensorwireError, match="could not copy"):
        sync.push_async()
    handle = sync.push_async(snapshot=False)
    with pytest.raises(Exception, match="changed shape"):
        handle.result(timeout_s=120)
    assert handle.done() and handle.report is None and repr(handle) == "PushHandle(v1, failed)"


def test_the_result_honours_its_timeout(members, tmp_path):
    _trainer, receivers, sync = members
    go = tmp_path / "go"
    blocked = receivers[0].block_until.remote(str(go))
    safety = _release_later(go, 90)
    handle = sync.push_async()
    with pytest.raises(TimeoutError, match=r"push v1 is not done within 0.5 s"):
        handle.result(timeout_s=0.5)
    go.touch()
    safety.cancel()
    assert ray.get(blocked, timeout=60) and handle.result(timeout_s=120).ok
