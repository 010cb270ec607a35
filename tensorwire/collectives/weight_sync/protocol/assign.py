"""The driver's side of a push's setup: from the plan, each member's part in every stream
(:func:`assign_roles`: one relay tree per stream) and each member's :class:`.spec.PushSpec`,
serialised once (:func:`member_specs`)."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tensorwire.collectives.groups.channel import member_from
from tensorwire.collectives.groups.tensorwire_group import broadcast_parents
from tensorwire.collectives.weight_sync.planning.buckets import push_deadline_s
from tensorwire.collectives.weight_sync.planning.layout import ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import Arrived, Plan
from tensorwire.collectives.weight_sync.protocol.by_value import by_value
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec, Region, Role
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.transport.agent.wire import peer_to_bytes

__all__ = ["SyncSettings", "assign_roles", "member_specs"]


class SyncSettings(Protocol):
    """What a push's setup reads of its :class:`..sync.WeightSync`."""

    sync_id: str
    name: str
    trainers: tuple[Any, ...]
    trainer_layouts: list[tuple[ParamPiece, ...]]
    trainer_descriptions: list[tuple[bytes, int]]
    receiver_descriptions: dict[int, tuple[bytes, int]]
    plan: Plan
    source: str | None
    target: str | None
    bucket_bytes: int
    verify: bool
    transport: str
    timeout_s: float
    stall_s: float | None
    progress: bool
    atomic: bool
    commit: str
    publish: str
    fence: str | None
    on_commit: str | Callable[[Any, int], None] | None
    transform: Callable[[str, Any], Any] | None
    aside: str
    load: str | None

    @property
    def receiver_layouts(self) -> dict[int, tuple[ParamPiece, ...]]: ...


def assign_roles(
    plan: Plan,
    live: Sequence[int],
    *,
    trainer_layouts: Sequence[Sequence[ParamPiece]],
    receiver_layouts: Sequence[Sequence[ParamPiece]],
    descriptions: Sequence[tuple[bytes, int]],
    bucket_bytes: int,
    have: Mapping[int, Arrived] | None = None,
    first_stream: int = 0,
) -> tuple[dict[int, tuple[Role, ...]], int]:
    """Per channel rank (the trainers, then the ``live`` receivers in order): its part in
    every stream of ``plan``, with one relay tree per stream; and the number of buckets.
    ``descriptions`` are the members' (``describe_self``), in channel-rank order; ``have``:
    pieces receivers hold already (:meth:`Plan.streams`); ``first_stream``: the first stream
    id (a cover's streams run beside the try's, :mod:`..recovery.cover`: their staging apart)."""
    m = len(trainer_layouts)
    rank_of = {rid: m + i for i, rid in enumerate(live)}
    trainer_index = [{p.name: i for i, p in enumerate(layout)} for layout in trainer_layouts]
    receiver_index = {
        r: {p.name: i for i, p in enumerate(layout)} for r, layout in zip(live, receiver_layouts, strict=True)
    }
    roles: dict[int, list[Role]] = {rank: [] for rank in range(len(descriptions))}
    streams = plan.streams(live, bucket_bytes, have)
    for sid, stream in enumerate(streams, start=first_stream):
        ranks = [stream.trainer, *(rank_of[r] for r in stream.readers)]
        compact = [member_from(i, descriptions[rank]) for i, rank in enumerate(ranks)]
        parents = {ranks[c]: ranks[p] for c, p in broadcast_parents(compact, 0).items()}
        children: dict[int, list[int]] = {}
        for child, parent in parents.items():
            children.setdefault(parent, []).append(child)
        slot = stream.slot_nbytes
        first = stream.transfers[stream.readers[0]]
        names = trainer_index[stream.trainer]
        buckets = tuple(
            tuple(Region(names[first[i].source], first[i].src, first[i].wire_dtype) for i in b) for b in stream.buckets
        )
        roles[stream.trainer].append(
            Role(sid, -1, tuple(children.get(stream.trainer, ())), buckets, slot, stream.trainer)
        )
        for r in stream.readers:
            mine, index, rank = stream.transfers[r], receiver_index[r], rank_of[r]
            buckets = tuple(
                tuple(Region(index[mine[i].target], mine[i].dst, mine[i].wire_dtype) for i in b) for b in stream.buckets
            )
            roles[rank].append(Role(sid, parents[rank], tuple(children.get(rank, ())), buckets, slot, stream.trainer))
    return {rank: tuple(r) for rank, r in roles.items()}, sum(len(s.buckets) for s in streams)


