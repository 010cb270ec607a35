"""Failure paths with real processes: owner killed, stalled, unreachable, forged tokens."""

from __future__ import annotations

import os
import pickle
import signal
import time
from dataclasses import replace

import pytest
import torch

import tensorwire as tw
from tensorwire.runtime.refs.ref import Ref, RefState
from tests.helpers.inflight import Background, SharedBuffer, freeze_then_kill, wait_in_flight
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest


@pytest.fixture
def owner():
    w = Worker()
    yield w
    w.close()


@pytest.mark.parametrize("transport", ["shm", "host", ""])
def test_owner_killed_before_transfer(owner, transport):
    ref, _ = owner.call("tests.helpers.tasks:put_and_return", 1 << 20)
    owner.kill()
    start = time.monotonic()
    with pytest.raises(tw.OwnerDiedError, match="has exited"):
        tw.get(ref, transport=transport, timeout_s=20)
    assert time.monotonic() - start < 20  # before the deadline: noticed, not timed out


def test_owner_on_another_node_killed_before_transfer():
    other = Worker(env={"TENSORWIRE_NODE_ID": "failures-node-b"})
    try:
        ref, _ = other.call("tests.helpers.tasks:put_and_return", 1 << 20)
        other.kill()
        with pytest.raises(tw.OwnerDiedError):
            tw.get(ref, timeout_s=20)
    finally:
        other.close()


def test_owner_killed_during_transfer(owner):
    """Frozen, then killed, while its bytes provably arrive: an error, never a hang."""
    warm, expected = owner.call("tests.helpers.tasks:put_and_return", 1 << 20)
    assert digest(tw.get(warm, transport="host")) == expected
    nbytes = 768 << 20
    ref = owner.call("tests.helpers.tasks:put_filled", nbytes, 7)
    out = torch.zeros(nbytes, dtype=torch.uint8)
    fetch = Background(lambda: tw.get(ref, out=out, transport="host", timeout_s=60))
    wait_in_flight(out, 7, finished=lambda: fetch.done)
    assert owner.call("tests.helpers.tasks:transfers_serving") >= 1
    freeze_then_kill(owner.pid, owner.kill)
    outcome = fetch.outcome(30)
    assert isinstance(outcome, (tw.OwnerDiedError, tw.PeerLostError)), outcome


def test_ref_freed_mid_transfer_is_complete_or_freed_never_partial(agent, worker):
    """Freed while its bytes provably stream out: the consumer gets all of them or
    ``ObjectFreedError``, never a part."""
    nbytes = 512 << 20
    value = torch.full((nbytes,), 5, dtype=torch.uint8)
    expected = digest(value)
    ref = tw.put(value)
    del value
    warm = torch.arange(1000, dtype=torch.int64)
    assert worker.call("tests.helpers.tasks:get_digest", tw.put(warm), transport="host") == digest(warm)
    with SharedBuffer(nbytes) as out:
        worker.send("tests.helpers.tasks:get_into_file", out.path, ref, transport="host")
        wait_in_flight(out.tensor, 5, finished=worker.ready)
        assert agent.stats()["transfers_serving"] >= 1
        tw.free(ref)
        assert worker.result(timeout_s=60) in (expected, "ObjectFreedError")
    with pytest.raises(tw.ObjectFreedError):
        tw.get(ref)


@pytest.mark.parametrize("transport", ["host", "shm", "ucx", "gloo", "nixl", ""])
def test_forged_token_is_denied(owner, transport):
    """A reference whose token was changed, keeping every export handle it carries (the shm
    server's address, nixl's metadata and addresses), reads nothing on any transport."""
    if transport == "nixl" and "nixl" not in owner.call("tests.helpers.tasks:usable_transports"):
        pytest.skip("the nixl package is not installed (pip install 'tensorwire[nixl]')")
    ref, expected = owner.call("tests.helpers.tasks:put_and_return", 1 << 20)
    pickle.dumps(ref)  # exported: the reference now carries the one-sided handles
    state = ref.state
    assert "shm" in state.handles and (transport != "nixl" or "nixl" in state.handles)
    forged = Ref(state._replace(desc=replace(ref._desc, token=os.urandom(16)), pin_id=b""))
    with pytest.raises(tw.PermissionDeniedError):
        tw.get(forged, transport=transport)
    assert digest(tw.get(ref, transport=transport)) == expected  # the real reference still works


def test_forged_token_is_denied_in_the_owner_process(agent):
    value = torch.arange(100_000)
    ref = tw.put(value)
    forged = Ref(ref.state._replace(desc=replace(ref._desc, token=os.urandom(16)), pin_id=b""))
    with pytest.raises(tw.PermissionDeniedError):
        tw.get(forged, out=torch.empty_like(value))
    assert torch.equal(tw.get(ref, out=torch.empty_like(value)), value)


def test_stalled_owner_hits_the_deadline(owner):
    ref, _ = owner.call("tests.helpers.tasks:put_and_return", 1 << 20)
    os.kill(owner.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(tw.TransferTimeoutError):
            tw.get(ref, transport="host", timeout_s=1.0)
        assert time.monotonic() - start < 10  # the 1 s deadline holds: no hang
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    assert tw.get(ref, transport="host").numel() == 1 << 20  # usable again


def test_unreachable_owner_is_peer_lost():
    value = tw.put(torch.ones(100_000))
    far_owner = replace(
        value._desc.owner, agent_id="far", machine_id="elsewhere", node_id="far-node", tcp_address="127.0.0.1:1"
    )
    ref = Ref(RefState(replace(value._desc, owner=far_owner), value._skeleton_bytes, {}, b""))
    start = time.monotonic()
    with pytest.raises(tw.PeerLostError):
        tw.get(ref, timeout_s=5)
    assert time.monotonic() - start < 5  # refused connections are reported, not waited out


def test_failed_fetch_leaves_both_sides_usable(owner):
    ref, expected = owner.call("tests.helpers.tasks:put_and_return", 1 << 20)
    with pytest.raises(tw.NoTransportError):
        tw.get(ref, transport="local")
    assert digest(tw.get(ref)) == expected
