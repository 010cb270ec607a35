"""The test-only ``null`` transport: plain copies inside one process, every capability such a
transport can have, and a clear refusal of everything else."""

from __future__ import annotations

import pytest
import torch

import tensorwire as tw
from tensorwire.transport import get_transport_class
from tensorwire.transport.backends.null import NullTransport
from tensorwire.transport.contract import MemoryKind
from tensorwire.transport.registry import check_contract


def test_it_declares_what_a_transport_inside_one_process_can_and_keeps_the_contract():
    caps = NullTransport.capabilities
    assert caps.one_sided and caps.same_process and caps.needs_export and caps.zero_copy_view
    assert caps.can_abort and caps.peer_setup and caps.memory == frozenset({MemoryKind.HOST, MemoryKind.CUDA})
    assert not caps.same_node and not caps.cross_node  # its table is this process's memory
    check_contract(NullTransport)


def test_a_forced_fetch_is_a_copy_through_its_export(over_null):
    value = torch.arange(1000, dtype=torch.float64)
    ref = tw.put(value)
    out = torch.zeros_like(value)
    assert tw.get(ref, out=out) is out and torch.equal(out, value)  # copied into the buffer
    assert tw.stats()["recent"][-1].transport == "null"
    assert get_transport_class("null") is NullTransport
    view = tw.get(ref)  # in the producer's own process a view is the default
    assert view.data_ptr() == value.data_ptr() and tw.stats()["recent"][-1].zero_copy


def test_freed_objects_and_other_processes_are_refused(over_null, worker):
    ref = tw.put(torch.ones(8))
    tw.free(ref)
    with pytest.raises(tw.ObjectFreedError):
        tw.get(ref)
    ref = tw.put(torch.ones(8))
    # another process: null is not registered there, and could not serve it anyway
    assert worker.call("tests.helpers.tasks:get_error", ref, transport="null") == "ValueError"
    info = over_null.transports()["null"]
    with pytest.raises(tw.TransportUnavailableError, match="inside one process"):
        info.load_peer(ref.state.desc.owner, "1")
