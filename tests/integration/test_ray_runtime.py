"""End-to-end on a local Ray instance: actors and tasks passing tensors by reference."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import pytest
import ray
import torch

import tensorwire as tw
from tensorwire.runtime.ray.heap import FREEZE_ENV
from tests.helpers.tasks import digest
from tests.integration.actors import (
    AsyncConsumer,
    Consumer,
    HeapProbe,
    Producer,
    make_state,
    task_digest,
    task_make,
    task_tensor,
)


@pytest.fixture(scope="module")
def producer(ray_local):
    return Producer.remote()


@pytest.fixture(scope="module")
def consumer(ray_local):
    return Consumer.remote()


def test_state_dict_by_reference_actor_to_actor(producer, consumer):
    ref = producer.make.remote(16, 8 << 20, seed=1)
    assert isinstance(ref, ray.ObjectRef) and ref.tensor_transport() == "TENSORWIRE"  # Ray's own reference
    got, transport = ray.get(consumer.digest_and_transport.remote(ref))
    assert got == digest(make_state(16, 8 << 20, seed=1))
    assert transport == "shm"  # same node, host memory, above the inline limit
    assert digest(tw.get(ref)) == got  # and in the driver


def test_transfers_reach_rays_metrics(producer, consumer):
    before = ray.get(consumer.ray_metrics_recorded.remote())
    ray.get(consumer.digest.remote(producer.tensor.remote(200_000)))
    assert ray.get(consumer.ray_metrics_recorded.remote()) == before + 1


def test_nested_values_and_refs_nested_in_arguments(producer, consumer):
    ref = producer.nested.remote()
    value = tw.get(ref)
    assert value["n"] == 3 and value["a"][1][1] == "tag"
    second = producer.tensor.remote(1000, fill=4)
    kinds = ray.get(consumer.kinds.remote([ref], {"x": (second,)}))
    assert kinds == ["list", "dict"]
    got = ray.get(consumer.digest.remote({"first": ref, "more": [second, 5]}))
    assert got == digest({"first": value, "more": [torch.full((1000,), 4, dtype=torch.uint8), 5]})


def test_references_as_keyword_arguments_and_mixed_with_values(producer, consumer):
    first, second = producer.tensor.remote(70_000, fill=2), producer.tensor.remote(1000, fill=3)
    expected = {"a": torch.full((70_000,), 2, dtype=torch.uint8), "b": [5, torch.full((1000,), 3, dtype=torch.uint8)]}
    assert ray.get(consumer.digest.remote(value={"a": first, "b": [5, second]})) == digest(expected)
    assert ray.get(consumer.kinds.remote(first, b=[second])) == ["Tensor", "list"]


def test_many_references_in_one_get_and_many_awaits_at_once(producer):
    """More references than tensorwire's read threads: reads Ray starts run on a pool of their own."""
    refs = [producer.tensor.remote(100_000, fill=i) for i in range(12)]
    assert [int(v[0]) for v in tw.get(refs, timeout_s=120)] == list(range(12))

    async def main():
        return await asyncio.gather(*(tw.get_async(r, timeout_s=120) for r in refs))

    assert [int(v[-1]) for v in asyncio.run(main())] == list(range(12))


def test_a_failed_producer_passed_unresolved_raises_its_error_in_the_caller(producer, consumer):
    with pytest.raises(ValueError, match="the producer failed"):
        consumer.fetch_error.remote({"ref": tw.passthrough(producer.fail.remote("the producer failed"))})


def test_host_arguments_reuse_memory_only_once_the_last_call_let_go_of_it(producer, consumer):
    nbytes = 3 << 20

    def filled(fill: int) -> str:
        return digest(torch.full((nbytes,), fill, dtype=torch.uint8))

    got, first = ray.get(consumer.digest_and_address.remote(producer.tensor.remote(nbytes, fill=1)))
    assert got == filled(1)
    got, second = ray.get(consumer.digest_and_address.remote(producer.tensor.remote(nbytes, fill=2)))
    assert (got, second) == (filled(2), first)  # the argument landed in the memory of the last one
    kept = ray.get(consumer.keep_argument.remote(producer.tensor.remote(nbytes, fill=3)))
    got, third = ray.get(consumer.digest_and_address.remote(producer.tensor.remote(nbytes, fill=4)))
    assert got == filled(4) and third != kept
    assert ray.get(consumer.kept_argument_digest.remote()) == filled(3)  # a kept argument is never reused


def test_a_task_result_follows_rays_rules_in_an_actor_argument(consumer):
    """A task's result sits in Ray's object store: resolved at top level, left as the
    reference when nested (Ray's idiom for passing one on unread), which ``tw.get`` reads."""
    staged = task_tensor.remote(2 << 20, 5)  # a tw.remote task's result waits in Ray's object store
    expected = torch.full((2 << 20,), 5, dtype=torch.uint8)
    assert ray.get(consumer.digest.remote(staged)) == digest(expected)
    assert ray.get(consumer.kinds.remote({"w": staged}, [staged])) == ["dict", "list"]
    assert ray.get(consumer.fetch_error.remote({"ref": staged})) == "ok"  # tw.get of the nested reference


