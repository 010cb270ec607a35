"""The agent's parts and the public accessors other modules use instead of private attributes."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

import tensorwire as tw
from tensorwire.errors import (
    ObjectFreedError,
    PermissionDeniedError,
    TensorwireError,
    TransferAbortedError,
    TransferTimeoutError,
    TransportError,
)
from tensorwire.transport.agent import core as agent_module
from tensorwire.transport.agent.control import status_of
from tensorwire.transport.agent.rendezvous import MAX_GROUPS, Mailbox
from tensorwire.transport.agent.service import statuses
from tensorwire.transport.agent.services import AgentServices
from tensorwire.transport.contract import Transport, TransportContext


def test_transports_are_the_usable_instances_by_name(agent):
    transports = agent.transports()
    assert list(transports) == agent.stats()["transports_usable"]
    assert {"local", "inline", "shm", "host"} <= set(transports)
    for name, instance in transports.items():
        assert isinstance(instance, Transport) and instance.name == name and instance.context is agent
    transports.pop("host")  # a copy: the agent keeps its own
    assert "host" in agent.transports()
    assert not set(agent.transports()) & set(agent.unusable_transports())


def test_current_agent_never_starts_one():
    agent_module.shutdown_agent()
    assert agent_module.current_agent() is None
    started = agent_module.get_agent()
    assert agent_module.current_agent() is started
    agent_module.shutdown_agent()
    assert agent_module.current_agent() is None


def test_the_agent_offers_transports_and_callers_each_their_own_interface(agent):
    assert isinstance(agent, TransportContext) and isinstance(agent, AgentServices)
    assert not TransportContext.__abstractmethods__ - set(dir(agent))
    assert not AgentServices.__abstractmethods__ - set(dir(agent))
    callers_only = {"rendezvous_push_async", "rendezvous_take", "fetch", "free", "export_handles", "register"}
    transports_only = {"open_stream", "connect", "request_export", "publish_transport_info", "check_owner"}
    assert callers_only <= AgentServices.__abstractmethods__
    assert not callers_only & TransportContext.__abstractmethods__
    assert transports_only <= TransportContext.__abstractmethods__
    assert not transports_only & AgentServices.__abstractmethods__


def test_rendezvous_with_itself_through_the_context(agent):
    wait = agent.rendezvous_push_async(agent.peer, "test-parts", "a", b"1", timeout_s=5)
    wait()
    agent.rendezvous_push(agent.peer, "test-parts", "b", b"2", timeout_s=5)
    assert agent.rendezvous_get("test-parts", "a", timeout_s=5) == b"1"
    assert agent.rendezvous_take("test-parts", "b", timeout_s=5) == b"2"
    with pytest.raises(TransferTimeoutError, match="key 'b' not set before the deadline"):
        agent.rendezvous_take("test-parts", "b", timeout_s=0.0)  # taken once
    agent.rendezvous_forget("test-parts")
    with pytest.raises(TransferTimeoutError, match="rendezvous test-parts: key 'a'"):
        agent.rendezvous_get("test-parts", "a", timeout_s=0.0)


def test_mailbox_wakes_a_waiting_reader_and_drops_the_oldest_groups():
    box = Mailbox()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(box.wait("g", "k", timeout_s=60)))
    reader.start()
    box.put("g", "k", b"value")
    reader.join(60)
    assert got == [b"value"]
    for i in range(MAX_GROUPS + 1):
        box.put(f"group-{i}", "k", b"x")
    with pytest.raises(TransferTimeoutError):
        box.wait("g", "k", timeout_s=0.0)  # the oldest group went first
    assert box.wait(f"group-{MAX_GROUPS}", "k", timeout_s=0.0) == b"x"


@pytest.mark.parametrize(
    ("error", "code", "details"),
    [
        (ObjectFreedError("gone"), grpc.StatusCode.NOT_FOUND, "gone"),
        (PermissionDeniedError("token"), grpc.StatusCode.PERMISSION_DENIED, "token"),
        (TransportError("broke"), grpc.StatusCode.ABORTED, "x: broke"),
    ],
)
def test_one_mapping_of_errors_to_statuses(error, code, details):
    with pytest.raises(TensorwireError) as raised, statuses(TransferAbortedError, prefix="x: "):
        raise error
    assert (status_of(raised.value)[0], str(raised.value)) == (code, details)


def test_ref_accessors(agent):
    value = torch.arange(6, dtype=torch.int32)
    ref = tw.put({"w": value})
    state = ref.state
    assert state.desc.owner.agent_id == agent.peer.agent_id
    assert ref.skeleton() is ref.skeleton()  # unpickled once
    assert ref.transport == ""
    assert torch.equal(tw.get(ref)["w"], value)
    assert ref.transport == "local"
    ref.mark_moved("shm")
    assert ref.transport == "shm"
    outgoing = ref.outgoing_state()
    assert outgoing.desc == state.desc and outgoing.handles  # exported when a copy leaves
    agent.consume_pin(outgoing.desc, outgoing.pin_id)


def test_exports_for_readers_on_this_node_leave_out_transports_that_reach_other_nodes(agent):
    """A weight-sync bucket read only on this node is not exported over a transport that also
    reaches other nodes (starting a NIXL agent took half a second) when one limited to this
    node can take it; a later export for anyone adds those."""
    usable = {name: t.capabilities for name, t in agent.transports().items()}
    exporters = {n for n, c in usable.items() if c.needs_export and not c.export_per_consumer and not c.carries_value}
    local = {n for n in exporters if not usable[n].cross_node}
    remote = exporters - local
    if not local or not remote:
        pytest.skip(f"needs an exporting transport of each kind here (this machine's: {sorted(exporters)})")
    value = torch.arange(1 << 16, dtype=torch.float32)  # too large to travel inline
    ref = tw.put(value)
    desc = ref.state.desc
    only_here = set(agent.export_handles(desc, across_nodes=False))
    assert only_here & local and not only_here & remote
    anywhere = set(agent.export_handles(desc))
    assert only_here < anywhere and anywhere & remote
    del ref


def test_a_value_that_travels_in_the_reference_gets_no_other_export_later(agent):
    carriers = [n for n, t in agent.transports().items() if t.capabilities.carries_value]
    if not carriers:
        pytest.skip("no transport here carries values in the reference")
    ref = tw.put(torch.arange(4, dtype=torch.float32))  # small: it travels inline
    first = agent.export_handles(ref.state.desc, across_nodes=False)
    assert set(first) == set(carriers)
    assert agent.export_handles(ref.state.desc) == first  # for anyone: still nothing else
    del ref


def test_take_any_takes_the_earliest_named_key_that_is_there_and_waits_for_one():
    box = Mailbox()
    box.put("g", "b", b"2")
    box.put("g", "c", b"3")
    assert box.take_any("g", ["a", "c", "b"], timeout_s=0.0) == (1, b"3")  # c before b: the order asked
    assert box.take_any("g", ["a", "c", "b"], timeout_s=0.0) == (2, b"2")  # taken once
    with pytest.raises(TransferTimeoutError, match="rendezvous g: none of 3 key"):
        box.take_any("g", ["a", "c", "b"], timeout_s=0.0)
    putting = threading.Thread(target=box.put, args=("g", "a", b"1"))
    putting.start()
    assert box.take_any("g", ["a", "c"], timeout_s=60) == (0, b"1")  # woken by the put
    putting.join()
