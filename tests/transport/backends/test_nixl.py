"""The nixl transport between processes: another (claimed) node over UCX's TCP path, the
registration and metadata caches, faults (producer killed or stopped, consumer killed), 1,000
new objects, and weight sync to a receiver on another node. The conformance suite
(tests/conformance/test_transports.py) runs nixl on this node like every transport."""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest

from tests.helpers.observe import wait_until
from tests.helpers.procs import Worker

INSTALLED = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13"))
pytestmark = pytest.mark.skipif(
    not INSTALLED, reason="NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)"
)

MIB = 1 << 20
TCP = {"UCX_TLS": "tcp,self", "OMP_NUM_THREADS": "1"}
NODE_A = {**TCP, "TENSORWIRE_NODE_ID": "nixl-node-a"}
NODE_B = {**TCP, "TENSORWIRE_NODE_ID": "nixl-node-b"}
T = "tests.helpers.nixl_tasks"


@pytest.fixture(scope="module")
def pair():
    """A producer and a consumer that claim different nodes and use UCX over TCP only."""
    producer, consumer = Worker(env=NODE_A), Worker(env=NODE_B)
    yield producer, consumer
    producer.close()
    consumer.close()


def _wait_for_reads(path: str, worker: Worker, timeout_s: float = 120.0) -> None:
    """Until ``worker``'s read loop wrote that at least one read completed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                if int(f.read() or 0) >= 1:
                    return
        assert not worker.ready(), f"the read loop ended early: {worker.result(1)}"
        time.sleep(0.05)
    raise AssertionError(f"no read completed within {timeout_s} s")


def _count(stats: dict, key: str) -> int:
    return int(stats.get(key, 0))


@pytest.mark.parametrize("nbytes", [1, 4096, MIB, 64 * MIB], ids=["1B", "4KiB", "1MiB", "64MiB"])
def test_other_node_over_tcp_forced_and_automatic(pair, nbytes):
    producer, consumer = pair
    ref = producer.call(f"{T}:put_kept", f"v{nbytes}", nbytes, nbytes)
    expected = producer.call(f"{T}:kept_digest", f"v{nbytes}")
    assert consumer.call("tests.helpers.tasks:get_transport", ref, transport="nixl") == (expected, "nixl")
    if nbytes > 4096:  # larger than inline values: across nodes the selector ranks nixl first
        assert consumer.call("tests.helpers.tasks:get_transport", ref) == (expected, "nixl")


def test_other_node_dtypes_and_out_buffer(pair):
    import torch

    from tests.helpers.tasks import digest

    value = {str(d): (torch.arange(40) % 7).to(d).reshape(5, 8) for d in (torch.float32, torch.bfloat16, torch.int64)}
    value["t"] = torch.arange(30.0).reshape(5, 6).t()  # not contiguous at the producer
    producer, consumer = pair
    ref = producer.call(f"{T}:put_value", value)
    assert consumer.call("tests.helpers.tasks:get_transport", ref, transport="nixl") == (digest(value), "nixl")
    ref = producer.call(
        "tests.helpers.tasks:put_value", torch.randn(257, 33, generator=torch.Generator().manual_seed(2))
    )
    got_digest, same_buffer = consumer.call("tests.helpers.tasks:get_into_out", ref, transport="nixl")
    assert same_buffer and got_digest == digest(torch.randn(257, 33, generator=torch.Generator().manual_seed(2)))


def test_other_node_nested_odd_and_large_values(pair):
    """The conformance suite's harder values over UCX's TCP path to a claimed other node:
    nesting with non-tensor leaves, zero-dim, empty, non-contiguous and bool tensors, a view
    request (nixl copies), and 256 MiB."""
    import torch

    from tests.helpers.tasks import digest

    gen = torch.Generator().manual_seed(4)
    value = {
        "layers": [torch.tensor(3.5), torch.empty(0, 3), torch.randn(64, 48, generator=gen).t()[::2]],
        "mask": (torch.rand(1000, generator=gen) > 0.5, torch.arange(-100, 100, dtype=torch.int8)),
        "step": 7,
        "name": "policy",
        "big": torch.randn(300_000, generator=gen),
    }
    producer, consumer = pair
    ref = producer.call(f"{T}:put_value", value)
    assert consumer.call("tests.helpers.tasks:get_transport", ref, transport="nixl") == (digest(value), "nixl")
    assert consumer.call("tests.helpers.tasks:get_digest", ref, transport="nixl", view=True) == digest(value)
    ref = producer.call(f"{T}:put_kept", "large", 256 * MIB, 11)
    expected = producer.call(f"{T}:kept_digest", "large")
    assert consumer.call("tests.helpers.tasks:get_transport", ref, transport="nixl") == (expected, "nixl")
    producer.call(f"{T}:free_kept")


def test_metadata_once_per_peer_and_registrations_reused(pair):
    """Six objects on one tensor's memory (a parameter returned six times), read into one
    out= buffer: the producer registers once, the consumer loads partial metadata once and
    registers its buffer once."""
    producer, consumer = pair
    p0, c0 = producer.call(f"{T}:started_stats"), consumer.call(f"{T}:started_stats")  # alone or after others
    refs = [producer.call(f"{T}:put_kept", "param", MIB, 9)] + [
        producer.call(f"{T}:put_again", "param") for _ in range(5)
    ]
    digests = consumer.call(f"{T}:read_into_out", refs)
    assert digests == [producer.call(f"{T}:kept_digest", "param")] * 6
    p1, c1 = producer.call(f"{T}:stats"), consumer.call(f"{T}:stats")
    assert _count(p1, "registered") - _count(p0, "registered") == 1
    assert _count(p1, "hits") - _count(p0, "hits") >= 5
    assert _count(c1, "partial_loads") - _count(c0, "partial_loads") == 1
    assert _count(c1, "metadata_loads") == 1  # the consumer has met one producer, once
    assert _count(c1, "registered") - _count(c0, "registered") == 1 + (not c0) * 2  # + its own tables, first time


def test_agent_metadata_travels_in_the_connection_info_not_in_handles():
    """A fresh producer's references were put before its NIXL agent existed: an inline one, forced
    onto nixl, gets the agent's metadata in the Export reply; the others leave naming it in the
    producer's published connection info (not in the handle); the consumer loads it once."""
    import base64

    producer, consumer = Worker(env=NODE_A), Worker(env=NODE_B)
    try:
        tiny = producer.call(f"{T}:put_kept", "tiny", 16, 5)  # inline: it left with no nixl handle, no agent yet
        got = consumer.call("tests.helpers.tasks:get_transport", tiny, transport="nixl")  # Export: handle + info
        assert got == (producer.call(f"{T}:kept_digest", "tiny"), "nixl")
        refs = [producer.call(f"{T}:put_kept", f"early{i}", MIB, i) for i in range(3)]
        metadata = producer.call(f"{T}:connection_metadata")
        info = dict(refs[0]._desc.owner.transport_info)["nixl"]
        assert info.split(" ")[1] == base64.b64encode(metadata).decode()
        assert metadata not in refs[0]._state.handles["nixl"]
        digests = [consumer.call("tests.helpers.tasks:get_transport", r, transport="nixl") for r in refs]
        assert digests == [(producer.call(f"{T}:kept_digest", f"early{i}"), "nixl") for i in range(3)]
        assert _count(consumer.call(f"{T}:stats"), "metadata_loads") == 1
    finally:
        producer.close()
        consumer.close()


