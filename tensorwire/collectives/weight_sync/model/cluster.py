"""Where a push runs: nodes of GPUs with NVLink and NICs, and which GPU each rank has.

A :class:`Cluster` is uniform: every node has ``gpus_per_node`` GPUs, each with ``nvlink_gbps``
out and in (NVLink, or what a GPU moves to another on its node), and ``nics_per_node`` NICs of
``nic_gbps`` each way, GPU ``g`` using NIC ``g * nics_per_node // gpus_per_node`` (GPUs share a
NIC when there are fewer NICs than GPUs). ``node_memory_gbps``, when set, bounds everything a
node moves at once (a host-memory push on CPUs: the cores copying share it). Every transfer
(a bucket to one reader) pays ``latency_us`` before its bytes move.

Ranks are placed in order, trainers from node 0, receivers on the nodes after them (or, with
``colocated``, from node 0 as well: the same GPUs serve and receive).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Cluster", "Link", "Placement"]

GBPS = 1e9  # bytes per second in one GB/s


@dataclass(frozen=True)
class Cluster:
    """A uniform cluster's links (see the module doc)."""

    gpus_per_node: int = 8
    nvlink_gbps: float = 450.0
    nics_per_node: int = 8
    nic_gbps: float = 50.0
    latency_us: float = 10.0
    node_memory_gbps: float = 0.0  # 0: no shared bound per node
    colocated: bool = False

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nics_per_node < 1:
            raise ValueError("a node needs at least one GPU and one NIC")
        if min(self.nvlink_gbps, self.nic_gbps) <= 0 or self.latency_us < 0 or self.node_memory_gbps < 0:
            raise ValueError("bandwidths must be positive and the latency not negative")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Cluster:
        """A cluster from a mapping of its fields (a JSON/YAML ``cluster:`` section).

        Raises:
            ValueError: A key that is not a field (named, with the fields there are).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cluster field(s) {unknown}; the fields are {sorted(known)}")
        return cls(**dict(values))

    def nic_of(self, gpu: int) -> int:
        return gpu * self.nics_per_node // self.gpus_per_node


@dataclass(frozen=True)
class Link:
    """One direction of one link: ``kind`` "nvlink", "nic" or "memory", on ``node``, number
    ``index`` there (a GPU or a NIC), ``way`` "out" or "in" ("both" for memory)."""

    kind: str
    node: int
    index: int
    way: str
    gbps: float

    def __str__(self) -> str:
        where = f"node {self.node}" if self.kind == "memory" else f"node {self.node} {self.kind} {self.index}"
        return where if self.kind == "memory" else f"{where} {self.way}"


class Placement:
    """Each rank's (node, GPU), and the links of the cluster, numbered."""

    def __init__(self, cluster: Cluster, trainers: int, receivers: int) -> None:
        self.cluster = cluster
        per = cluster.gpus_per_node
        first_receiver_node = 0 if cluster.colocated else -(-trainers // per)
        self.trainers = [(r // per, r % per) for r in range(trainers)]
        self.receivers = [(first_receiver_node + r // per, r % per) for r in range(receivers)]
        self.nodes = max((n for n, _g in (*self.trainers, *self.receivers)), default=-1) + 1
        self.links: list[Link] = []
        self._index: dict[tuple[str, int, int, str], int] = {}
        for node in range(self.nodes):
            for gpu in range(per):
                for way in ("out", "in"):
                    self._add(Link("nvlink", node, gpu, way, cluster.nvlink_gbps))
            for nic in range(cluster.nics_per_node):
                for way in ("out", "in"):
                    self._add(Link("nic", node, nic, way, cluster.nic_gbps))
            if cluster.node_memory_gbps:
                self._add(Link("memory", node, 0, "both", cluster.node_memory_gbps))

    def _add(self, link: Link) -> None:
        self._index[(link.kind, link.node, link.index, link.way)] = len(self.links)
        self.links.append(link)

    def path(self, src: tuple[int, int], dst: tuple[int, int]) -> tuple[int, ...]:
        """The links a transfer from GPU ``src`` to GPU ``dst`` ((node, gpu)) crosses: NVLink out
        and in on one node, else the source's NIC out and the destination's NIC in; and the
        nodes' shared memory where it bounds them."""
        (sn, sg), (dn, dg) = src, dst
        if sn == dn:
            links = [self._index[("nvlink", sn, sg, "out")], self._index[("nvlink", dn, dg, "in")]]
        else:
            nic = self.cluster.nic_of
            links = [self._index[("nic", sn, nic(sg), "out")], self._index[("nic", dn, nic(dg), "in")]]
        if self.cluster.node_memory_gbps:
            links += sorted({self._index[("memory", n, 0, "both")] for n in (sn, dn)})
        return tuple(links)
