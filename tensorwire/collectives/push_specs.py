"""The driver's side of a push's setup: each member's :class:`.sync_spec.PushSpec`, serialised
once, and whether the receivers may assemble a version in place (``aside="none"``)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from collections.abc import Mapping as MappingABC
from typing import Any, Protocol

import cloudpickle

from tensorwire.collectives.failover import replan_without
from tensorwire.collectives.layout import HeldParam
from tensorwire.collectives.plan import Held, Plan
from tensorwire.collectives.sync_spec import PushSpec, Role, assign_roles
from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.transport.agent.wire import peer_to_bytes

__all__ = ["SyncSettings", "member_specs", "two_sources"]


class SyncSettings(Protocol):
    """What a push's setup reads of its :class:`.weight_sync.WeightSync`."""

    sync_id: str
    name: str
    trainers: tuple[Any, ...]
    trainer_layouts: list[tuple[HeldParam, ...]]
    trainer_descriptions: list[tuple[bytes, int]]
    receiver_descriptions: dict[int, tuple[bytes, int]]
    plan: Plan
    source: str | None
    target: str | None
    bucket_bytes: int
    verify: bool
    transport: str
    timeout_s: float
    stall_s: float
    progress: bool
    atomic: bool
    commit: str
    fence: str | None
    on_commit: str | Callable[[Any, int], None] | None
    transform: Callable[[str, Any], Any] | None

    @property
    def receiver_layouts(self) -> dict[int, tuple[HeldParam, ...]]: ...


def two_sources(sync: SyncSettings, live: tuple[int, ...]) -> bool:
    """Whether every byte the ``live`` receivers get has a second trainer holding it: losing any
    one trainer leaves a plan (:func:`.failover.replan_without`), so an in-place version can
    always be completed."""
    receivers = {rid: sync.receiver_layouts[rid] for rid in live}
    return len(sync.trainers) > 1 and all(
        replan_without(i, sync.trainer_layouts, sync.plan.mapping, receivers)[0] is not None
        for i in range(len(sync.trainers))
    )


def member_specs(
    sync: SyncSettings,
    live: tuple[int, ...],
    have: MappingABC[int, Held] | None,
    *,
    in_place: bool,
    voted: bool = False,
) -> tuple[dict[int, bytes], dict[int, tuple[Role, ...]], int]:
    """Each member's part of a push over the ``live`` receivers (``have``: pieces they hold
    already; ``in_place``: all-or-none without shadows; ``voted``: in place, the driver said
    commit in an earlier try), serialised once (pushes over the same members only change the
    version and channel); the roles per channel rank; the buckets."""
    trainer_layouts, m = sync.trainer_layouts, len(sync.trainers)
    descriptions = (*sync.trainer_descriptions, *(sync.receiver_descriptions[r] for r in live))
    layouts = [sync.receiver_layouts[r] for r in live]  # (a copy each call: once per push setup)
    roles, buckets = assign_roles(
        sync.plan,
        live,
        trainer_layouts=trainer_layouts,
        receiver_layouts=layouts,
        descriptions=descriptions,
        bucket_bytes=sync.bucket_bytes,
        have=have,
    )
    driver = peer_to_bytes(runtime_agent().peer)
    blobs = {}
    for rank in range(len(descriptions)):
        trainer = rank < m
        layout = trainer_layouts[rank] if trainer else layouts[rank - m]
        index = {p.name: i for i, p in enumerate(layout)}
        scales = (
            ()
            if trainer
            else tuple((index[n], index[s]) for n, s in sync.plan.mapping.scales.items() if n in index and s in index)
        )
        spec = PushSpec(
            sync_id=sync.sync_id,
            name=sync.name,
            version=0,
            channel="",
            members=descriptions,
            rank=rank,
            where=sync.source if trainer else sync.target,
            layout=layout,
            roles=roles[rank],
            verify=sync.verify,
            transport=sync.transport,
            timeout_s=sync.timeout_s,
            driver=driver if sync.progress or not trainer else b"",
            atomic=(sync.atomic or sync.commit == "all") and not trainer and not in_place,
            fence=sync.fence,
            scales=scales,
            transform=sync.transform if trainer else None,
            commit=sync.commit,
            deadline_s=sync.timeout_s * (buckets + 2),  # as the driver's wait (push_wait.PushWait)
            on_commit=None if trainer else sync.on_commit,
            trainers=m,
            stall_s=sync.stall_s,
            in_place=in_place and not trainer,
            voted=voted and in_place and not trainer,
        )
        try:  # the C pickler: tens of times faster than cloudpickle on thousands of small records
            blobs[rank] = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError):  # a lambda as transform
            blobs[rank] = cloudpickle.dumps(spec)
    return blobs, roles, buckets