def member_specs(
    sync: SyncSettings,
    live: tuple[int, ...],
    have: Mapping[int, Arrived] | None,
    *,
    in_place: bool,
    voted: bool = False,
    only: Mapping[int, frozenset[str]] | None = None,
    first_stream: int = 0,
) -> tuple[dict[int, bytes], dict[int, tuple[Role, ...]], int]:
    """Each member's part of a push over the ``live`` receivers (``have``: pieces they hold
    already; ``in_place``: all-or-none without shadows; ``voted``: in place, the driver said
    commit in an earlier try; ``only``: per receiver, the parameters a subset push rewrites
    and publishes; ``first_stream``: as :func:`assign_roles`), serialised once (pushes over
    the same members only change the version and channel); the roles per channel rank; the
    buckets."""
    descriptions = (*sync.trainer_descriptions, *(sync.receiver_descriptions[r] for r in live))
    layouts = [*sync.trainer_layouts, *(sync.receiver_layouts[r] for r in live)]
    roles, buckets = assign_roles(
        sync.plan,
        live,
        trainer_layouts=sync.trainer_layouts,
        receiver_layouts=layouts[len(sync.trainers) :],
        descriptions=descriptions,
        bucket_bytes=sync.bucket_bytes,
        have=have,
        first_stream=first_stream,
    )
    driver = peer_to_bytes(runtime_agent().peer)
    blobs = {}
    for rank in range(len(descriptions)):
        common = _common_part(
            sync,
            descriptions=descriptions,
            layout=layouts[rank],
            rank=rank,
            roles=roles[rank],
            driver=driver,
            buckets=buckets,
        )
        is_trainer = rank < len(sync.trainers)
        if is_trainer:
            spec = _trainer_spec(sync, common)
        else:
            published = None if only is None else only.get(live[rank - len(sync.trainers)], frozenset())
            spec = _receiver_spec(sync, common, in_place, voted, published)
        blobs[rank] = _serialised(spec)
    return blobs, roles, buckets


def _common_part(
    sync: SyncSettings,
    *,
    descriptions: tuple[tuple[bytes, int], ...],
    layout: tuple[ParamPiece, ...],
    rank: int,
    roles: tuple[Role, ...],
    driver: bytes,
    buckets: int,
) -> dict[str, Any]:
    """The fields every member's spec has (the version and channel are set per push)."""
    return {
        "sync_id": sync.sync_id,
        "name": sync.name,
        "version": 0,
        "channel": "",
        "members": descriptions,
        "rank": rank,
        "layout": layout,
        "roles": roles,
        "verify": sync.verify,
        "transport": sync.transport,
        "timeout_s": sync.timeout_s,
        "fence": sync.fence,
        "commit": sync.commit,
        "deadline_s": push_deadline_s(sync.timeout_s, buckets),  # as the driver's wait
        "trainers": len(sync.trainers),
        "stall_s": sync.stall_s or 0.0,  # (0: adaptive, recovery/stalls.py)
        "driver": driver,
    }


def _trainer_spec(sync: SyncSettings, common: dict[str, Any]) -> PushSpec:
    """A trainer's spec: where its tensors are, its transform; the driver's address only to
    report progress (a bar to draw)."""
    return PushSpec(
        **{**common, "driver": common["driver"] if sync.progress else b""},
        where=sync.source,
        transform=sync.transform,
    )


def _receiver_spec(
    sync: SyncSettings, common: dict[str, Any], in_place: bool, voted: bool, published: frozenset[str] | None
) -> PushSpec:
    """A receiver's spec: where its tensors are, how it commits (a shadow, or in place), what
    it publishes (``published``: a subset push's parameters; None: all), its float8 scales and
    ``on_commit``."""
    index = {p.name: i for i, p in enumerate(common["layout"])}
    scales = tuple((index[n], index[s]) for n, s in sync.plan.mapping.scales.items() if n in index and s in index)
    return PushSpec(
        **common,
        where=sync.target,
        shadow=(sync.atomic or sync.commit == "all" or sync.load is not None) and not in_place,
        load=sync.load,
        shadow_on_host=sync.aside == "host",
        publish=sync.publish,
        scales=scales,
        on_commit=sync.on_commit,
        in_place=in_place,
        voted=voted and in_place,
        published=_published(published, index, scales),
    )


def _published(
    published: frozenset[str] | None, index: Mapping[str, int], scales: tuple[tuple[int, int], ...]
) -> tuple[int, ...] | None:
    """The parameter indices a subset push's receiver publishes: its parameters and the scale
    of each float8 one among them (None: a whole push, all)."""
    if published is None:
        return None
    chosen = {index[n] for n in published}
    chosen.update(scale for param, scale in scales if param in chosen)
    return tuple(sorted(chosen))


def _serialised(spec: PushSpec) -> bytes:
    """The C pickler (tens of times faster than cloudpickle on thousands of small records),
    with the user's functions by value (:mod:`.by_value`: a function defined in the user's
    script exists on the members' side too)."""
    travelling = dataclasses.replace(spec, transform=by_value(spec.transform), on_commit=by_value(spec.on_commit))
    return pickle.dumps(travelling, protocol=pickle.HIGHEST_PROTOCOL)
