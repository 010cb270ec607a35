"""Failover: a trainer that dies mid-push is replaced by the trainers holding the same bytes;
without one the push fails and the receivers keep their version."""

from __future__ import annotations

import pytest
import ray

import tensorwire as tw
from tests.collectives.actors import Holder

NBYTES = 8 << 20


def digests(actors) -> list[str]:
    return ray.get([a.digest.remote() for a in actors])


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
    assert {k[0] for k in report.pairs} == {"trainer 0"}
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
    with pytest.raises(tw.TensorwireError, match="no failover: it was the only trainer; the receivers keep"):
        sync.push()
    assert digests(receivers) == before and sync.versions() == [1, 1]
