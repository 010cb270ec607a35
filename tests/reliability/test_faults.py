"""Faults with real processes, for every transport that exists here (inline, shm, host)."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest
import torch

import tensorwire as tw
from tensorwire.runtime.refs.ref import Ref, RefState
from tests.helpers.inflight import SharedBuffer, freeze_then_kill, wait_in_flight
from tests.helpers.observe import segment_count, wait_until
from tests.helpers.procs import Worker
from tests.helpers.proxy import DroppingProxy
from tests.helpers.tasks import digest

TWO_SIDED_AND_SHM = ["shm", "host"]


@pytest.mark.parametrize("transport", TWO_SIDED_AND_SHM)
def test_producer_dies_after_a_transfer(transport):
    owner = Worker()
    try:
        ref, expected = owner.call("tests.helpers.tasks:put_and_return", 3 << 20)
        copy = tw.get(ref, transport=transport)
        view = tw.get(ref, transport=transport, view=True)
        owner.kill()
        assert digest(copy) == expected  # what arrived stays intact
        assert digest(view) == expected  # a copy-on-write view outlives the producer
        with pytest.raises(tw.OwnerDiedError):
            tw.get(ref, transport=transport, timeout_s=10)
    finally:
        owner.close()


def test_inline_values_stay_readable_after_their_owner_died():
    """Documented exception: inline bytes travel inside the reference."""
    owner = Worker()
    try:
        ref, expected = owner.call("tests.helpers.tasks:put_and_return", 1000)
        owner.kill()
        assert digest(tw.get(ref)) == expected
    finally:
        owner.close()


def test_other_transfers_continue_when_one_producer_dies():
    """One producer is frozen, then killed, while its bytes provably arrive at the consumer;
    the consumer gets an error for that one and still fetches from the other producer."""
    doomed, survivor, consumer = Worker(), Worker(), Worker()
    try:
        nbytes = 256 << 20
        warm, warm_digest = doomed.call("tests.helpers.tasks:put_and_return", 1 << 20)
        assert consumer.call("tests.helpers.tasks:get_digest", warm, transport="host") == warm_digest
        dead_ref = doomed.call("tests.helpers.tasks:put_filled", nbytes, 7)
        live_ref, expected = survivor.call("tests.helpers.tasks:put_and_return", 64 << 20, seed=4)
        with SharedBuffer(nbytes) as out:
            consumer.send("tests.helpers.tasks:get_into_file", out.path, dead_ref, transport="host")
            wait_in_flight(out.tensor, 7, finished=consumer.ready)
            assert doomed.call("tests.helpers.tasks:transfers_serving") >= 1
            freeze_then_kill(doomed.pid, doomed.kill)
            assert consumer.result(timeout_s=60) in ("OwnerDiedError", "PeerLostError")
        for transport in ("shm", "host"):
            assert consumer.call("tests.helpers.tasks:get_digest", live_ref, transport=transport) == expected
    finally:
        for w in (doomed, survivor, consumer):
            w.close()


def test_consumer_killed_mid_transfer_releases_everything(agent):
    before = {"owned": agent.owned_objects(), "segments": segment_count(), "holders": agent.stats()["holders"]}
    consumer = Worker()
    ref = tw.put(torch.full((512 << 20,), 3, dtype=torch.uint8))
    agent.export_handles(ref._desc)  # an shm segment too (as a first pickle would make)
    consumer.send("tests.helpers.tasks:get_digest", ref, transport="host")
    assert wait_until(lambda: agent.stats()["transfers_serving"] == 1, 20)
    consumer.kill()
    del ref
    assert wait_until(lambda: agent.stats()["transfers_serving"] == 0)
    assert wait_until(lambda: agent.owned_objects() == before["owned"])
    assert wait_until(lambda: segment_count() == before["segments"])
    assert wait_until(lambda: agent.stats()["holders"] == before["holders"])
    consumer.close()


def test_dropped_connection_is_retried_for_idempotent_calls():
    owner = Worker(env={"TENSORWIRE_NODE_ID": "faults-node-b"})
    proxies = []
    try:
        ref, expected = owner.call("tests.helpers.tasks:put_and_return", 1 << 20)
        desc = ref._desc

        def through_proxy(drop: int) -> Ref:
            proxy = DroppingProxy(desc.owner.tcp_address, drop=drop)
            proxies.append(proxy)
            owner_via_proxy = replace(desc.owner, tcp_address=proxy.address)
            return Ref(RefState(replace(desc, owner=owner_via_proxy), ref._skeleton_bytes, {}, b""))

        assert digest(tw.get(through_proxy(drop=1), transport="host", timeout_s=20)) == expected
        assert proxies[-1].accepted == 2  # one dropped, one that worked
        with pytest.raises(tw.PeerLostError):  # two drops: retried once only, then a clear error
            tw.get(through_proxy(drop=2), transport="host", timeout_s=20)
        flaky = through_proxy(drop=1)
        tw.free(flaky)  # Free is idempotent: retried, then done
        with pytest.raises(tw.ObjectFreedError):
            tw.get(ref, transport="host")
    finally:
        for proxy in proxies:
            proxy.close()
        owner.close()


def test_stalled_peer_does_not_block_other_peers():
    stalled, healthy = Worker(), Worker()
    try:
        stuck_ref, _ = stalled.call("tests.helpers.tasks:put_and_return", 1 << 20)
        good_ref, expected = healthy.call("tests.helpers.tasks:put_and_return", 1 << 20, seed=9)
        os.kill(stalled.pid, 19)  # SIGSTOP
        outcome: list[object] = []

        def fetch_stuck() -> None:
            try:
                outcome.append(tw.get(stuck_ref, transport="host", timeout_s=3))
            except tw.TensorwireError as e:
                outcome.append(e)

        thread = threading.Thread(target=fetch_stuck)
        thread.start()
        assert digest(tw.get(good_ref, transport="host", timeout_s=10)) == expected
        thread.join(10)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], tw.TransferTimeoutError)
    finally:
        os.kill(stalled.pid, 18)  # SIGCONT
        stalled.close()
        healthy.close()
