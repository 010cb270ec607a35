"""The push model on links small enough to work out by hand: one NIC, a chain of buckets with
a latency each, a NIC two GPUs share, NVLink inside a node and a relay across nodes."""

from __future__ import annotations

import pytest

from tensorwire.collectives.weight_sync.model.cluster import Cluster, Placement
from tensorwire.collectives.weight_sync.model.flows import flows_of
from tensorwire.collectives.weight_sync.model.simulate import simulate
from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import plan_sync

MIB = 1 << 20


def _layout(tensors: int, rows: int = 1024, prefix: str = "w") -> list[ParamPiece]:
    """``tensors`` fp32 tensors of ``rows`` x 256 (1 MiB each at 1024 rows)."""
    return [ParamPiece(f"{prefix}{i}", (rows, 256), "float32", Box.full((rows, 256)), None) for i in range(tensors)]


def _model(trainers: list, receivers: list, cluster: Cluster, bucket_mib: int = 4):
    plan = plan_sync(trainers, receivers)
    placement = Placement(cluster, len(trainers), len(receivers))
    return simulate(flows_of(plan, placement, bucket_mib * MIB), placement)


def test_one_bucket_over_one_nic_takes_its_bytes_at_the_nic_bandwidth():
    cluster = Cluster(gpus_per_node=1, nics_per_node=1, nic_gbps=2.0, latency_us=0)
    modelled = _model([_layout(4)], [_layout(4)], cluster)
    assert modelled.bound_s == pytest.approx(4 * MIB / 2e9)
    assert modelled.seconds == pytest.approx(modelled.bound_s, rel=0.01)
    assert str(modelled.busiest[0][0]) in ("node 0 nic 0 out", "node 1 nic 0 in")


def test_a_chain_of_buckets_pays_the_latency_for_each():
    cluster = Cluster(gpus_per_node=1, nics_per_node=1, nic_gbps=2.0, latency_us=1000)
    modelled = _model([_layout(8)], [_layout(8)], cluster, bucket_mib=2)  # 4 buckets of 2 MiB
    assert modelled.seconds == pytest.approx(4 * (1e-3 + 2 * MIB / 2e9), rel=0.01)
    assert modelled.over_bound > 1.4  # the latencies are not in the bound


def test_two_gpus_sharing_a_nic_take_twice_as_long_as_with_one_each():
    shared = Cluster(gpus_per_node=2, nics_per_node=1, nic_gbps=2.0, latency_us=0)
    own = Cluster(gpus_per_node=2, nics_per_node=2, nic_gbps=2.0, latency_us=0)
    halves = [_layout(4), _layout(4, prefix="b")]  # two trainers each holding what one receiver needs
    receivers = [halves[0], halves[1]]
    one_each = _model(halves, receivers, own)
    sharing = _model(halves, receivers, shared)
    assert one_each.seconds == pytest.approx(4 * MIB / 2e9, rel=0.02)
    assert sharing.seconds == pytest.approx(2 * one_each.seconds, rel=0.02)


def test_inside_a_node_the_push_goes_over_nvlink():
    cluster = Cluster(gpus_per_node=2, nvlink_gbps=20.0, nic_gbps=1.0, latency_us=0, colocated=True)
    modelled = _model([_layout(4)], [_layout(4)], cluster)
    assert {link.kind for link, _n, _s in modelled.busiest if _n} == {"nvlink"}
    assert modelled.seconds == pytest.approx(4 * MIB / 20e9, rel=0.02)


def test_a_node_of_readers_takes_the_bytes_over_the_nic_once_and_relays_them():
    cluster = Cluster(gpus_per_node=4, nics_per_node=4, nvlink_gbps=100.0, nic_gbps=2.0, latency_us=0)
    modelled = _model([_layout(8)], [_layout(8)] * 4, cluster)  # trainer on node 0, 4 readers on node 1
    by_link = {str(link): n for link, n, _s in modelled.busiest}
    assert by_link["node 0 nic 0 out"] == 8 * MIB  # once, not four times
    assert by_link["node 1 nvlink 0 out"] == 3 * 8 * MIB  # the leader relays to its three node-mates
    assert modelled.seconds == pytest.approx(8 * MIB / 2e9, rel=0.05)  # the relays overlap the NIC


def test_a_cluster_with_an_unknown_field_or_no_nic_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"unknown cluster field\(s\) \['nic_gpbs'\]"):
        Cluster.from_dict({"nic_gpbs": 50})
    with pytest.raises(ValueError, match="at least one GPU and one NIC"):
        Cluster(nics_per_node=0)