def test_connection_info_without_agent_metadata_is_refused_so_the_fetch_falls_back():
    from tensorwire.errors import TransportUnavailableError
    from tensorwire.transport.backends.nixl.transport import NixlTransport
    from tensorwire.transport.contract import PeerInfo

    peer = PeerInfo("a1", "n", "m", "h", 1, 1)
    with pytest.raises(TransportUnavailableError, match="published no NIXL metadata"):
        NixlTransport(None).load_peer(peer, "tw-h-1-abcd")
    with pytest.raises(TransportUnavailableError, match="not a NIXL agent name"):
        NixlTransport(None).load_peer(peer, "ucx-worker")


def test_plain_gets_land_in_pooled_memory_registered_once(pair):
    """Without out=, values land in the consumer's host pool: one registration serves every
    later value of that size (fresh memory each time would be registered each time)."""
    producer, consumer = pair
    refs = [producer.call(f"{T}:put_kept", f"plain{i}", 3 * MIB, 20 + i) for i in range(4)]
    result = consumer.call(f"{T}:read_plain", refs)
    assert result["digests"] == [producer.call(f"{T}:kept_digest", f"plain{i}") for i in range(4)]
    assert result["pool_reused"] >= 3
    assert result["registered"] <= 1  # the first value's buffer, unless an earlier test's is still registered
    refs = [producer.call(f"{T}:put_kept", f"ucx{i}", 3 * MIB, 30 + i) for i in range(2)]
    result = consumer.call(f"{T}:read_plain", refs, "ucx")  # forced onto a transport that registers nothing
    assert result["digests"] == [producer.call(f"{T}:kept_digest", f"ucx{i}") for i in range(2)]
    assert result["pool_reused"] == 0


