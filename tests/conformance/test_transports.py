"""One suite run against every registered transport, the test-only plug-ins included.

Every case comes from the transport's capabilities, never from its name: its placements
(a consumer in this process for same-process transports, a spawned process on this node,
one that claims another node), the memory kinds it reads, one-/two-sided, zero-copy views,
the bytes that travel in the reference. Each transport is forced for the fetch; every case
compares a checksum of what arrived with the original.

Consumers are spawned processes. With ``TENSORWIRE_CONFORMANCE_RAY=1`` every case runs a
second time with the consumers inside Ray actors (``tw.remote``; the run-time registration of
``testfile`` reaches them through the runtime, with no call in the actor).
``tests/conformance/test_entry_point.py`` runs this suite on a transport installed only as
an entry point of a temporary distribution.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.transport import get_transport_class, registered_transports, unregister_transport
from tensorwire.transport.contract import Capabilities, MemoryKind
from tests.helpers import file_transport
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest

# ``testfile`` and the test-only ``null`` are registered at run time, for this module only (a
# registration made in the driver travels to every Ray actor and task it starts: it must not
# outlive the module).
NAMES = sorted({*registered_transports(), file_transport.NAME, "null"})

RAY_ENV = "TENSORWIRE_CONFORMANCE_RAY"
OTHER_NODE = {"TENSORWIRE_NODE_ID": "conformance-node-b"}
KINDS = ["process", "ray"] if os.environ.get(RAY_ENV) == "1" else ["process"]


@tw.remote
class ActorConsumer:
    """A consumer inside a Ray actor: runs ``module:function`` like a spawned Worker."""

    def call(self, target: str, payload: bytes) -> bytes:
        from tests.helpers.procs import _run

        return _run(target, payload)


@tw.remote
def registered_in_task() -> list[str]:
    """The transports a Ray task's process knows, with no call there."""
    return registered_transports()


class _InActor:
    def __init__(self, env: dict[str, str]) -> None:
        import ray

        self._ray = ray
        options = {"runtime_env": {"env_vars": env}} if env else {}
        self._actor = ActorConsumer.options(**options).remote()

    def call(self, target: str, *args, timeout_s: float = 120.0, **kwargs):
        payload = pickle.dumps((args, kwargs))
        return pickle.loads(self._ray.get(self._actor.call.remote(target, payload), timeout=timeout_s))

    def close(self) -> None:
        self._ray.kill(self._actor)


@pytest.fixture(scope="module", autouse=True)
def testfile_registered():
    added = {file_transport.NAME, "null"} - set(registered_transports())
    file_transport.register()
    yield
    for name in added:
        unregister_transport(name)


@pytest.fixture(scope="module", params=KINDS)
def consumers(request):
    """A same-node and a cross-node consumer: spawned processes (``testfile`` registered in
    them by a call), or Ray actors (no call: the runtime passes the registration)."""
    if request.param == "process":
        made = {"same": Worker(), "other": Worker(env=OTHER_NODE)}
        for w in made.values():
            assert {file_transport.NAME, "null"} <= set(w.call("tests.helpers.tasks:register_test_transport"))
        yield made
        for w in made.values():
            w.close()
        return
    import ray

    from tests.helpers.ray_sessions import ray_session

    with ray_session():
        tw.init(address="local", num_cpus=2, include_dashboard=False)
        made = {"same": _InActor({}), "other": _InActor(OTHER_NODE)}
        in_task = tw.get(registered_in_task.remote(), timeout_s=120)  # the run-time registration reached it
        assert file_transport.NAME in in_task, in_task
        try:
            yield made
        finally:
            for a in made.values():
                a.close()
            ray.shutdown()


def caps_of(name: str) -> Capabilities:
    return get_transport_class(name).capabilities


def other_processes(caps: Capabilities) -> bool:
    return caps.same_node or caps.cross_node


