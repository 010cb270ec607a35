"""Migration suite: the behaviours Ray's direct-transport (RDT) suite checks for its CPU
transport (its gloo and await tests), checked on tensorwire with the mapping of
docs/ray-direct-transport.md: ``@ray.method(tensor_transport="gloo")`` becomes ``@tw.method``,
no collective group is created, and everything else is Ray's own API (``ray.get``,
``ray.wait``, ``await``). Our own tests, written from the list of behaviours; where tensorwire
differs on purpose (actors survive failures, small values are copied at return) the test
checks tensorwire's behaviour and says so."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import pytest
import ray
import torch

import tensorwire as tw
from tensorwire.transport.backends.shm import cma
from tests.helpers.observe import wait_until
from tests.integration.actors import Producer
from tests.integration.rdt_actors import AsyncEcho, Box, Echo


@pytest.fixture(scope="module")
def sender(ray_local):
    return Echo.remote()


@pytest.fixture(scope="module")
def receiver(ray_local):
    return Echo.remote()


def _owned_returns_to(actor, baseline: int) -> bool:
    gc.collect()
    return wait_until(lambda: ray.get(actor.owned.remote()) == baseline, timeout_s=60)


# ---------------------------------------------------------------------- point to point


@pytest.mark.parametrize("shape", [(1,), (500, 500)])  # inline and by reference
def test_p2p(sender, receiver, shape):
    tensor = torch.randn(shape)
    assert torch.equal(ray.get(receiver.double.remote(sender.echo.remote(tensor))), tensor * 2)


def test_p2p_with_cpu_data(sender, receiver):
    assert ray.get(receiver.double.remote(sender.echo.remote(123))) == 246


def test_mixed_cpu_and_tensor_data(sender, receiver):
    tensor = torch.randn(3)
    got = ray.get(receiver.double.remote(sender.echo.remote([tensor, 21])))
    assert torch.equal(got[0], tensor * 2) and got[1] == 42


def test_large_non_tensor_part(sender, receiver):
    data = [torch.randn(1), b"1" * 1_000_000]  # the skeleton is big; it travels with the reference
    got = ray.get(receiver.double.remote(sender.echo.remote(data)))
    assert torch.equal(got[0], data[0] * 2) and got[1] == data[1] * 2


def test_multiple_tensors_and_containers(sender, receiver):
    data = [torch.randn(1), torch.randn(2), 5, Box(torch.ones(2), torch.arange(3), "t"), {"k": torch.ones(4)}]
    got = ray.get(receiver.double.remote(sender.echo.remote(data)))
    assert torch.equal(got[0], data[0] * 2) and torch.equal(got[1], data[1] * 2) and got[2] == 10
    assert isinstance(got[3], Box) and torch.equal(got[3].second, torch.arange(3) * 2)
    assert torch.equal(got[4]["k"], torch.full((4,), 2.0))


def test_p2p_while_the_sender_is_busy(receiver, ray_local):
    """RDT's sender must run a transfer task; tensorwire's one-sided reads need nothing of the
    sender's thread (an actor with one thread, busy in a long call)."""
    busy_sender = Producer.remote()
    ref = busy_sender.tensor.remote(1 << 20, 4)
    ray.wait([ref], timeout=60)
    busy = busy_sender.slow.remote(120, 1)
    assert ray.get(receiver.double.remote(ref)).sum().item() == 8 << 20
    assert ray.wait([busy], timeout=0)[1] == [busy]  # the sender was still in its long call
    ray.kill(busy_sender)


# ---------------------------------------------------------------------- the same ref many times


def test_same_ref_to_the_same_task_twice(sender, receiver):
    tensor = torch.randn(1)
    ref = sender.echo.remote(tensor)
    assert torch.equal(ray.get(receiver.add.remote(ref, ref)), tensor * 2)


def test_same_ref_to_the_same_actor_many_times(sender, receiver):
    tensor = torch.randn(300_000)  # by reference
    ref = sender.echo.remote(tensor)
    for _ in range(3):
        assert torch.equal(ray.get(receiver.double.remote(ref)), tensor * 2)


def test_same_ref_to_the_same_and_other_actors(sender, receiver):
    baseline = 0
    assert _owned_returns_to(sender, baseline)  # what earlier tests dropped is gone
    tensor = torch.randn(300_000)
    ref = sender.echo.remote(tensor)
    first, second = sender.double.remote(ref), receiver.double.remote(ref)
    assert torch.equal(ray.get(first), tensor * 2) and torch.equal(ray.get(second), tensor * 2)
    del ref
    assert _owned_returns_to(sender, baseline)


def test_intra_actor_refs(sender):
    tensor, cpu = torch.randn(1), 17
    assert torch.equal(ray.get(sender.double.remote(sender.echo.remote(tensor))), tensor * 2)
    got = ray.get(sender.double.remote(sender.echo.remote([tensor, cpu])))
    assert torch.equal(got[0], tensor * 2) and got[1] == 34
    ref = sender.echo.remote(torch.randn(300_000))
    assert torch.equal(ray.get(sender.add.remote(ref, ref)), ray.get(ref) * 2)


def test_refs_passed_to_tasks(sender):
    @tw.remote(num_cpus=0)
    def total(value) -> float:  # in float64: a float32 sum's rounding depends on the thread count
        return float(value.double().sum())

    tensor = torch.randn(300_000)
    ref = sender.echo.remote(tensor)
    assert ray.get(total.remote(ref)) == pytest.approx(float(tensor.double().sum()))
    assert ray.get(total.remote(ref)) == pytest.approx(float(tensor.double().sum()))


