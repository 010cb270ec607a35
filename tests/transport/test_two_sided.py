"""The two-sided protocol with real processes, for gloo and ucx: concurrency, failures, abort.

Every case checks the digest of what arrived; failure cases check the error and that the
surviving processes transfer correctly afterwards.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import tensorwire as tw
from tests.helpers.procs import Worker, outcome_when_killed
from tests.helpers.tasks import digest

TWO_SIDED = ["gloo", "ucx"]


@pytest.fixture(params=TWO_SIDED)
def transport(request):
    return request.param


@pytest.fixture
def owner():
    w = Worker(env={"TENSORWIRE_NODE_ID": "two-sided-owner"})
    yield w
    w.close()


def test_three_processes_concurrent_transfers_in_both_directions(transport):
    workers = [Worker(env={"TENSORWIRE_NODE_ID": f"node-{i}"}) for i in range(3)]
    try:
        puts = [
            [w.call("tests.helpers.tasks:put_and_return", 3 << 20, seed=10 * i + k) for k in range(2)]
            for i, w in enumerate(workers)
        ]
        for i, w in enumerate(workers):  # each fetches the four values of the other two, all at once
            refs = [ref for j in range(3) if j != i for ref, _ in puts[j]]
            w.send("tests.helpers.tasks:get_concurrently", refs, transport)
        for i, w in enumerate(workers):
            expected = [d for j in range(3) if j != i for _, d in puts[j]]
            assert w.result(timeout_s=120) == expected
    finally:
        for w in workers:
            w.close()


def test_many_tensors_and_mixed_sizes_arrive_intact(transport, owner):
    value = {f"t{i}": torch.randn(i * 37 + 1) for i in range(300)}
    value["big"] = torch.randn(1 << 18)
    value["empty"] = torch.empty(0)
    ref = tw.put(value)
    got = owner.call("tests.helpers.tasks:get_digest", ref, transport=transport)
    assert got == digest(value)


def test_producer_killed_mid_transfer(transport, owner):
    ref = owner.call("tests.helpers.tasks:put_filled", 1 << 30)
    outcome = outcome_when_killed(
        lambda: digest(tw.get(ref, transport=transport, timeout_s=60)), owner, after_s=0.15, join_s=45
    )
    full = digest(torch.full((1 << 30,), 7, dtype=torch.uint8))
    assert outcome == full or isinstance(outcome, (tw.OwnerDiedError, tw.PeerLostError)), outcome
    survivor = Worker(env={"TENSORWIRE_NODE_ID": "two-sided-survivor"})
    try:  # the consumer still transfers with surviving peers
        ref2, expected = survivor.call("tests.helpers.tasks:put_and_return", 2 << 20, seed=3)
        assert digest(tw.get(ref2, transport=transport)) == expected
    finally:
        survivor.close()


def test_consumer_killed_mid_transfer(transport, owner):
    value = torch.full((1 << 30,), 9, dtype=torch.uint8)
    ref = tw.put(value)
    owner.send("tests.helpers.tasks:get_digest", ref, transport=transport, timeout_s=60)
    time.sleep(0.15)
    owner.kill()
    deadline = time.monotonic() + 30
    while tw.stats()["transfers_serving"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tw.stats()["transfers_serving"] == 0, "the producer is still stuck serving a dead consumer"
    other = Worker(env={"TENSORWIRE_NODE_ID": "two-sided-other"})
    try:  # the producer still serves other consumers
        small = torch.arange(300_000, dtype=torch.int32)
        assert other.call("tests.helpers.tasks:get_digest", tw.put(small), transport=transport) == digest(small)
    finally:
        other.close()


def test_stalled_producer_hits_the_deadline_then_both_sides_recover(transport, owner):
    ref, expected = owner.call("tests.helpers.tasks:put_and_return", 4 << 20)
    assert digest(tw.get(ref, transport=transport)) == expected  # connected
    os.kill(owner.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(tw.TransferTimeoutError):
            tw.get(ref, transport=transport, timeout_s=1.0)
        assert time.monotonic() - start < 10
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    assert digest(tw.get(ref, transport=transport, timeout_s=30)) == expected


def test_connection_dropped_by_the_producer_is_remade(transport, owner):
    ref, expected = owner.call("tests.helpers.tasks:put_and_return", 1 << 20)
    assert digest(tw.get(ref, transport=transport)) == expected
    assert owner.call("tests.helpers.tasks:two_sided_connections", transport) == 1
    assert owner.call("tests.helpers.tasks:forget_connections", transport) == 0
    assert digest(tw.get(ref, transport=transport)) == expected  # "unknown connection" -> reconnect
    assert owner.call("tests.helpers.tasks:two_sided_connections", transport) == 1


def test_unusable_group_rendezvous_is_bounded():
    """A connect to an agent that does not answer fails within the deadline."""
    w = Worker(env={"TENSORWIRE_NODE_ID": "two-sided-stalled"})
    try:
        ref, _ = w.call("tests.helpers.tasks:put_and_return", 1 << 20)
        os.kill(w.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(tw.TransferTimeoutError):
            tw.get(ref, transport="gloo", timeout_s=1.5)
        assert time.monotonic() - start < 10
        os.kill(w.pid, signal.SIGCONT)
    finally:
        w.close()


@pytest.mark.parametrize("tls", ["tcp", "sm"])
def test_ucx_over_tcp_and_shared_memory(tls):
    env = {"UCX_TLS": f"{tls},self"}
    producer = Worker(env={**env, "TENSORWIRE_NODE_ID": "ucx-a"})
    consumer = Worker(env={**env, "TENSORWIRE_NODE_ID": "ucx-b"})
    try:
        ref, expected = producer.call("tests.helpers.tasks:put_and_return", 8 << 20, seed=5)
        assert consumer.call("tests.helpers.tasks:get_digest", ref, transport="ucx") == expected
        active = set(consumer.call("tests.helpers.tasks:ucx_active_transports"))
        published = consumer.call("tests.helpers.tasks:put_and_describe_owner", 1 << 20)["ucx"]
        assert set(published.split(",")) == active  # carried in PeerInfo by new references
        if tls == "tcp":
            assert "tcp" in active and not active & {"posix", "sysv", "cma"}, active
        else:
            assert active & {"posix", "sysv", "cma"} and "tcp" not in active, active
    finally:
        producer.close()
        consumer.close()


def test_system_ucx_is_preferred_only_with_rdma_nics_and_a_system_library():
    from tensorwire.transport.ucx import prefer_system_ucx

    env: dict[str, str] = {}
    assert not prefer_system_ucx(env, rdma_nics=[], system_ucp="libucp.so.0")
    assert not prefer_system_ucx(env, rdma_nics=["mlx5_0"], system_ucp=None)
    assert env == {}
    assert prefer_system_ucx(env, rdma_nics=["mlx5_0"], system_ucp="libucp.so.0")
    assert env == {"RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "true"}
    user = {"RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "false"}
    assert not prefer_system_ucx(user, rdma_nics=["mlx5_0"], system_ucp="libucp.so.0")
    assert user == {"RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "false"}  # the user's choice stands
