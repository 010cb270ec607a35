"""Ray's direct-transport behaviours (the CPU tests of Ray's own RDT suite: gloo, await, the
custom-transport one), checked on ``tensor_transport="tensorwire"`` with plain Ray actors.
Our own tests, written from the list of behaviours; docs/ray-direct-transport.md has the table
of Ray's tests and where each is checked here. Where tensorwire behaves differently on purpose
(a one-sided transport: no collective group, the driver reads directly, a failure does not
kill the actors) the test checks tensorwire's behaviour and says so."""

from __future__ import annotations

import gc
import warnings

import pytest
import ray
import torch

import tensorwire as tw
from tensorwire.runtime.ray import surface as ray_surface
from tests.helpers.observe import wait_until
from tests.integration.rdt_behaviour_actors import AsyncWorker, Worker


@pytest.fixture(scope="module")
def sender(ray_local):
    return Worker.remote()


@pytest.fixture(scope="module")
def receiver(ray_local):
    return Worker.remote()


def _published_returns_to(actor, baseline: int) -> bool:
    gc.collect()
    return wait_until(lambda: ray.get(actor.published.remote(), timeout=60) == baseline, timeout_s=60)


def test_gc_after_the_reader_is_done(sender, receiver):  # test_gc_rdt_object
    baseline = ray.get(sender.published.remote(), timeout=60)
    ref = sender.echo.remote([torch.ones(1), b"x" * 100])
    for _ in range(2):
        doubled = ray.get(receiver.double.remote(ref), timeout=60)
        assert torch.equal(doubled[0], torch.full((1,), 2.0)) and doubled[1] == b"x" * 200
    del ref, doubled
    assert _published_returns_to(sender, baseline)


def test_gc_reference_dropped_while_the_read_is_in_flight(sender, receiver):  # test_gc_del_ref_before_recv_finish
    baseline = ray.get(sender.published.remote(), timeout=60)
    ref = sender.echo.remote(torch.ones(200_000))
    result = receiver.double.remote(ref)
    del ref
    assert float(ray.get(result, timeout=60).sum()) == 400_000.0
    assert _published_returns_to(sender, baseline)


def test_reference_back_to_its_producer_and_to_another_actor(sender, receiver):
    """test_gc_intra_actor_rdt_object, test_gc_pass_ref_to_same_and_different_actors,
    test_intra_rdt_tensor_transfer, test_send_same_ref_multiple_times_intra_actor."""
    baseline = ray.get(sender.published.remote(), timeout=60)
    for value in (torch.ones(3), [torch.ones(3), 4], [torch.ones(2), torch.ones(2), 5]):
        ref = sender.echo.remote(value)
        mine = ray.get(sender.double.remote(ref), timeout=60)
        theirs = ray.get(receiver.double.remote(ref), timeout=60)
        for got in (mine, theirs):
            flat_got = got if isinstance(got, list) else [got]
            flat_value = value if isinstance(value, list) else [value]
            assert all(
                torch.equal(g, v * 2) if isinstance(v, torch.Tensor) else g == v * 2
                for g, v in zip(flat_got, flat_value, strict=True)
            )
    ref = sender.echo.remote(torch.ones(4))
    assert torch.equal(ray.get(sender.add.remote(ref, ref), timeout=60), torch.full((4,), 2.0))
    del ref, mine, theirs
    assert _published_returns_to(sender, baseline)


def test_same_reference_twice_in_one_task_and_in_two_tasks(sender, receiver):
    """test_send_same_ref_to_same_actor_task_multiple_times, ..._to_same_actor_multiple_times."""
    ref = sender.echo.remote(torch.arange(5.0))
    assert torch.equal(ray.get(receiver.add.remote(ref, ref), timeout=60), torch.arange(5.0) * 2)
    first, second = ray.get([receiver.double.remote(ref), receiver.double.remote(ref)], timeout=60)
    assert torch.equal(first, torch.arange(5.0) * 2) and torch.equal(second, first)


def test_each_task_gets_its_own_copy(sender, receiver):  # test_duplicate_objectref_transfer
    ref = sender.echo.remote(torch.zeros(1000))
    one, two = ray.get([receiver.increment.remote(ref), receiver.increment.remote(ref)], timeout=60)
    assert torch.equal(one, torch.ones(1000)) and torch.equal(two, torch.ones(1000))