# ---------------------------------------------------------------------- garbage collection


def test_gc_after_the_receiver_finishes(sender, receiver):
    baseline = 0
    assert _owned_returns_to(sender, baseline)
    ref = sender.echo.remote(torch.randn(300_000))
    assert ray.get(receiver.double.remote(ref)).shape == (300_000,)
    assert ray.get(sender.owned.remote()) == baseline + 1  # the driver still holds ref
    del ref
    assert _owned_returns_to(sender, baseline)


def test_gc_ref_dropped_before_the_receiver_finishes(sender, receiver):
    baseline = 0
    assert _owned_returns_to(sender, baseline)
    tensor = torch.randn(300_000)
    ref = sender.echo.remote(tensor)
    result = receiver.double.remote(ref)
    del ref  # before the receiver has even started: the call keeps the value alive
    gc.collect()
    assert torch.equal(ray.get(result), tensor * 2)
    assert _owned_returns_to(sender, baseline)


# ---------------------------------------------------------------------- errors and failures


def test_application_errors_reach_the_driver(sender, receiver):
    with pytest.raises(RuntimeError, match="producer broke"):
        ray.get(receiver.double.remote(sender.fail.remote("producer broke")))
    with pytest.raises(RuntimeError, match=r"consumer broke: got \(300000,\)"):
        ray.get(receiver.fail_on.remote(sender.echo.remote(torch.randn(300_000)), "consumer broke"))
    assert ray.get(receiver.double.remote(sender.echo.remote(2))) == 4  # both still usable


def test_producer_dies_before_the_send(receiver, ray_local):
    """Different from RDT on purpose: the consumer's call fails with OwnerDiedError and the
    consumer stays usable (RDT kills the actors of a failed transfer)."""
    victim = Echo.remote()
    ref = victim.make.remote(1 << 20, 1)
    ray.wait([ref], timeout=60)
    pid = ray.get(victim.pid.remote())
    os.kill(pid, signal.SIGKILL)
    # Until its parent reaps it the killed process still exists, and a same-node read of its
    # shared memory can then succeed: wait for it to be gone (an observable state, no sleep).
    assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout_s=60)
    with pytest.raises(tw.OwnerDiedError):
        ray.get(receiver.double.remote(ref))
    with pytest.raises(tw.OwnerDiedError):
        ray.get(ref)  # and in the driver
    assert ray.get(receiver.double.remote(torch.ones(2))).sum().item() == 4


def test_producer_dies_during_the_call(receiver, ray_local):
    victim = Echo.remote()
    pid = ray.get(victim.pid.remote())
    ref = victim.slow.remote(60, 1 << 20)
    result = receiver.double.remote(ref)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises((tw.OwnerDiedError, ray.exceptions.RayActorError)):
        ray.get(result, timeout=120)
    assert ray.get(receiver.double.remote(3)) == 6


# ---------------------------------------------------------------------- the driver, await, wait


def test_fetch_to_the_driver(sender):
    tensor = torch.randn(300_000)
    ref = sender.echo.remote({"w": tensor, "step": 3})
    assert torch.equal(ray.get(ref)["w"], tensor) and ray.get(ref)["step"] == 3
    assert torch.equal(tw.get(ref)["w"], tensor)


def test_await_refs(sender):
    """``await tw.get_async(ref)``: Ray 2.60's own ``await ref`` does not read a direct-transport
    reference (for any transport)."""

    async def main():
        first, second = sender.echo.remote(torch.ones(300_000)), sender.echo.remote(torch.full((10,), 2.0))
        return await asyncio.gather(tw.get_async(first), tw.get_async(second))

    first, second = asyncio.run(main())
    assert first.sum().item() == 300_000 and second.sum().item() == 20
    actor = AsyncEcho.remote()
    assert ray.get(actor.await_nested.remote({"ref": tw.passthrough(sender.echo.remote(torch.ones(50_000)))})) == 50_000
    assert ray.get(actor.total.remote(actor.make.remote(1000, 3))) == 3000
    ray.kill(actor)


def test_ray_wait_on_refs(sender):
    slow, fast = sender.slow.remote(30, 10), sender.echo.remote(torch.ones(3))
    ready, not_ready = ray.wait([slow, fast], num_returns=1, timeout=60)
    assert ready == [fast] and not_ready == [slow]
    assert tw.wait([slow, fast], num_returns=1, timeout_s=60)[0] == [fast]


# ---------------------------------------------------------------------- a documented difference


def test_small_values_are_copied_at_return(sender):
    """RDT hands out references for every size; tensorwire copies values of at most 32 KiB
    into the reference when the method returns, so a later in-place change shows only in
    larger values read from the actor's tensor itself (two-sided transports and same-node shm's
    direct reads; with direct reads off, shm reads the segment filled when the value left)."""
    small = sender.make.remote(1000, 1)
    ray.wait([small], timeout=60)
    ray.get(sender.fill_last.remote(9))
    assert int(tw.get(small).sum()) == 1000
    large = sender.make.remote(1 << 20, 1)
    ray.wait([large], timeout=60)
    ray.get(sender.fill_last.remote(9))
    assert int(tw.get(large, transport="host").sum()) == 9 << 20  # read from the actor's tensor itself
    direct = cma.unavailable_reason() is None  # the actor, on this node, detects the same
    assert int(tw.get(large, transport="shm").sum()) == (9 << 20 if direct else 1 << 20)