@pytest.fixture(params=NAMES)
def transport(request, consumers, agent):
    name = request.param
    caps = caps_of(name)
    if MemoryKind.HOST not in caps.memory:
        pytest.skip(f"{name} moves CUDA memory only; tests/gpu/test_gpu_transports.py (marked gpu) covers it")
    if caps.carries_value:  # the bytes travel in the reference: let every size of the suite do so
        agent.set_config(replace(agent.config, inline_max_nbytes=512 << 20))
    return name


def fetch_digest(transport: str, consumers, value) -> str:
    """Put ``value`` here and fetch it with ``transport`` forced, where the transport serves:
    in this process when it serves only this one, else on this node, else on another node."""
    ref = tw.put(value)
    caps = caps_of(transport)
    if not other_processes(caps):
        return digest(tw.get(ref, transport=transport))
    where = "same" if caps.same_node else "other"
    got_digest, used = consumers[where].call("tests.helpers.tasks:get_transport", ref, transport=transport)
    assert used == transport
    return got_digest


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.complex64,
]


def test_dtypes(transport, consumers):
    gen = torch.Generator().manual_seed(1)
    value = {}
    for dtype in DTYPES:
        base = torch.randn(3, 5, generator=gen) * 100
        value[str(dtype)] = base > 0 if dtype == torch.bool else base.to(dtype)
    assert fetch_digest(transport, consumers, value) == digest(value)


def test_zero_dim_empty_and_noncontiguous(transport, consumers):
    value = [
        torch.tensor(3.5),
        torch.empty(0, 4),
        torch.arange(20, dtype=torch.int64).reshape(4, 5).t(),  # not contiguous
        torch.arange(30.0).reshape(5, 6)[:, ::2],
        np.arange(12, dtype=np.int32).reshape(3, 4)[:, 1:],
        torch.arange(10.0)[::5][:1],  # one element of a strided view ("contiguous", stride 5)
        np.arange(10.0)[::5][:1],
        np.array(2.5),  # 0-d numpy
    ]
    assert fetch_digest(transport, consumers, value) == digest(value)


def test_nested_structure(transport, consumers):
    value = {
        "a": [torch.ones(3), (torch.zeros(2, 2), "text")],
        "b": {"c": np.arange(5, dtype=np.float32), "d": None, "e": 7},
        "f": (),
    }
    assert fetch_digest(transport, consumers, value) == digest(value)


@pytest.mark.parametrize(
    "nbytes", [1, 4096, 1 << 20, 64 << 20, 256 << 20], ids=["1B", "4KiB", "1MiB", "64MiB", "256MiB"]
)
def test_sizes(transport, consumers, nbytes):
    value = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert fetch_digest(transport, consumers, value) == digest(value)


def test_out_buffers(transport, consumers):
    value = torch.randn(257, 33, generator=torch.Generator().manual_seed(2))
    ref = tw.put(value)
    caps = caps_of(transport)
    if not other_processes(caps):
        out = torch.zeros_like(value)
        got = tw.get(ref, out=out, transport=transport)
        assert got is out
        assert torch.equal(out, value)
        return
    where = "same" if caps.same_node else "other"
    got_digest, same_buffer = consumers[where].call("tests.helpers.tasks:get_into_out", ref, transport=transport)
    assert got_digest == digest(value)
    assert same_buffer