def test_producer_killed_mid_read_is_owner_died_and_consumer_stays_usable(pair, tmp_path):
    _, consumer = pair
    victim = Worker(env=NODE_A)
    try:
        ref = victim.call(f"{T}:put_kept", "big", 256 * MIB, 1)
        progress = str(tmp_path / "reads")
        consumer.send(f"{T}:read_loop", ref, progress, 120.0, 60.0)
        _wait_for_reads(progress, consumer)
        os.kill(victim.pid, signal.SIGKILL)
        result = consumer.result(timeout_s=120)
    finally:
        victim.kill()
    assert result["error"] in ("OwnerDiedError", "PeerLostError"), result
    producer = pair[0]  # the consumer's agent still reads from a live producer
    ref = producer.call(f"{T}:put_kept", "after-kill", MIB, 5)
    assert consumer.call("tests.helpers.tasks:get_transport", ref, transport="nixl") == (
        producer.call(f"{T}:kept_digest", "after-kill"),
        "nixl",
    )


def test_stopped_producer_hits_the_deadline_then_works_again(pair):
    _, consumer = pair
    stopped = Worker(env=NODE_A)
    try:
        ref = stopped.call(f"{T}:put_kept", "s", 64 * MIB, 3)
        expected = stopped.call(f"{T}:kept_digest", "s")
        assert consumer.call(f"{T}:timed_outcome", ref, 60.0)["outcome"] == expected  # connection made
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            late = consumer.call(f"{T}:timed_outcome", ref, 2.0, timeout_s=120)
            unfinished = consumer.call(f"{T}:late_read", ref, 2.0, timeout_s=120)
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        assert late["outcome"] == "TransferTimeoutError", late
        assert "deadline" in late["message"] or "timed out" in late["message"] or "timeout" in late["message"], late
        # READs given up on still land when the producer resumes (freeing their buffers at the
        # deadline crashed the consumer then: SIGSEGV): they are kept until NIXL says they ended
        assert unfinished["outcome"] == "TransferTimeoutError" and unfinished["stats"]["stuck_reads"] == 2, unfinished
        again = consumer.call(f"{T}:timed_outcome", ref, 60.0, timeout_s=120)
        assert again["outcome"] == expected, again
        settled: list[dict] = []  # released once ended, by a later registration's sweep (at most every 0.1 s)

        def released() -> bool:
            settled.append(consumer.call(f"{T}:late_read", ref, 60.0, timeout_s=120))
            return settled[-1]["stats"]["stuck_reads"] == 0

        assert wait_until(released, timeout_s=60), settled[-1]
        assert all(s["outcome"] == expected for s in settled), settled
    finally:
        stopped.close()


def test_consumer_killed_mid_read_leaves_the_producer_usable(pair, tmp_path):
    producer, consumer = pair
    ref = producer.call(f"{T}:put_kept", "big2", 256 * MIB, 4)
    doomed = Worker(env=NODE_B)
    try:
        progress = str(tmp_path / "reads")
        doomed.send(f"{T}:read_loop", ref, progress, 120.0, 60.0)
        _wait_for_reads(progress, doomed)
        os.kill(doomed.pid, signal.SIGKILL)
    finally:
        doomed.kill()
    fresh = producer.call(f"{T}:put_kept", "after-consumer-kill", 64 * MIB, 6)
    assert consumer.call("tests.helpers.tasks:get_transport", fresh, transport="nixl") == (
        producer.call(f"{T}:kept_digest", "after-consumer-kill"),
        "nixl",
    )


def test_freed_memory_is_deregistered_without_a_further_transfer(pair):
    """A freed tensor's registration goes by itself (the sweeper), not at the producer's next
    export: a trainer that stops exporting does not keep its old memory registered."""
    producer, consumer = pair
    ref, key = producer.call(f"{T}:put_alone", "alone", 2 * MIB)
    assert consumer.call("tests.helpers.tasks:get_transport", ref, transport="nixl")[1] == "nixl"
    assert producer.call(f"{T}:region_registered", key)
    before = _count(producer.call(f"{T}:stats"), "deregistered")
    producer.call(f"{T}:drop_alone", "alone")
    assert wait_until(lambda: not producer.call(f"{T}:region_registered", key), timeout_s=60)
    assert _count(producer.call(f"{T}:stats"), "deregistered") > before