def test_thousand_tensor_state_dict(producer, consumer):
    ref = producer.make.remote(1000, 4 << 20, seed=2)
    assert ray.get(consumer.digest.remote(ref)) == digest(make_state(1000, 4 << 20, seed=2))


def test_tasks_consume_refs_and_stage_results(producer):
    ref = producer.tensor.remote(300_000, fill=6)
    assert ray.get(task_digest.remote(ref)) == digest(torch.full((300_000,), 6, dtype=torch.uint8))
    staged = task_make.remote(100_000)
    assert isinstance(staged, ray.ObjectRef) and not staged.tensor_transport()  # in Ray's object store
    value = tw.get(staged)
    assert torch.equal(value["inner"], torch.full((100_000,), 9, dtype=torch.uint8))
    assert tw.get(task_digest.remote(staged)) == digest(value)


def test_ref_passed_back_to_its_producer_is_the_same_tensor(producer):
    ref = producer.make.remote(4, 1 << 20)
    assert ray.get(producer.is_same_as_state.remote(ref)) is True


def test_put_in_driver_and_get_in_a_plain_ray_actor(consumer):
    @ray.remote(num_cpus=0)
    class Plain:
        def fetch(self, holder):
            return digest(tw.get(holder["ref"]))

    value = {"w": torch.randn(200_000)}
    ref = tw.put(value)
    plain = Plain.remote()
    assert ray.get(plain.fetch.remote({"ref": ref})) == digest(value)


def test_per_call_transport_option(producer, consumer):
    ref = producer.tensor.remote(500_000)
    got, transport = ray.get(consumer.digest_and_transport.options(transport="host").remote(ref))
    assert transport == "host" and got == digest(torch.ones(500_000, dtype=torch.uint8))


def test_a_methods_transport_is_its_readers_default(producer, consumer):
    expected = digest(torch.full((500_000,), 3, dtype=torch.uint8))
    got, transport = ray.get(consumer.digest_and_transport.remote(producer.tensor_over_host.remote(500_000, 3)))
    assert (got, transport) == (expected, "host")  # the selector alone picks shm on one node
    assert digest(tw.get(producer.tensor_over_host.remote(500_000, 3))) == expected
    assert tw.stats()["recent"][-1].transport == "host"
    got, transport = ray.get(consumer.digest_and_transport.remote(producer.tensor.remote(500_000, 3)))
    assert (got, transport) == (expected, "shm")


def test_per_call_device_places_lifted_arguments(producer, consumer):
    """``.options(device=)`` moves what Ray delivered (top level and nested) to that device
    (``meta`` stands for a device this CPU machine lacks)."""
    first, second = producer.tensor.remote(10_000), producer.tensor.remote(20_000)
    assert ray.get(consumer.device_types.remote(first, {"nested": second})) == ["cpu", "cpu"]
    moved = consumer.device_types.options(device="meta").remote(first, {"nested": second})
    assert ray.get(moved) == ["meta", "meta"]


def test_wait_and_await(producer):
    slow = producer.slow.remote(1.0, 10)
    fast = tw.put(torch.ones(3))
    ready, not_ready = tw.wait([slow, fast], num_returns=1, timeout_s=0.5)
    assert ready == [fast] and not_ready == [slow]
    ready, _ = tw.wait([slow, fast], num_returns=2, timeout_s=30)
    assert len(ready) == 2

    async def main():
        return await tw.get_async(slow)  # (Ray 2.60's `await ref` does not read a direct-transport reference)

    assert torch.equal(asyncio.run(main()), torch.ones(10, dtype=torch.uint8))


def test_async_actor_resolves_and_produces(producer, ray_local):
    actor = AsyncConsumer.remote()
    ref = producer.tensor.remote(70_000, fill=2)
    assert ray.get(actor.digest.remote(ref)) == digest(torch.full((70_000,), 2, dtype=torch.uint8))
    produced = actor.produce.remote(50_000)
    assert torch.equal(tw.get(produced), torch.full((50_000,), 3, dtype=torch.uint8))
    assert ray.get(actor.await_ref.remote({"ref": tw.passthrough(produced)})) == digest(tw.get(produced))


def test_concurrent_transfers_into_a_threaded_actor(producer, consumer):
    refs = [producer.tensor.remote(2 << 20, fill=i) for i in range(6)]
    results = ray.get([consumer.slow_digest.remote(r, 0.05) for r in refs])
    assert results == [digest(torch.full((2 << 20,), i, dtype=torch.uint8)) for i in range(6)]


def test_caller_drops_ref_before_consumers_resolve_it(producer):
    """No premature free: the caller passes a pending ref to two actors and drops it at once."""
    first, second = Consumer.remote(), Consumer.remote()
    ref = producer.slow.remote(0.5, 400_000)
    a = first.digest.remote(ref)
    b = second.slow_digest.remote(ref, 1.0)
    del ref
    gc.collect()
    expected = digest(torch.ones(400_000, dtype=torch.uint8))
    assert ray.get([a, b]) == [expected, expected]


