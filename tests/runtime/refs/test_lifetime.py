"""Lifetime across processes (DESIGN.md section 5): holds, transit pins, free, exits."""

from __future__ import annotations

import gc
import os
import pickle

import pytest
import torch

import tensorwire as tw
from tests.helpers.observe import segment_count, wait_until
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest


def owned(agent) -> int:
    """Objects owned now; no garbage collection, so a reference cycle would show as a leak."""
    return agent.owned_objects()


def test_local_ref_dropped_frees_at_once(agent):
    before = owned(agent)
    ref = tw.put(torch.ones(1000))
    assert owned(agent) == before + 1
    del ref
    assert owned(agent) == before


def test_remote_holder_keeps_object_until_it_drops(agent, worker):
    before = owned(agent)
    value = torch.randn(100_000)
    ref = tw.put(value)
    assert worker.call("tests.helpers.tasks:hold", ref, "r") == value.nbytes
    del ref
    gc.collect()
    assert agent.flush()  # a wrong release of ours would have been applied by now
    worker.call("tests.helpers.tasks:flush")  # and one of the worker's
    assert owned(agent) == before + 1
    worker.call("tests.helpers.tasks:drop", "r")
    assert wait_until(lambda: owned(agent) == before)


def test_reference_in_transit_is_pinned_until_received(agent, worker):
    before = owned(agent)
    value = torch.randn(50_000)
    blob = pickle.dumps(tw.put(value))  # the only Ref object is gone after this line
    gc.collect()
    assert owned(agent) == before + 1  # pinned by the blob in transit
    ref_in_worker_digest = worker.call("tests.helpers.tasks:get_digest", pickle.loads(blob))
    assert ref_in_worker_digest == digest(value)
    # the worker's Ref was dropped after the call, our unpickled copy too
    gc.collect()
    worker.call("tests.helpers.tasks:flush")
    assert wait_until(lambda: owned(agent) == before)


def test_ref_passed_on_by_a_holder_survives_the_holder_dropping(agent):
    """A -> B -> C: B forwards the reference and drops it before C registers."""
    b, c = Worker(), Worker()
    try:
        value = torch.randn(70_000)
        ref = tw.put(value)
        b.call("tests.helpers.tasks:hold", ref, "x")
        del ref
        gc.collect()
        blob_from_b = b.call("tests.helpers.tasks:pickled", "x")
        b.call("tests.helpers.tasks:drop", "x")  # drop flushes: B's release reached the owner
        assert c.call("tests.helpers.tasks:get_digest", pickle.loads(blob_from_b)) == digest(value)
    finally:
        b.close()
        c.close()


def test_free_makes_every_holder_fail_with_object_freed(agent, worker):
    ref = tw.put(torch.randn(100_000))
    worker.call("tests.helpers.tasks:hold", ref, "r")
    tw.free(ref)
    tw.free(ref)  # idempotent
    with pytest.raises(tw.ObjectFreedError):
        tw.get(ref)
    assert worker.call("tests.helpers.tasks:get_kept_error", "r", transport="host") == "ObjectFreedError"
    assert worker.call("tests.helpers.tasks:get_kept_error", "r", transport="shm") == "ObjectFreedError"


def test_free_from_a_holder_frees_at_the_owner(agent, worker):
    before = owned(agent)
    ref = tw.put(torch.randn(100_000))
    worker.call("tests.helpers.tasks:free_ref", ref)
    assert owned(agent) == before
    with pytest.raises(tw.ObjectFreedError):
        tw.get(ref)


def test_holder_that_exits_releases_its_holds(agent):
    before = owned(agent)
    w = Worker()
    ref = tw.put(torch.randn(100_000))
    w.call("tests.helpers.tasks:hold", ref, "r")
    w.call("tests.helpers.tasks:flush")
    del ref
    gc.collect()
    assert owned(agent) == before + 1
    w.kill()
    assert wait_until(lambda: owned(agent) == before, timeout_s=15)


def _rss_nbytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_returns_to_baseline_after_1000_cycles(agent, worker):
    """put -> consumer get (shm) -> drop, 1,000 times: objects, segments and RSS come back."""
    value = torch.randint(0, 100, (256 * 1024,), dtype=torch.uint8)  # 256 KiB: above inline, via shm
    expected = int(value.sum())

    def run(cycles: int) -> None:
        for _ in range(cycles):
            ref = tw.put(value)
            assert worker.call("tests.helpers.tasks:cycle", ref) == expected
            del ref

    baseline = owned(agent)
    run(50)
    worker.call("tests.helpers.tasks:flush")
    assert wait_until(lambda: owned(agent) == baseline)
    segments = segment_count()
    rss = _rss_nbytes()
    run(1000)
    worker.call("tests.helpers.tasks:flush")
    assert wait_until(lambda: owned(agent) == baseline)
    assert wait_until(lambda: segment_count() == segments)
    growth_mib = (_rss_nbytes() - rss) / 2**20
    assert growth_mib < 32, f"RSS grew by {growth_mib:.1f} MiB over 1,000 cycles of 256 KiB"
