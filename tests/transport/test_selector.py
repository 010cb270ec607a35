"""The selector is a pure function: fake peers and capabilities drive every decision."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from tensorwire.transport import selector
from tensorwire.transport.backends.gloo import GlooTransport
from tensorwire.transport.backends.host import HostTransport
from tensorwire.transport.backends.inline import InlineTransport
from tensorwire.transport.backends.local import LocalTransport
from tensorwire.transport.backends.shm.transport import ShmTransport
from tensorwire.transport.backends.ucx import UcxTransport
from tensorwire.transport.contract import Capabilities, MemoryKind, PeerInfo
from tensorwire.transport.selector import ObjectSummary

CLASSES = (LocalTransport, InlineTransport, ShmTransport, HostTransport, UcxTransport, GlooTransport)
CAPS = {t.name: t.capabilities for t in CLASSES[:4]}
MODELS = {t.name: t.cost_model for t in CLASSES}  # each transport's own declared cost model
select = functools.partial(selector.select, cost_models=MODELS)
ALL = frozenset(CAPS)
HOST = frozenset({MemoryKind.HOST})

A = PeerInfo(agent_id="a", node_id="n1", machine_id="m1", hostname="h", pid=1, start_time=1, transports=tuple(CAPS))
B = replace(A, agent_id="b", pid=2)
C = replace(A, agent_id="c", node_id="n2", machine_id="m2", pid=3)


def summary(nbytes: int, exported=("shm",), memory=HOST) -> ObjectSummary:
    return ObjectSummary(nbytes=nbytes, memory=memory, exported=frozenset(exported))


def test_same_process_picks_local():
    sel = select(A, A, summary(1 << 20), CAPS, usable_here=ALL)
    assert sel.best == "local"
    assert "same process" in sel.reason


def test_same_node_large_picks_shm_then_host():
    sel = select(A, B, summary(64 << 20), CAPS, usable_here=ALL)
    assert [c.transport for c in sel.choices] == ["shm", "host"]
    assert sel.reason.startswith("same node") and "shm" in sel.reason and "next: host" in sel.reason


def test_small_inline_object_picks_inline_everywhere():
    for dst in (B, C):
        sel = select(A, dst, summary(100, exported=("inline",)), CAPS, usable_here=ALL)
        assert sel.best == "inline"


def test_cross_node_rejects_same_node_transports_with_reasons():
    sel = select(A, C, summary(64 << 20), CAPS, usable_here=ALL)
    assert sel.best == "host"
    rejected = dict(sel.rejected)
    assert "different node" in rejected["shm"]
    assert "n1 -> n2" in sel.reason


def test_missing_handle_is_rejected_unless_forced():
    sel = select(A, B, summary(64 << 20, exported=()), CAPS, usable_here=ALL)
    assert sel.best == "host"
    assert "no handle" in dict(sel.rejected)["shm"]
    forced = select(A, B, summary(64 << 20, exported=()), CAPS, usable_here=ALL, forced="shm")
    assert forced.best == "shm" and "forced" in forced.reason


def test_forced_transport_that_cannot_serve_has_no_choice():
    sel = select(A, C, summary(1 << 20), CAPS, usable_here=ALL, forced="shm")
    assert sel.choices == ()
    assert "different node" in sel.reason


def test_unusable_on_consumer_is_skipped():
    sel = select(A, B, summary(1 << 20), CAPS, usable_here=ALL - {"shm"})
    assert sel.best == "host"
    assert dict(sel.rejected)["shm"] == "not usable in this process"


def test_device_memory_needs_a_transport_that_reads_it_or_stages():
    cuda = frozenset({MemoryKind.CUDA})
    sel = select(A, B, summary(1 << 20, memory=cuda), CAPS, usable_here=ALL)
    assert sel.best == "host"  # staged through host memory
    assert "cannot read cuda memory" in dict(sel.rejected)["shm"]


def test_two_sided_needs_producer_offer():
    producer = replace(A, transports=("local", "inline", "shm"))
    sel = select(producer, C, summary(1 << 20), CAPS, usable_here=ALL)
    assert sel.choices == ()
    assert "does not offer" in dict(sel.rejected)["host"]


def test_plugin_without_cost_entry_ranks_last_but_serves_alone():
    caps = {**CAPS, "plug": Capabilities(one_sided=False, same_process=False, same_node=True, cross_node=True)}
    producer = replace(A, transports=(*A.transports, "plug"))
    sel = select(producer, C, summary(1 << 20), caps, usable_here=ALL | {"plug"})
    assert [c.transport for c in sel.choices] == ["host", "plug"]
    only = select(producer, C, summary(1 << 20), caps, usable_here=frozenset({"plug"}))
    assert only.best == "plug"


def test_unregistered_forced_name_is_rejected():
    sel = select(A, B, summary(10), CAPS, usable_here=ALL, forced="nope")
    assert dict(sel.rejected) == {"nope": "not registered"}


@pytest.mark.parametrize("nbytes", [0, 1, 1 << 30])
def test_estimates_grow_with_size(nbytes):
    small = select(A, B, summary(nbytes), CAPS, usable_here=ALL).choices
    large = select(A, B, summary(nbytes + (1 << 20)), CAPS, usable_here=ALL).choices
    assert all(s.estimate_s < g.estimate_s for s, g in zip(small, large, strict=True))


WITH_TWO_SIDED = {**CAPS, "ucx": UcxTransport.capabilities, "gloo": GlooTransport.capabilities}
EVERYWHERE = replace(A, transports=tuple(WITH_TWO_SIDED))


@pytest.mark.parametrize("nbytes", [1 << 20, 64 << 20, 1 << 30])
def test_cross_node_picks_ucx_when_installed(nbytes):
    far = replace(EVERYWHERE, agent_id="far", node_id="n2", machine_id="m2")
    sel = select(EVERYWHERE, far, summary(nbytes), WITH_TWO_SIDED, usable_here=frozenset(WITH_TWO_SIDED))
    assert sel.best == "ucx"
    assert sel.reason.startswith("cross node (n1 -> n2)") and "ucx (fastest estimate" in sel.reason
    assert "different node" in dict(sel.rejected)["shm"]


@pytest.mark.parametrize(("nbytes", "expected"), [(16 << 10, "host"), (64 << 20, "gloo")])
def test_cross_node_without_ucx_picks_gloo_or_host_by_size(nbytes, expected):
    far = replace(EVERYWHERE, agent_id="far", node_id="n2", machine_id="m2")
    usable = frozenset(WITH_TWO_SIDED) - {"ucx"}
    sel = select(EVERYWHERE, far, summary(nbytes), WITH_TWO_SIDED, usable_here=usable)
    assert sel.best == expected
    assert {c.transport for c in sel.choices} == {"gloo", "host"}
    assert dict(sel.rejected)["ucx"] == "not usable in this process"


def test_ucx_is_skipped_when_the_producer_lacks_it():
    far = replace(EVERYWHERE, agent_id="far", node_id="n2", machine_id="m2")
    producer = replace(EVERYWHERE, transports=("local", "inline", "shm", "host", "gloo"))
    sel = select(producer, far, summary(64 << 20), WITH_TWO_SIDED, usable_here=frozenset(WITH_TWO_SIDED))
    assert sel.best == "gloo"
    assert dict(sel.rejected)["ucx"] == "producer does not offer it"


def test_same_node_prefers_shm_over_two_sided():
    sel = select(
        EVERYWHERE,
        replace(EVERYWHERE, agent_id="b", pid=2),
        summary(256 << 20),
        WITH_TWO_SIDED,
        usable_here=frozenset(WITH_TWO_SIDED),
    )
    assert [c.transport for c in sel.choices][:2] == ["shm", "ucx"]
