"""Stall detection (recovery/stalls.py): a trainer stopped with a real ``SIGSTOP`` (nothing of
its process runs, its control service included) at any point of a push is replaced, or left
behind when every receiver already has its bytes, without waiting for it to be resumed; the
adaptive patience; the stopped-process look it relies on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import ray

import tensorwire as tw
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.collectives.weight_sync.recovery import stalls
from tensorwire.collectives.weight_sync.recovery.stalls import StallWatch
from tensorwire.transport.hw import topology
from tests.collectives.actors import Holder, digests

NBYTES = 8 << 20


def _spec(stall_s: float = 0.0, timeout_s: float = 100.0) -> PushSpec:
    return PushSpec("s", "w", 1, "", (), 0, None, (), (), False, "", timeout_s, stall_s=stall_s)


def test_adaptive_patience_grows_with_the_slowest_bucket_and_has_a_floor(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(stalls.time, "monotonic", lambda: clock[0])
    assert StallWatch(_spec(), same_machine=True).patience_s() == stalls.PATIENCE_FLOOR_SAME_MACHINE_S  # exact look
    watch = StallWatch(_spec())
    assert watch.patience_s() == stalls.PATIENCE_FLOOR_S  # nothing seen yet
    clock[0] += 0.1
    watch.arrived()
    assert watch.patience_s() == stalls.PATIENCE_FLOOR_S  # 4 x 0.1 s is below the floor
    clock[0] += 2.0
    watch.arrived()
    clock[0] += 0.5
    watch.arrived()
    assert watch.patience_s() == stalls.PATIENCE_BUCKETS * 2.0  # the longest gap, not the last
    assert watch.stalled(10.0, responds=False)  # stopped: stalled at once
    assert not watch.stalled(10.0, responds=True)  # runs: slow, not stalled ...
    assert watch.stalled(50.0, responds=True)  # ... up to half of timeout_s for one bucket
    explicit = StallWatch(_spec(stall_s=2.5))
    assert explicit.patience_s() == 2.5 and explicit.stalled(2.5, responds=True)


def test_a_stopped_process_is_seen_stopped_and_a_resumed_one_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = topology.process_start_time(child.pid)
        assert topology.process_alive(child.pid, started) and not topology.process_stopped(child.pid, started)
        os.kill(child.pid, signal.SIGSTOP)
        deadline = threading.Event()
        for _ in range(200):  # the kernel stops it at once; the look is one read of /proc
            if topology.process_stopped(child.pid, started):
                break
            deadline.wait(0.01)
        assert topology.process_stopped(child.pid, started) and topology.process_alive(child.pid, started)
        assert not topology.process_stopped(child.pid, started + 1)  # another process with that pid: not it
        os.kill(child.pid, signal.SIGCONT)
        for _ in range(200):
            if not topology.process_stopped(child.pid, started):
                break
            deadline.wait(0.01)
        assert not topology.process_stopped(child.pid, started)
    finally:
        child.kill()
        child.wait()


def _resume_later(pid: int, after_s: float) -> tuple[threading.Timer, list[bool]]:
    """A watchdog that resumes ``pid`` after ``after_s`` and says whether it had to."""
    fired: list[bool] = []

    def resume() -> None:
        fired.append(True)
        os.kill(pid, signal.SIGCONT)

    timer = threading.Timer(after_s, resume)
    timer.start()
    return timer, fired


POINTS = ["before the push", "before its first bucket", "between buckets", "after its last", "after all were taken"]


@pytest.mark.parametrize("point", POINTS)
def test_a_trainer_stopped_with_sigstop_does_not_hold_the_push(ray_local, point):
    """Two data-parallel trainer replicas into two receivers; trainer 1 is stopped at ``point``
    of the second push. The push completes exact, from trainer 0 where trainer 1 still owed
    bytes (a read of its last bucket may need it, to hand out a descriptor), long before the
    watchdog resumes the stopped trainer; one stopped once every receiver took every bucket is
    left running, not replaced."""
    trainers = [Holder.remote(16, NBYTES, seed=1) for _ in range(2)]
    receivers = [Holder.remote(16, NBYTES, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainers, receivers, source="weights", bucket_bytes=1 << 20, timeout_s=120)
    pid = ray.get(trainers[1].pid.remote())
    try:
        first = sync.push()
        assert first.ok, first.failed
        last = max(s.bucket for s in first.timeline if s.source == "trainer 1")
        ray.get([t.step.remote(5) for t in trainers])
        expected = ray.get(trainers[0].digest.remote())
        levels = {"before its first bucket": -1, "between buckets": 1, "after its last": last}
        levels["after all were taken"] = last + 1
        if point == "before the push":
            os.kill(pid, signal.SIGSTOP)
        else:
            ray.get(trainers[1].stop_at.remote("trainer", levels[point]))
        watchdog, resumed = _resume_later(pid, 100.0)
        try:
            report = sync.push()
        finally:
            watchdog.cancel()
        assert not resumed, f"the push waited for the stopped trainer ({point})"
        assert report.ok, report.failed
        assert digests(receivers) == [expected] * 2 and sync.versions() == [2, 2]
        if point == "after all were taken":
            assert report.replaced == {}  # nothing was missing: left running, not replaced
        elif point != "after its last":
            assert list(report.replaced) == ["trainer 1"], report.replaced
            assert "stopped" in report.replaced["trainer 1"] or "stalled" in report.replaced["trainer 1"]
    finally:
        os.kill(pid, signal.SIGCONT)
        sync.close()
        ray.kill(trainers[1].ray_handle)
