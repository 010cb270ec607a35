"""``skip_unchanged=True``: a bucket whose bytes are those of the last version every receiver
committed is not sent again; what changed is, exactly; after a push some receiver did not
commit, everything is sent."""

from __future__ import annotations

import pytest
import ray

import tensorwire as tw
from tests.collectives.actors import Holder

TENSOR = 16 << 10  # 4 tensors of 16 KiB, one bucket each


@pytest.fixture
def members(ray_local):
    trainer = Holder.remote(4, 4 * TENSOR, 1)
    receivers = [Holder.remote(4, 4 * TENSOR, None) for _ in range(2)]
    yield trainer, receivers


@pytest.mark.parametrize("settings", [{}, {"commit": "each"}], ids=["all-or-none", "each-in-place"])
def test_only_the_buckets_that_changed_move(members, settings):
    trainer, receivers = members
    sync = tw.WeightSync(
        trainer, receivers, source="weights", bucket_bytes=TENSOR, skip_unchanged=True, progress=False, **settings
    )
    try:
        assert sync.push().moved_nbytes == 2 * 4 * TENSOR  # the first push: everything
        ray.get(trainer.change_one.remote("layer2.weight", 7.0), timeout=60)
        report = sync.push()
        assert report.ok and report.version == 2
        assert report.moved_nbytes == 2 * TENSOR  # layer2's bucket, to each receiver
        want = ray.get(trainer.digest.remote(), timeout=60)
        assert ray.get([r.digest.remote() for r in receivers], timeout=60) == [want, want]
        report = sync.push()  # nothing changed: nothing moves, the version still applies
        assert report.ok and report.moved_nbytes == 0 and sync.versions() == [3, 3]
    finally:
        sync.close()


def test_after_a_push_not_everyone_committed_everything_is_sent(members):
    trainer, receivers = members
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=TENSOR, skip_unchanged=True, progress=False)
    try:
        sync.push()
        ray.get(trainer.change_one.remote("layer1.weight", 5.0), timeout=60)
        ray.get(receivers[1].fail_at.remote("receiver", 0), timeout=60)
        assert not sync.push().ok  # receiver 1 failed taking layer1's bucket: nobody committed v2
        ray.get(receivers[1].no_faults.remote(), timeout=60)
        ray.get(trainer.change_one.remote("layer0.weight", 3.0), timeout=60)
        report = sync.push()
        assert report.ok and report.moved_nbytes == 2 * 4 * TENSOR  # no record to skip against
        want = ray.get(trainer.digest.remote(), timeout=60)
        assert ray.get([r.digest.remote() for r in receivers], timeout=60) == [want, want]
    finally:
        sync.close()


def test_skip_unchanged_refuses_publish_swap(members):
    trainer, receivers = members
    with pytest.raises(ValueError, match="publish='swap'"):
        tw.WeightSync(trainer, receivers, source="weights", skip_unchanged=True, publish="swap", progress=False)
