"""Late joiners: a receiver added between pushes holds the last committed version when
``add_receiver`` returns, from a replica when one has it, else from the trainers."""

from __future__ import annotations

import ray

import tensorwire as tw
from tests.collectives.actors import Holder

NBYTES = 8 << 20


def holder(seed: int | None = None):
    return Holder.remote(32, NBYTES, seed=seed)


def digest(actor) -> str:
    return ray.get(actor.digest.remote())


def test_a_late_joiner_copies_the_committed_version_from_a_replica_not_the_moved_on_trainer(ray_local):
    trainer, receivers = holder(seed=1), [holder(), holder()]
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=1 << 20)
    assert sync.push().ok
    v1 = digest(receivers[0])
    ray.get(trainer.step.remote(5))  # the trainer moved on; version 1 is still the committed one
    newcomer = holder()
    rid = sync.add_receiver(newcomer)
    assert sync.caught_up == {rid: "receiver 0"}
    assert digest(newcomer) == v1 != digest(trainer)
    assert sync.versions() == [1, 1, 1]
    assert sync.push().ok  # and it takes part in the next push like the others
    assert [digest(r) for r in (*receivers, newcomer)] == [digest(trainer)] * 3
    assert sync.versions() == [2, 2, 2]
    sync.close()


def test_without_a_replica_the_joiner_is_pushed_from_the_trainers_and_a_fresh_sync_pushes_nothing(ray_local):
    trainer, first = holder(seed=1), holder()
    sync = tw.WeightSync(trainer, [first], source="weights", bucket_bytes=1 << 20)
    early = holder()
    assert sync.add_receiver(early, catch_up=True) == 1 and sync.caught_up == {}  # nothing committed yet
    assert sync.versions() == [0, 0]
    assert sync.push().ok
    sync.remove_receiver(0)
    sync.remove_receiver(1)
    late = holder()
    rid = sync.add_receiver(late)
    assert sync.caught_up == {rid: "trainers"}
    assert digest(late) == digest(trainer) and sync.versions() == [1]
    skipped = holder()
    sync.add_receiver(skipped, catch_up=False)
    assert sync.versions() == [1, 0]
    sync.close()


def test_a_joiner_of_another_layout_is_pushed_from_the_trainers_while_the_others_stay(ray_local):
    trainer, receivers = holder(seed=1), [holder(), holder()]
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=1 << 20)
    assert sync.push().ok
    half = Holder.remote(16, NBYTES // 2, seed=None)  # the first 16 of the 32 tensors: no replica has it
    rid = sync.add_receiver(half)
    assert sync.caught_up == {rid: "trainers"} and sync.versions() == [1, 1, 1]
    trainer_weights, got = ray.get([trainer.sizes.remote(), half.sizes.remote()])
    assert got == trainer_weights[:16]
    assert sync.push().ok and sync.versions() == [2, 2, 2]
    sync.close()