def test_large_non_tensor_part_goes_through_rays_store(sender, receiver):  # test_object_in_plasma
    ref = sender.echo.remote([torch.ones(10), b"y" * (1 << 20)])
    got = ray.get(receiver.double.remote(ref), timeout=60)
    assert torch.equal(got[0], torch.full((10,), 2.0)) and got[1] == b"y" * (2 << 20)


def test_tensordict_values(sender, receiver):  # test_multiple_tensors, test_tensordict_transfer, test_nested_tensordict
    tensordict = pytest.importorskip("tensordict", reason="tensordict is in the test extra")
    inner = tensordict.TensorDict({"a": torch.ones(2), "b": torch.full((2,), 3.0)}, batch_size=[2])
    outer = tensordict.TensorDict({"inner": inner, "reward": torch.arange(2.0)}, batch_size=[2])
    got = ray.get(receiver.double.remote(sender.echo.remote([torch.ones(1), 7, outer])), timeout=60)
    assert torch.equal(got[0], torch.full((1,), 2.0)) and got[1] == 14
    doubled = got[2]
    assert torch.equal(doubled["inner"]["b"], torch.full((2,), 6.0)) and torch.equal(
        doubled["reward"], torch.arange(2.0) * 2
    )


def test_the_driver_reads_directly(sender):  # test_fetch_rdt_object_to_driver: no _use_object_store needed
    for value in (torch.ones(3), [torch.ones(3), torch.zeros(2)], [torch.ones(3), torch.zeros(2), 7]):
        got = ray.get(sender.echo.remote(value), timeout=60)
        assert repr(got) == repr(value)


def test_invalid_transport_names_are_refused(sender):  # test_invalid_tensor_transport
    with pytest.raises(ValueError, match="Invalid tensor transport"):
        ray.method(tensor_transport="tensorwirez")(lambda self: None)
    with pytest.raises(ValueError, match="Invalid tensor transport"):
        sender.double.options(tensor_transport="tensorwirez")
    with pytest.raises(ValueError, match="Invalid tensor transport"):
        ray.put(torch.ones(1), _tensor_transport="tensorwirez")


def test_per_call_transport_needs_tensor_transport_enabled(ray_local):  # test_dynamic_tensor_transport_via_options
    @ray.remote(num_cpus=0)
    class Plain:
        def make(self):
            return torch.ones(3)

    with pytest.raises(ValueError, match="enable_tensor_transport=True"):
        Plain.remote().make.options(tensor_transport="tensorwire").remote()


def test_application_errors_reach_readers_and_later_transfers_work(sender, receiver):
    """test_app_error_inter_actor, test_app_error_intra_actor, test_app_error_fetch_to_driver."""
    failing = sender.fail.remote("boom")
    for reader in (receiver, sender):
        with pytest.raises(ValueError, match="boom"):
            ray.get(reader.double.remote(failing), timeout=60)
    with pytest.raises(ValueError, match="boom"):
        ray.get(failing, timeout=60)
    assert torch.equal(
        ray.get(receiver.double.remote(sender.echo.remote(torch.ones(2))), timeout=60), torch.full((2,), 2.0)
    )


def test_retry_then_success_publishes_once(ray_local):  # test_rdt_retry_then_succeeds, ..._fetch_through_obj_store
    flaky, reader = Worker.remote(), Worker.remote()
    ref = flaky.flaky.remote(1)
    assert torch.equal(ray.get(reader.double.remote(ref), timeout=60), torch.tensor([2.0, 4.0, 6.0]))
    assert torch.equal(ray.get(ref, timeout=60), torch.tensor([1.0, 2.0, 3.0]))
    assert ray.get(flaky.published.remote(), timeout=60) == 1


def test_retries_exhausted_raise_in_the_reader(ray_local):  # test_rdt_retries_exhausted_raises
    flaky, reader = Worker.remote(), Worker.remote()
    with pytest.raises(ValueError, match="attempt 2 fails"):
        ray.get(reader.double.remote(flaky.flaky.remote(5)), timeout=60)


def test_write_after_the_last_reference_is_gone(sender, receiver):  # test_write_after_save
    ref = sender.save.remote(100)
    assert float(ray.get(receiver.double.remote(ref), timeout=60).sum()) == 200.0
    written = sender.increment_saved.remote(60)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(written, timeout=1)  # the reference is alive: the actor waits
    del ref
    gc.collect()
    assert ray.get(written, timeout=90) == 200.0


