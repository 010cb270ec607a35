"""Cross-node paths on one machine: a Ray cluster of two nodes (``ray.cluster_utils.Cluster``).

Each Ray node has its own node id, so actors on different nodes see each other as remote and
use the cross-node transports (TCP control service; ``ucx`` by default, ``gloo`` and ``host``
when forced).
"""

from __future__ import annotations

import gc

import pytest
import ray
import torch

import tensorwire as tw
from tests.helpers.ray_sessions import ray_session
from tests.helpers.tasks import digest
from tests.integration.actors import Consumer, Producer, make_state


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    with ray_session():
        c = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "resources": {"node_a": 10},
                "include_dashboard": False,
                # A loaded machine once starved a new node's raylet past Ray's default 5 missed
                # health checks (3 s apart), and Ray declared the node dead before its first
                # actor ran. Tests that remove a node see it through tensorwire, not this check.
                "_system_config": {"health_check_failure_threshold": 20},
            },
        )
        try:
            second = c.add_node(num_cpus=1, resources={"node_b": 10})
            tw.init(address=c.address)
            c.wait_for_nodes()
            yield c, second
        finally:
            gc.collect()
            ray.shutdown()
            c.shutdown()


def on(node: str):
    return {"resources": {node: 1}}


def test_topo_gathers_every_node(cluster):
    from tensorwire.cli import _cluster_reports

    c, _ = cluster
    reports = _cluster_reports(c.address)
    node_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {r["node_id"] for r in reports} == node_ids
    assert all(r["transports"]["host"] == "usable" for r in reports)


def test_actors_on_two_nodes_use_a_cross_node_transport(cluster):
    producer = Producer.options(**on("node_b")).remote()
    consumer = Consumer.options(**on("node_a")).remote()
    node_b = ray.get(producer.node_id.remote())
    assert node_b != tw.stats()["node_id"]
    ref = producer.make.remote(64, 16 << 20, seed=5)
    got, transport = ray.get(consumer.digest_and_transport.remote(ref))
    assert got == digest(make_state(64, 16 << 20, seed=5))
    assert transport == "nixl"  # the cheapest cross-node estimate (nixl-cu12 is in the test extra)
    assert digest(tw.get(ref)) == got  # driver on the head node
    assert tw.stats()["recent"][-1].transport == "nixl"
    assert digest(tw.get(ref, transport="ucx")) == got
    assert digest(tw.get(ref, transport="gloo")) == got
    assert digest(tw.get(ref, transport="host")) == got


def test_small_value_goes_inline_across_nodes(cluster):
    producer = Producer.options(**on("node_b")).remote()
    consumer = Consumer.options(**on("node_a")).remote()
    ref = producer.tensor.remote(1000, fill=3)
    got, transport = ray.get(consumer.digest_and_transport.remote(ref))
    assert (got, transport) == (digest(torch.full((1000,), 3, dtype=torch.uint8)), "inline")


def test_driver_put_fetched_on_the_other_node(cluster):
    consumer = Consumer.options(**on("node_b")).remote()
    value = {"w": torch.randn(300_000), "step": 7}
    got, transport = ray.get(consumer.digest_and_transport.remote(tw.put(value)))
    assert (got, transport) == (digest(value), "nixl")


def test_node_removed_turns_into_owner_died(cluster):
    c, _ = cluster
    doomed = c.add_node(num_cpus=1, resources={"node_c": 10})
    c.wait_for_nodes()
    producer = Producer.options(**on("node_c")).remote()
    ref = producer.tensor.remote(1 << 20)
    transports = ("host", "ucx", "gloo", "nixl")
    for transport in transports:  # connections made on every cross-node transport
        assert tw.get(ref, transport=transport).numel() == 1 << 20
    c.remove_node(doomed)
    for transport in transports:
        with pytest.raises((tw.OwnerDiedError, tw.PeerLostError)):
            tw.get(ref, transport=transport, timeout_s=20)


def test_weight_sync_relays_through_one_leader_per_node(cluster):
    from tests.collectives.actors import Holder

    trainer = Holder.options(**on("node_a")).remote(200, 16 << 20, 3)
    receivers = [
        Holder.options(**on("node_b")).remote(200, 16 << 20, None),  # node b's leader: fetches across nodes
        Holder.options(**on("node_b")).remote(200, 16 << 20, None),  # reads from the leader, same node
        Holder.options(**on("node_a")).remote(200, 16 << 20, None),  # reads the trainer's segment
    ]
    pointers = ray.get([r.data_ptrs.remote() for r in receivers])
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=2 << 20, verify=True)
    report = sync.push()
    assert report.ok, report.failed
    expected = ray.get(trainer.digest.remote())
    assert ray.get([r.digest.remote() for r in receivers]) == [expected] * 3
    assert ray.get([r.data_ptrs.remote() for r in receivers]) == pointers
    used = [set(report.receivers[i].transports) for i in range(3)]
    assert used == [{"nixl"}, {"shm"}, {"shm"}]  # nixl: the trainer exports for the other node
    assert set(report.pairs) == {  # the leader served its node-mate
        ("trainer 0", "receiver 0", "nixl"),
        ("receiver 0", "receiver 1", "shm"),
        ("trainer 0", "receiver 2", "shm"),
    }
    sync.close()


def test_tensorwire_group_broadcast_across_nodes(cluster):
    from tests.collectives.actors import Member, member_input

    actors = [
        Member.options(**on("node_a")).remote(0),
        Member.options(**on("node_b")).remote(1),
        Member.options(**on("node_b")).remote(2),
    ]
    tw.collective.create_group(actors, backend="tensorwire", name="cross")
    try:
        results = ray.get([a.run.remote("cross", "broadcast", src=0) for a in actors], timeout=120)
        assert all(torch.equal(r, member_input(0)) for r in results)
        gathered = ray.get([a.run.remote("cross", "all_gather") for a in actors], timeout=120)
        assert all(torch.equal(g[i], member_input(i)) for g in gathered for i in range(3))
    finally:
        tw.collective.destroy_group("cross")
