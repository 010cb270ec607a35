"""Transport selection: one pure function from two peers and an object to ranked choices.

The function looks only at its arguments (capabilities, peers, what the producer exported,
the consumer's usable transports); it never probes or imports anything. Candidates that can
serve are ranked by an estimated time ``fixed cost + bytes / bandwidth``: a calibrated entry
of this machine (``tensorwire bench --calibrate``) where there is one, else the transport's own
declared :class:`~tensorwire.transport.contract.CostModel` for the placement and memory kinds, else
:data:`UNKNOWN_COST`; the result carries the reason for the choice and for every rejection.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tensorwire.transport.contract import Capabilities, CostEstimate, CostModel, MemoryKind, PeerInfo, Placement

__all__ = ["LINK_BANDWIDTH_GBPS", "UNKNOWN_COST", "Choice", "CostEstimate", "ObjectSummary", "Selection", "select"]

CUDA = MemoryKind.CUDA


# A transport that declares no cost model is used when it is the only way, and ranked last otherwise.
UNKNOWN_COST = CostEstimate(fixed_us=5000, bandwidth_gbps=0.5)


@dataclass(frozen=True)
class ObjectSummary:
    """What the selector needs to know about the object being fetched."""

    nbytes: int
    memory: frozenset[MemoryKind]
    exported: frozenset[str]  # transports whose handle travels with the reference
    src_devices: frozenset[str] = frozenset()  # UUIDs of the GPUs the object lives on
    dst_devices: frozenset[str] = frozenset()  # UUIDs of the GPUs the consumer receives onto
    foreign_memory: bool = False  # some CUDA tensor came from a DLPack producer (cupy, ...)


@dataclass(frozen=True)
class Choice:
    transport: str
    estimate_s: float


@dataclass(frozen=True)
class Selection:
    """Ranked transports that can serve (best first), the reason, and why others cannot."""

    choices: tuple[Choice, ...]
    reason: str
    rejected: tuple[tuple[str, str], ...]

    @property
    def best(self) -> str | None:
        return self.choices[0].transport if self.choices else None


def _why_not(  # noqa: PLR0917 - private helper over the selector's inputs
    name: str,
    caps: Capabilities,
    src: PeerInfo,
    dst: PeerInfo,
    obj: ObjectSummary,
    usable_here: frozenset[str],
    forced: bool,
) -> str | None:
    """Why transport ``name`` cannot serve this fetch, or None if it can.

    A forced one-sided transport whose handle is missing stays a candidate: the consumer
    then asks the owner to export on request.
    """
    if name not in usable_here:
        return "not usable in this process"
    same_process = src.same_process(dst)
    same_node = src.same_node(dst)
    if same_process and not caps.same_process:
        return "producer and consumer are one process"
    if not same_process and caps.same_process and not (caps.same_node or caps.cross_node):
        return "producer is another process"
    if not same_process and same_node and not caps.same_node:
        return "same-node transfers not supported"
    if not same_node and not caps.cross_node:
        return f"different node ({src.node_id} -> {dst.node_id})"
    if (
        not same_process
        and caps.needs_export
        and name not in obj.exported
        and not forced
        and not caps.export_per_consumer
    ):
        return "the reference carries no handle for it (the object went inline, or export failed)"
    if not same_process and not caps.one_sided and not caps.needs_export and name not in src.transports:
        return "producer does not offer it"
    if not same_process and caps.peer_setup and name not in dict(src.transport_info):
        return "producer published no connection info for it"
    missing = obj.memory - caps.memory
    if missing and not caps.staged:
        kinds = ", ".join(sorted(m.value for m in missing))
        return f"cannot read {kinds} memory"
    if caps.torch_memory_only and obj.foreign_memory:
        return "the CUDA memory was allocated by cupy or another DLPack producer, not by torch"
    if caps.needs_device_access:
        visible = {d.uuid for d in dst.devices if d.kind == "cuda" and d.uuid}
        unseen = sorted(obj.src_devices - visible)
        if unseen or not obj.src_devices:
            return f"the consumer cannot see the producer's GPU {_short(unseen[0]) if unseen else '(unknown)'}"
        for a, b in _gpu_pairs(obj):
            if dst.gpu_link(a, b) == "none":
                return f"no P2P between {_short(a)} and {_short(b)}"
    if caps.distinct_devices:
        if not obj.dst_devices:
            return "the consumer receives into host memory"
        shared = sorted(obj.src_devices & obj.dst_devices)
        if shared:
            return f"producer and consumer on one GPU ({_short(shared[0])}); NCCL refuses two ranks on one GPU"
    return None


# Peer-to-peer bandwidth caps by link kind (GB/s), applied to GPU transports moving data
# between two GPUs of one node; defaults until calibrated on such a machine.
LINK_BANDWIDTH_GBPS = {"nvlink": 300.0, "pcie": 20.0, "none": 10.0}
_LINK_NAMES = {"same": "same GPU", "nvlink": "NVLink P2P", "pcie": "PCIe P2P", "none": "no P2P"}


def _gpu_pairs(obj: ObjectSummary) -> list[tuple[str, str]]:
    return [(a, b) for a in sorted(obj.src_devices) for b in sorted(obj.dst_devices)]


def _link(src: PeerInfo, dst: PeerInfo, obj: ObjectSummary) -> str:
    """The slowest known link between the object's GPUs and the consumer's ("" if unknown)."""
    if not src.same_node(dst):
        return ""
    kinds = [dst.gpu_link(a, b) for a, b in _gpu_pairs(obj)]
    for kind in ("none", "pcie", "nvlink", "same"):
        if kind in kinds:
            return kind
    return ""


def _short(uuid: str) -> str:
    """A GPU UUID shortened for reasons: ``GPU-3f2a9c1e``."""
    return uuid[:12]


def _devices(obj: ObjectSummary, link: str) -> str:
    if not obj.src_devices:
        return ""
    src = "+".join(_short(u) for u in sorted(obj.src_devices))
    dst = "+".join(_short(u) for u in sorted(obj.dst_devices)) or "host"
    return f", {src} -> {dst}" + (f" {_LINK_NAMES[link]}" if link else "")


def _placement(src: PeerInfo, dst: PeerInfo) -> Placement:
    if src.same_process(dst):
        return Placement.SAME_PROCESS
    return Placement.SAME_NODE if src.same_node(dst) else Placement.CROSS_NODE


def _declared(model: CostModel | None, placement: Placement, memory: frozenset[MemoryKind]) -> CostEstimate:
    return UNKNOWN_COST if model is None else model.estimate(placement, memory)


def _where(src: PeerInfo, dst: PeerInfo) -> str:
    if src.same_process(dst):
        return "same process"
    if src.same_node(dst):
        return "same node"
    return f"cross node ({src.node_id} -> {dst.node_id})"


def select(
    src: PeerInfo,
    dst: PeerInfo,
    obj: ObjectSummary,
    capabilities: Mapping[str, Capabilities],
    *,
    usable_here: frozenset[str],
    forced: str = "",
    costs: Mapping[str, CostEstimate] | None = None,
    cost_models: Mapping[str, CostModel | None] | None = None,
) -> Selection:
    """Rank the transports that can move ``obj`` from ``src`` (owner) to ``dst`` (consumer).

    Args:
        src: The producer's peer info.
        dst: The consumer's peer info.
        obj: Size, memory kinds and exported handles of the object.
        capabilities: Every registered transport's capabilities, by name.
        usable_here: Transports that work in the consumer's process.
        forced: A transport name the user forced ("" for automatic). Only it is considered.
        costs: This machine's calibrated costs by transport; an entry replaces the
            transport's cost model.
        cost_models: Every registered transport's declared cost model, by name (missing or
            None: :data:`UNKNOWN_COST`).

    Returns:
        A :class:`Selection`; ``choices`` is empty when nothing can serve.
    """
    calibrated = costs or {}
    models = cost_models or {}
    placement = _placement(src, dst)
    link = _link(src, dst, obj)
    names = [forced] if forced else list(capabilities)
    choices: list[Choice] = []
    rejected: list[tuple[str, str]] = []
    for name in names:
        caps = capabilities.get(name)
        reason = "not registered" if caps is None else _why_not(name, caps, src, dst, obj, usable_here, bool(forced))
        if reason is None:
            cost = calibrated.get(name) or _declared(models.get(name), placement, obj.memory)
            if link in LINK_BANDWIDTH_GBPS and caps is not None and CUDA in caps.memory:
                cost = CostEstimate(cost.fixed_us, min(cost.bandwidth_gbps, LINK_BANDWIDTH_GBPS[link]))
            choices.append(Choice(name, cost.seconds(obj.nbytes)))
        else:
            rejected.append((name, reason))
    choices.sort(key=lambda c: c.estimate_s)
    memory = "+".join(sorted(m.value for m in obj.memory)) or "no"
    where = f"{_where(src, dst)}{_devices(obj, link)}, {memory} memory, {obj.nbytes} B"
    if not choices:
        reason = f"{where}: no transport can serve" + "".join(f"; {n}: {r}" for n, r in rejected)
    else:
        best = choices[0]
        how = "forced" if forced else "fastest estimate"
        others = ", ".join(f"{c.transport} {c.estimate_s * 1e3:.3g} ms" for c in choices[1:])
        reason = f"{where}: {best.transport} ({how}, est {best.estimate_s * 1e3:.3g} ms)"
        if others:
            reason += f"; next: {others}"
    return Selection(choices=tuple(choices), reason=reason, rejected=tuple(rejected))