def test_unresolved_refs_kept_by_a_consumer(producer, consumer):
    ref = producer.tensor.remote(100_000, fill=8)
    ray.get(consumer.keep_ref.remote(ref))
    del ref
    gc.collect()
    time.sleep(0.3)
    assert ray.get(consumer.get_kept.remote()) == digest(torch.full((100_000,), 8, dtype=torch.uint8))


def test_mutation_semantics_reference_and_snapshot(producer):
    small = producer.tensor.remote(1000, fill=1)  # inline: copied into the reference at return
    tw.get(small)
    ray.get(producer.mutate_last.remote(5))
    assert int(tw.get(small)[0]) == 1
    by_ref = producer.tensor.remote(100_000, fill=1)
    tw.get(by_ref)  # the call has returned
    ray.get(producer.mutate_last.remote(7))
    assert int(tw.get(by_ref, transport="host")[0]) == 7  # a reference, like a Python object
    snap = producer.tensor_snapshot.remote(100_000, fill=1)
    tw.get(snap)
    ray.get(producer.mutate_last.remote(9))
    assert int(tw.get(snap, transport="host")[0]) == 1


def test_producer_killed_mid_flight_and_consumer_stays_usable(consumer):
    victim = Producer.remote()
    pid = ray.get(victim.pid.remote())
    ready = victim.tensor.remote(1 << 20)
    tw.get(ready)
    pending = victim.slow.remote(30, 10)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(tw.OwnerDiedError):
        tw.get(pending, timeout_s=30)
    assert ray.get(consumer.fetch_error.remote({"ref": tw.passthrough(ready)})) == "OwnerDiedError"
    with pytest.raises(tw.OwnerDiedError):  # resolving an argument fails in the caller
        ray.get(consumer.digest.remote(ready))
    assert time.monotonic() - start < 30  # before the deadline: noticed, not timed out
    assert ray.get(consumer.digest.remote(torch.ones(2))) == digest(torch.ones(2))  # still usable


def test_consumer_killed_releases_its_holds(producer):
    before = ray.get(producer.owned.remote())
    holder = Consumer.remote()
    ref = producer.tensor.remote(200_000)
    ray.get(holder.keep_ref.remote(ref))
    ray.get(holder.get_kept.remote())
    del ref
    gc.collect()
    assert ray.get(producer.owned.remote()) > before
    os.kill(ray.get(holder.pid.remote()), signal.SIGKILL)
    deadline = time.monotonic() + 20
    while ray.get(producer.owned.remote()) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(producer.owned.remote()) == before


def test_500_cycles_return_producer_memory_to_baseline(producer, consumer):
    def cycles(n: int) -> None:
        for i in range(n):
            ref = producer.tensor.remote(256 * 1024, fill=i % 200)
            assert ray.get(consumer.digest.remote(ref)) == digest(torch.full((256 * 1024,), i % 200, dtype=torch.uint8))
            del ref

    cycles(30)
    ray.get(consumer.flush.remote())
    gc.collect()
    baseline_objects = ray.get(producer.owned.remote())
    baseline_rss = ray.get(producer.rss_nbytes.remote())
    cycles(500)
    ray.get(consumer.flush.remote())
    gc.collect()
    deadline = time.monotonic() + 10
    while ray.get(producer.owned.remote()) > baseline_objects and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(producer.owned.remote()) <= baseline_objects
    growth_mib = (ray.get(producer.rss_nbytes.remote()) - baseline_rss) / 2**20
    assert growth_mib < 48, f"producer RSS grew {growth_mib:.1f} MiB over 500 cycles of 256 KiB"


def test_result_dropped_unused_is_released(producer):
    """A @tw.method result nobody fetched or passed on must not stay pinned in the producer."""
    before = ray.get(producer.owned.remote())
    ref = producer.tensor.remote(300_000)
    del ref
    deadline = time.monotonic() + 15
    while ray.get(producer.owned.remote()) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(producer.owned.remote()) == before


def test_an_actor_freezes_what_it_has_at_its_first_call_only(ray_local):
    probe = HeapProbe.remote()
    try:
        frozen, walked = ray.get(probe.collector_view.remote())
        assert frozen > 10_000 and not walked  # imports and __init__'s state: no longer walked by full collections
        ray.get(probe.make_a_cycle.remote())
        assert ray.get(probe.drop_the_cycle.remote())  # made after the first call: still collected
    finally:
        ray.kill(probe.ray_handle)


def test_gc_freeze_off_leaves_the_collector_alone(ray_local):
    probe = HeapProbe.options(runtime_env={"env_vars": {FREEZE_ENV: "0"}}).remote()
    try:
        assert ray.get(probe.collector_view.remote()) == (0, True)
    finally:
        ray.kill(probe.ray_handle)