def test_thousand_new_objects_keep_caches_bounded_and_memory_flat():
    env = {"TENSORWIRE_NIXL_CACHE": "32", "OMP_NUM_THREADS": "1"}
    producer, consumer = Worker(env=env), Worker(env={**env, "TENSORWIRE_NODE_ID": "nixl-new-b"})
    try:
        rss = {}
        for i in range(1000):
            ref = producer.call(f"{T}:new_object", i, 256 << 10)
            assert consumer.call(f"{T}:check_round", ref, i), i
            if i in (99, 999):
                rss[i] = (producer.call(f"{T}:rss_bytes"), consumer.call(f"{T}:rss_bytes"))
        assert len(set(consumer.call(f"{T}:read_into_out", [ref] * 300))) == 1  # one buffer, 300 reads
        producer.call(f"{T}:free_kept")
        # freed objects keep their memory for the grace (20 ms) before it and its registration go
        assert wait_until(lambda: producer.call(f"{T}:stats")["lingering"] == 0, timeout_s=30)
        ps, cs = producer.call(f"{T}:stats"), consumer.call(f"{T}:stats")
    finally:
        producer.close()
        consumer.close()
    assert ps["cached"] <= 34 and cs["cached"] <= 34, (ps, cs)  # 32 + the two tables
    assert ps["registered"] >= 1000 and ps["deregistered"] >= 1000 - 34, ps
    assert ps["live_slots"] == 0 and cs["metadata_loads"] == 1, (ps, cs)
    assert ps["idle"] <= ps["cached"] and cs["idle"] <= cs["cached"], (ps, cs)  # each registration once
    for before, after in zip(rss[99], rss[999], strict=True):
        assert after - before < 48 * MIB, rss


def _push_specs(workers: list[Worker], tensors: int, sync_id: str, transport: str, versions: tuple[int, ...]):
    """A push of ``tensors`` float32 parameters (64 Ki elements each) from ``workers[0]`` to
    ``workers[1]``: per rank its spec for each version; the plan; its bucket count."""
    from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece
    from tensorwire.collectives.weight_sync.planning.plan import plan_sync
    from tensorwire.collectives.weight_sync.protocol.assign import assign_roles
    from tensorwire.collectives.weight_sync.protocol.spec import PushSpec

    layout = tuple(ParamPiece(f"w{i}", (1 << 16,), "float32", Box.full((1 << 16,))) for i in range(tensors))
    plan = plan_sync([layout], [layout])
    descriptions = tuple(w.call("tests.collectives.standalone:describe") for w in workers)
    roles, buckets = assign_roles(
        plan,
        [0],
        trainer_layouts=[layout],
        receiver_layouts=[layout],
        descriptions=list(descriptions),
        bucket_bytes=1 << 20,
    )
    specs = [
        [
            PushSpec(
                sync_id=sync_id,
                name="weights",
                version=v,
                channel=f"tw-sync-{sync_id}-{v}",
                members=descriptions,
                rank=rank,
                where="weights",
                layout=layout,
                roles=roles[rank],
                verify=True,
                transport=transport,
                timeout_s=60.0,
            )
            for v in versions
        ]
        for rank in (0, 1)
    ]
    return specs, plan, buckets


