"""A transport describes itself: the registry checks its contract, finds it through entry
points and ``TENSORWIRE_TRANSPORTS``, and the selector ranks it by its own cost model."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from dataclasses import replace

import pytest

from tensorwire.errors import TransportContractError
from tensorwire.transport import registry
from tensorwire.transport.contract import (
    Capabilities,
    CostEstimate,
    CostModel,
    MemoryKind,
    PeerInfo,
    Placement,
    Transport,
)
from tensorwire.transport.selector import UNKNOWN_COST, ObjectSummary, select
from tests.helpers import entry_point_transport

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _transport(caps: Capabilities, **methods) -> type[Transport]:
    members = {"name": "contract", "capabilities": caps, "fetch": lambda self, request, dst: None, **methods}
    return type("ContractTransport", (Transport,), members)


@pytest.mark.parametrize(
    ("caps", "method", "capability"),
    [
        (
            Capabilities(one_sided=True, same_process=False, same_node=True, cross_node=False, needs_export=True),
            "export",
            "needs_export=True",
        ),
        (
            Capabilities(one_sided=False, same_process=False, same_node=True, cross_node=True),
            "serve",
            "one_sided=False",
        ),
        (
            Capabilities(one_sided=True, same_process=True, same_node=False, cross_node=False, zero_copy_view=True),
            "view",
            "zero_copy_view=True",
        ),
        (
            Capabilities(one_sided=True, same_process=False, same_node=True, cross_node=True, peer_setup=True),
            "load_peer",
            "peer_setup=True",
        ),
        (
            Capabilities(one_sided=True, same_process=False, same_node=True, cross_node=True, carries_value=True),
            "export",
            "carries_value=True",
        ),
    ],
)
def test_a_missing_method_is_named_with_its_capability(caps, method, capability):
    cls = _transport(caps)
    with pytest.raises(TransportContractError, match=rf"method '{method}' \(required by {capability}\)"):
        registry.register_transport("contract", cls)
    assert "contract" not in registry.registered_transports()


def test_abstract_fetch_is_named_and_a_complete_class_registers():
    caps = Capabilities(one_sided=True, same_process=False, same_node=True, cross_node=True, peer_setup=True)
    incomplete = type("NoFetch", (Transport,), {"name": "contract", "capabilities": caps})
    with pytest.raises(TransportContractError, match=r"method 'fetch' \(required by every transport\)"):
        registry.register_transport("contract", incomplete)
    complete = _transport(caps, connection_info=lambda self: "x", load_peer=lambda self, peer, info: None)
    registry.register_transport("contract", complete)
    try:
        assert registry.get_transport_class("contract") is complete
    finally:
        registry.unregister_transport("contract")


def test_every_builtin_satisfies_its_contract_and_declares_costs():
    for name in registry.BUILTIN_TRANSPORTS:
        try:
            cls = registry.get_transport_class(name)
        except ImportError:
            continue  # an optional extra is missing here
        registry.check_contract(cls)
        assert isinstance(cls.cost_model, CostModel), name


def test_cost_model_by_placement_and_memory():
    slow, fast, gpu = CostEstimate(100, 1.0), CostEstimate(10, 10.0), CostEstimate(50, 100.0)
    model = CostModel(
        default=slow,
        entries=((Placement.SAME_NODE, MemoryKind.HOST, fast), (Placement.SAME_NODE, MemoryKind.CUDA, gpu)),
    )
    assert model.estimate(Placement.SAME_NODE, frozenset({MemoryKind.HOST})) == fast
    assert model.estimate(Placement.SAME_NODE, frozenset({MemoryKind.CUDA})) == gpu
    assert model.estimate(Placement.SAME_NODE, frozenset({MemoryKind.HOST, MemoryKind.CUDA})) == gpu  # the slowest
    assert model.estimate(Placement.CROSS_NODE, frozenset({MemoryKind.HOST})) == slow


A = PeerInfo(agent_id="a", node_id="n1", machine_id="m1", hostname="h", pid=1, start_time=1, transports=("p", "q"))
FAR = replace(A, agent_id="far", node_id="n2", machine_id="m2")
TWO_SIDED = Capabilities(one_sided=False, same_process=False, same_node=True, cross_node=True)


def test_selector_ranks_by_declared_models_and_calibration_wins():
    caps = {"p": TWO_SIDED, "q": TWO_SIDED}
    obj = ObjectSummary(nbytes=1 << 20, memory=frozenset({MemoryKind.HOST}), exported=frozenset())
    near_fast = CostModel(
        default=CostEstimate(1000, 0.1), entries=((Placement.CROSS_NODE, MemoryKind.HOST, CostEstimate(10, 10.0)),)
    )
    models = {"p": near_fast, "q": CostModel.uniform(100, 1.0)}
    usable = frozenset(caps)
    far = select(A, FAR, obj, caps, usable_here=usable, cost_models=models)
    assert [c.transport for c in far.choices] == ["p", "q"]
    assert far.choices[0].estimate_s == pytest.approx(CostEstimate(10, 10.0).seconds(1 << 20))
    near = select(A, replace(A, agent_id="b", pid=2), obj, caps, usable_here=usable, cost_models=models)
    assert [c.transport for c in near.choices] == ["q", "p"]  # p's same-node cost is its slow default
    calibrated = select(A, FAR, obj, caps, usable_here=usable, cost_models=models, costs={"q": CostEstimate(1, 1e3)})
    assert calibrated.best == "q"
    unknown = select(A, FAR, obj, caps, usable_here=usable, cost_models={"q": models["q"]})
    assert unknown.best == "q" and unknown.choices[1].estimate_s == pytest.approx(UNKNOWN_COST.seconds(1 << 20))


def test_peer_setup_transport_needs_the_producers_connection_info():
    caps = {"p": Capabilities(one_sided=True, same_process=False, same_node=True, cross_node=True, peer_setup=True)}
    obj = ObjectSummary(nbytes=10, memory=frozenset({MemoryKind.HOST}), exported=frozenset())
    without = select(A, FAR, obj, caps, usable_here=frozenset(caps))
    assert dict(without.rejected) == {"p": "producer published no connection info for it"}
    published = replace(A, transport_info=(("p", "info"),))
    assert select(published, FAR, obj, caps, usable_here=frozenset(caps)).best == "p"


def _python(code: str, env: dict[str, str]) -> tuple[str, str]:
    full = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join([*env.get("PYTHONPATH", "").split(os.pathsep), str(ROOT)]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=ROOT, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


def test_entry_points_and_the_environment_are_found_with_no_call(tmp_path):
    """One fresh process with two distributions on its path (testep, and one that tries to
    take the built-in name shm) and a ``TENSORWIRE_TRANSPORTS`` entry; this process has none."""
    sites = [
        entry_point_transport.install(tmp_path / "a"),
        entry_point_transport.install(tmp_path / "b", name="shm", dist="shadow"),
    ]
    code = (
        "from tensorwire.transport import registry as r; "
        f"print(r.get_transport_class({entry_point_transport.NAME!r}).__name__, "
        "r.get_transport_class('shm').__name__, 'from_env' in r.registered_transports())"
    )
    env = {"PYTHONPATH": os.pathsep.join(map(str, sites)), registry.ENV: "from_env=pkg.mod:Cls"}
    out, err = _python(code, env)
    assert out == "EntryPointTransport ShmTransport True"
    assert "ignoring entry point 'shm'" in err and "a built-in transport has that name" in err
    assert entry_point_transport.NAME not in registry.registered_transports()


def test_runtime_registrations_are_importable_paths_only():
    local = type("Local", (entry_point_transport.EntryPointTransport,), {"name": "local_only"})
    registry.register_transport("local_only", local)
    registry.register_transport("by_path", "tests.helpers.entry_point_transport:EntryPointTransport")
    try:
        found = registry.runtime_registrations()
        assert found["by_path"] == "tests.helpers.entry_point_transport:EntryPointTransport"
        assert "local_only" not in found
        assert registry.encode_env({"b": "m:B", "a": "m:A"}) == "a=m:A,b=m:B"
    finally:
        registry.unregister_transport("local_only")
        registry.unregister_transport("by_path")
    assert "by_path" not in registry.runtime_registrations()
