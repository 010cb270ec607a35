"""Pooled host memory for fetched values: reused only once nothing is left on it."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import tensorwire as tw
from tensorwire.runtime.api import get_arguments
from tensorwire.transport.agent.core import get_agent
from tensorwire.transport.host_pool import HostPool, liveness

MIB = 1 << 20


def _address(lease) -> int:
    return lease.array.ctypes.data


def test_memory_comes_back_only_when_every_tensor_on_it_is_gone():
    pool = HostPool(16 * MIB)
    lease = pool.lease(3 * MIB)
    first = _address(lease)
    whole = torch.from_numpy(lease.array)
    piece = whole[100:200].view(torch.int32)  # a view keeps the memory as long as it lives
    array_view = piece.numpy()
    del lease, whole, piece
    gc.collect()
    assert pool.stats()["idle_nbytes"] == 0
    other = pool.lease(3 * MIB)
    assert _address(other) != first  # still in use: a new buffer
    del array_view
    gc.collect()
    assert pool.stats()["idle_nbytes"] == 3 * MIB
    again = pool.lease(3 * MIB)
    assert _address(again) == first
    assert (pool.stats()["reused"], pool.stats()["made"], pool.stats()["idle_nbytes"]) == (1, 2, 0)


def test_liveness_follows_a_pooled_mapping_not_one_leases_tensors():
    """What a registration cache asks: pooled memory outlives the tensors of one lease (its
    registration stays good) and is gone once the pool lets go of it; other memory follows
    its storage."""
    pool = HostPool(16 * MIB)
    tensor = torch.from_numpy(pool.lease(3 * MIB).array)
    alive = liveness(tensor)
    del tensor
    gc.collect()
    assert pool.stats()["idle_buffers"] == 1 and not alive.expired()  # idle in the pool: still mapped
    pool.close()
    gc.collect()
    assert alive.expired()
    plain = torch.zeros(3 * MIB, dtype=torch.uint8)
    plain_alive = liveness(plain)
    assert not plain_alive.expired()
    del plain
    gc.collect()
    assert plain_alive.expired()


def test_idle_memory_is_bounded_and_small_requests_are_not_pooled():
    pool = HostPool(8 * MIB, min_nbytes=MIB)
    assert pool.lease(MIB - 1) is None
    assert pool.lease(9 * MIB) is None  # larger than all the pool may keep
    leases = [pool.lease(3 * MIB) for _ in range(4)]
    del leases
    gc.collect()
    stats = pool.stats()
    assert (stats["idle_nbytes"], stats["idle_buffers"]) == (6 * MIB, 2)  # two of four kept
    pool.close()
    assert pool.stats()["idle_nbytes"] == 0
    lease = pool.lease(3 * MIB)
    assert lease is None  # a closed pool keeps nothing and lends nothing
    assert HostPool(0).lease(4 * MIB) is None


def test_a_discarded_lease_is_never_reused():
    pool = HostPool(16 * MIB)
    lease = pool.lease(2 * MIB)
    lease.array[:] = 7
    lease.discard()
    del lease
    gc.collect()
    assert pool.stats()["idle_nbytes"] == 0
    fresh = pool.lease(2 * MIB)
    assert pool.stats()["reused"] == 0 and int(fresh.array.max()) == 0


def test_a_buffer_given_back_after_close_is_let_go_quietly():
    pool = HostPool(16 * MIB)
    lease = pool.lease(2 * MIB)
    pool.close()
    unraisable: list = []
    previous, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        del lease  # its finalizer runs while the array still holds the buffer
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert unraisable == [] and pool.stats()["idle_nbytes"] == 0


def test_argument_values_land_in_pooled_memory_that_a_kept_value_never_shares(worker):
    nbytes = 4 * MIB
    pool = get_agent().host_pool
    before = pool.stats()
    (first,) = get_arguments([worker.call("tests.helpers.tasks:put_filled", nbytes, 1)], device=None, transport="")
    assert torch.equal(first, torch.full((nbytes,), 1, dtype=torch.uint8))
    first_address = first.data_ptr()
    del first
    gc.collect()
    (second,) = get_arguments([worker.call("tests.helpers.tasks:put_filled", nbytes, 2)], device=None, transport="")
    assert second.data_ptr() == first_address  # the first value's memory, once it was gone
    assert pool.stats()["reused"] == before["reused"] + 1
    (third,) = get_arguments([worker.call("tests.helpers.tasks:put_filled", nbytes, 3)], device=None, transport="")
    assert third.data_ptr() != second.data_ptr()  # ``second`` is still alive
    assert torch.equal(second, torch.full((nbytes,), 2, dtype=torch.uint8))
    assert torch.equal(third, torch.full((nbytes,), 3, dtype=torch.uint8))


def test_a_failed_fetch_gives_its_memory_nothing_back(worker):
    pool = get_agent().host_pool
    ref = worker.call("tests.helpers.tasks:put_filled", 4 * MIB, 5)
    worker.call("tests.helpers.tasks:free_ref", ref)
    before = pool.stats()
    with pytest.raises(tw.ObjectFreedError):
        get_arguments([ref], device=None, transport="")
    gc.collect()
    after = pool.stats()
    assert after["reused"] + after["made"] == before["reused"] + before["made"] + 1  # it leased a buffer
    taken = (after["reused"] - before["reused"]) * 4 * MIB  # an idle one, if there was one
    assert after["idle_nbytes"] == before["idle_nbytes"] - taken  # and gave nothing back