def _node_workers(prefix: str) -> list[Worker]:
    base = {"TENSORWIRE_HOST": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    return [Worker(env={**base, "TENSORWIRE_NODE_ID": f"{prefix}-{n}"}) for n in ("a", "b")]


def test_weight_sync_to_a_receiver_on_another_node_over_nixl():
    workers, tensors = _node_workers("ws-node"), 40
    try:
        specs, plan, buckets = _push_specs(workers, tensors, "nixl-ws", "", (1,))
        workers[0].send("tests.collectives.standalone:sync_send", specs[0][0], tensors, "cpu")
        workers[1].send("tests.collectives.standalone:sync_receive", specs[1][0], tensors, "cpu")
        sent, received = [w.result(timeout_s=180) for w in workers]
        workers[0].call("tests.collectives.standalone:release", "nixl-ws")
    finally:
        for w in workers:
            w.close()
    assert sent["failed"] == {} and sent["sent_nbytes"] == plan.nbytes
    assert received["digest"] == sent["digest"] and received["in_place"] and received["version"] == 1
    assert received["transports"] == {"nixl": buckets}, received["transports"]


def test_weight_sync_registers_the_trainers_memory_once_across_pushes():
    """Two pushes of the same parameters (changed in place between, as a training step does)
    to a receiver on another node: the second registers nothing new on either side."""
    workers, tensors = _node_workers("ws2-node"), 24
    try:
        specs, _, _ = _push_specs(workers, tensors, "nixl-ws2", "nixl", (1, 2))
        workers[0].send(f"{T}:sync_twice", "send", specs[0], tensors)
        workers[1].send(f"{T}:sync_twice", "receive", specs[1], tensors)
        sent, received = [w.result(timeout_s=240) for w in workers]
    finally:
        for w in workers:
            w.close()
    assert [r["failed"] for r in sent] == [{}, {}]
    assert [r["digest"] for r in received] == [r["digest"] for r in sent] and sent[0]["digest"] != sent[1]["digest"]
    assert sent[0]["registered"] >= 1 and received[0]["registered"] >= 1  # the first push registers
    assert (sent[1]["registered"], received[1]["registered"]) == (0, 0), (sent, received)
    assert [set(r["transports"]) for r in received] == [{"nixl"}, {"nixl"}]


def test_tensorwire_collective_backend_reads_over_nixl_across_nodes():
    base = {"TENSORWIRE_HOST": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    workers = [Worker(env={**base, "TENSORWIRE_NODE_ID": f"bc-node-{i}"}) for i in range(2)]
    try:
        descriptions = [w.call("tests.collectives.standalone:describe") for w in workers]
        for rank, worker in enumerate(workers):
            worker.send(f"{T}:broadcast_and_transports", "nixl-bc", rank, descriptions, 0)
        (sent, _), (got, used) = [w.result(timeout_s=120) for w in workers]
        expected = workers[0].call("tests.collectives.standalone:expected_broadcast", 0)
    finally:
        for w in workers:
            w.close()
    assert sent == got == expected
    assert used and set(used) == {"nixl"}, used


@pytest.mark.parametrize("other_node", [False, True], ids=["same-node", "other-node"])
def test_processes_that_used_nixl_exit_by_themselves_promptly(other_node):
    producer = Worker(env=NODE_A if other_node else {}, start_method="spawn")  # a real interpreter exit
    consumer = Worker(env=NODE_B if other_node else {}, start_method="spawn")
    try:
        ref = producer.call(f"{T}:put_kept", "exit", MIB, 8)
        expected = producer.call(f"{T}:kept_digest", "exit")
        assert consumer.call("tests.helpers.tasks:get_transport", ref, transport="nixl") == (expected, "nixl")
        del ref
        for name, worker in (("consumer", consumer), ("producer", producer)):
            _, code = worker.exit(20.0)
            assert code == 0, f"the {name} did not exit by itself within 20 s (NIXL agent threads?)"
    finally:
        producer.close()
        consumer.close()


def test_concurrent_fetches_from_several_threads(pair):
    producer, consumer = pair
    refs = [producer.call(f"{T}:put_kept", f"c{i}", MIB + i, 100 + i) for i in range(8)]
    expected = [producer.call(f"{T}:kept_digest", f"c{i}") for i in range(8)]
    assert consumer.call("tests.helpers.tasks:get_concurrently", refs, "nixl", timeout_s=120) == expected


def test_the_registration_cache_trims_only_past_its_capacity_and_only_unused_entries():
    from collections import OrderedDict
    from types import SimpleNamespace

    from tensorwire.transport.backends.nixl.agent import NixlAgent, Registration

    dropped: list[int] = []
    cache = SimpleNamespace(capacity=4, regs=OrderedDict())
    cache._drop = lambda reg: (dropped.append(reg.rid), cache.regs.pop(reg.key))

    def add(rid: int, users: int) -> None:
        cache.regs[(rid, 1, False, 0)] = Registration(rid, (rid, 1, False, 0), None, None, users)

    for rid in range(3):
        add(rid, 0)
    NixlAgent._trim(cache)
    assert dropped == []  # under the capacity: nothing goes
    add(3, 1)
    add(4, 0)
    add(5, 0)
    NixlAgent._trim(cache)
    assert dropped == [0, 1] and len(cache.regs) == 4  # the oldest unused ones, down to the capacity
    for rid in (6, 7):
        add(rid, 1)
    NixlAgent._trim(cache)
    assert dropped == [0, 1, 2, 4] and list(r.rid for r in cache.regs.values()) == [3, 5, 6, 7]