def test_out_buffers_again(transport, consumers):
    """The same buffers again: the fetch is repeated (nothing worked out again) and gives what an
    ordinary fetch gives at that moment; after ``free`` it fails as an ordinary fetch does."""
    value = torch.arange(16384.0)  # 64 KiB: larger than a value that travels inline
    ref = tw.put([value])
    caps = caps_of(transport)
    if not other_processes(caps):
        out = [torch.zeros(16384)]
        tw.get(ref, out=out, transport=transport)
        tw.get(ref, out=out, transport=transport)  # the second fetch into these buffers: kept to repeat
        value.add_(1)
        ordinary = tw.get(ref, transport=transport)[0].clone()
        assert tw.get(ref, out=out, transport=transport)[0] is out[0]
        assert torch.equal(out[0], ordinary) and tw.stats()["recent"][-1].repeated
        return
    consumer = consumers["same" if caps.same_node else "other"]
    consumer.call("tests.helpers.tasks:get_into_kept_out", "again", ref, transport=transport)
    consumer.call("tests.helpers.tasks:get_into_kept_out", "again", transport=transport)  # into the buffers
    value.add_(1)
    ordinary, used = consumer.call("tests.helpers.tasks:get_transport", ref, transport=transport)
    assert used == transport
    got = consumer.call("tests.helpers.tasks:get_into_kept_out", "again", transport=transport)
    assert got == (ordinary, transport, True)
    if not caps.carries_value:  # (the bytes in the reference outlive the object)
        tw.free(ref)
        got = consumer.call("tests.helpers.tasks:get_into_kept_out", "again", transport=transport)
        assert got == ("ObjectFreedError", "", False)
    consumer.call("tests.helpers.tasks:drop", "again")


def test_placements(transport, consumers):
    """A consumer on this node and one on another node each get the bytes exactly where the
    transport declares it serves, else ``NoTransportError``."""
    value = {"w": torch.randn(1000, 100), "b": torch.arange(7)}
    ref = tw.put(value)
    caps = caps_of(transport)
    for where, serves in (("same", caps.same_node), ("other", caps.cross_node)):
        if not serves:
            error = consumers[where].call("tests.helpers.tasks:get_error", ref, transport=transport)
            assert error == "NoTransportError", where
            continue
        got_digest, used = consumers[where].call("tests.helpers.tasks:get_transport", ref, transport=transport)
        assert (got_digest, used) == (digest(value), transport), where


def test_same_process(transport):
    value = torch.arange(100.0)
    ref = tw.put(value)
    if not caps_of(transport).same_process:
        with pytest.raises(tw.NoTransportError, match="producer and consumer are one process"):
            tw.get(ref, transport=transport)
        return
    assert torch.equal(tw.get(ref, transport=transport), value)


def test_zero_copy_view(transport, consumers):
    """Views show the producer's bytes (a copy where the transport has no zero-copy view);
    writes to a host view stay private to the consumer."""
    caps = caps_of(transport)
    value = torch.arange(1000, dtype=torch.int64) + 5
    ref = tw.put(value)
    if not other_processes(caps):
        view = tw.get(ref, transport=transport, view=True)
        assert torch.equal(view, value)
        assert (view.data_ptr() == value.data_ptr()) == caps.zero_copy_view
        return
    where = "same" if caps.same_node else "other"
    seen = consumers[where].call("tests.helpers.tasks:view_and_write_with", ref, transport=transport)
    # without zero_copy_view, view=True is an ordinary private copy
    expected = {"zero_copy": caps.zero_copy_view, "first": 5, "after_write": -1, "again": 5, "transport": transport}
    assert seen == expected


def test_sidedness(transport, consumers):
    """One-sided transports that export carry their handle in the reference; two-sided ones
    are offered by the producer (its ``PeerInfo.transports``); either way the bytes arrive."""
    caps = caps_of(transport)
    if not other_processes(caps):
        pytest.skip(f"{transport} serves only its own process")
    value = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))  # past the default inline limit
    ref = tw.put(value)
    where = "same" if caps.same_node else "other"
    facts = consumers[where].call("tests.helpers.tasks:reference_facts", ref, transport=transport)
    assert facts["digest"] == digest(value) and facts["transport"] == transport
    if caps.one_sided and caps.needs_export and not caps.export_per_consumer:
        assert transport in facts["handles"]
    if not caps.one_sided:
        assert transport in facts["offered"]
    if caps.carries_value:  # nothing to hold at the owner: the reference is enough
        assert transport in facts["handles"]