def test_reference_sent_back_and_elsewhere_warns_once(sender, receiver):  # test_send_back_and_dst_warning
    ref = sender.echo.remote(torch.ones(2))
    with pytest.warns(UserWarning, match="RDT ObjectRef"):
        ray.get([sender.double.remote(ref), receiver.double.remote(ref)], timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ray.get(receiver.double.remote(ref), timeout=60)


def test_transfer_driven_from_inside_an_actor(ray_local):  # test_transfer_from_not_actor_creator
    assert ray.get(Worker.remote().make_pair_and_hand_over.remote(1000), timeout=120) == 2000.0


def test_producer_with_busy_threads_still_serves_reads(ray_local):  # test_p2p_blocking (both variants)
    """One-sided: reads need none of the producer's threads (Ray's gloo needs its system thread)."""
    producer, reader = Worker.remote(), Worker.remote()
    ref = producer.echo.remote(torch.ones(500, 500))
    assert ray.wait([ref], timeout=60)[0] == [ref]
    busy = [producer.busy.remote(120) for _ in range(4)]  # every thread of the actor waits in Python
    assert float(ray.get(reader.double.remote(ref), timeout=60).sum()) == 500_000.0
    ray_surface.run_on_actor(producer, lambda actor: actor.unblock(), timeout_s=60)  # (its system thread)
    assert ray.get(busy, timeout=60) == [True] * 4
    per_call = producer.add.options(tensor_transport="tensorwire")  # the actor-level spelling
    assert torch.equal(
        ray.get(reader.double.remote(per_call.remote(torch.ones(2), 1)), timeout=60), torch.full((2,), 4.0)
    )


def test_object_lost_by_the_producer_fails_the_read_cleanly(sender, receiver):  # test_send_fails
    ref = sender.echo.remote(torch.ones(300_000))
    assert ray.wait([ref], timeout=60)[0] == [ref]
    ray.get(sender.lose.remote(ref.hex()), timeout=60)
    with pytest.raises(tw.ObjectFreedError):
        ray.get(receiver.double.remote(ref), timeout=60)
    assert torch.equal(
        ray.get(receiver.double.remote(sender.echo.remote(torch.ones(2))), timeout=60), torch.full((2,), 2.0)
    )


def test_producer_killed_before_creating(ray_local, receiver):  # test_send_actor_dies_before_creating
    producer = Worker.remote()
    ref = producer.block_then_make.remote(10)
    result = receiver.double.remote(ref)
    ray.kill(producer)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(result, timeout=120)
    assert torch.equal(ray.get(receiver.double.remote(torch.ones(1)), timeout=60), torch.full((1,), 2.0))


def test_reader_killed_around_its_read_leaves_the_producer_working(ray_local):  # test_recv_actor_dies
    """The producer is not killed with the reader (Ray kills both for gloo). The reader dies
    with its read queued or running (not proven in flight: the in-flight kills of tensorwire's
    own reads are in tests/reliability)."""
    producer, reader = Worker.remote(), Worker.remote()
    ref = producer.echo.remote(torch.ones(1_000_000))
    busy = reader.busy.remote(120)  # a reader thread in use
    result = reader.double.remote(ref)
    ray.kill(reader)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get([busy, result], timeout=120)
    assert float(ray.get(Worker.remote().double.remote(ref), timeout=60).sum()) == 2_000_000.0


def test_reference_reports_its_transport(sender):  # test_rdt_ref_has_tensor_transport (its first half)
    """(Its second half, ``await ref`` in the driver, is left out: Ray 2.60 does not fetch an
    RDT object for an ``await`` in the driver, for any transport; see docs/ray-direct-transport.md.)"""
    ref = sender.echo.remote(torch.ones(3))
    assert ref.tensor_transport() == "TENSORWIRE"
    assert torch.equal(ray.get(ref, timeout=60), torch.ones(3))


def test_async_actor_chain(ray_local):  # test_rdt_async_chain (its cpu case)
    first, middle, last = AsyncWorker.remote(), AsyncWorker.remote(), AsyncWorker.remote()
    total, device = ray.get(last.total.remote(middle.forward.remote(first.send.remote(100))), timeout=60)
    assert total == sum(range(100)) + 100 and device == "cpu"
