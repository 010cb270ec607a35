"""What runs inside the weight-sync actors (hook methods the driver calls through Ray).

A trainer serves one stream per group of receivers that read the same pieces from it
(:mod:`.fanout`); a receiver reads every stream it is in, level by level (bucket k of each, then
k+1), copies the pieces into its tensors and relays a stream to its node-mates when it is
that node's leader. Everything arrives where the receiver keeps it: in place by default; with
``atomic`` into a shadow copy that one local copy inside the receiver's fence publishes; float8
parameters into a staging tensor of the wire dtype, quantised at the end with a per-tensor
scale. A receiver records the version only when every stream completed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorwire.collectives import bucket_intake as intake
from tensorwire.collectives import receiver_state
from tensorwire.collectives.channel import Channel, member_from
from tensorwire.collectives.commit import TrainerLost, abort_check
from tensorwire.collectives.commit import vote as commit_vote
from tensorwire.collectives.fanout import (
    BucketKind,
    Fanout,
    Piece,
    checksum,
    parse_message,
    serving,
)
from tensorwire.collectives.fanout import release as release_staging
from tensorwire.collectives.layout import HeldParam, describe_value
from tensorwire.collectives.receiver_state import weight_fence, weight_version
from tensorwire.collectives.sync_spec import (
    BucketSpan,
    PushSpec,
    ReceiveResult,
    Region,
    Role,
    SendResult,
    assign_roles,
)
from tensorwire.errors import TensorwireError
from tensorwire.runtime.hooks import actor_hook
from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.transport.agent.wire import peer_from_bytes

__all__ = [
    "PushSpec",
    "ReceiveResult",
    "Region",
    "Role",
    "SendResult",
    "assign_roles",
    "set_fault_point",
    "weight_fence",
    "weight_version",
]

_specs: dict[bytes, PushSpec] = {}  # the last spec the driver sent (serialised -> loaded)
_prepared: dict[int, tuple[Any, Any]] = {}  # id(part of a spec) -> (that part, what was computed from it)
_fault_point: list[Callable[[str, int], None]] = []  # set_fault_point's hook, if any


def set_fault_point(hook: Callable[[str, int], None] | None) -> None:
    """Inside a weight-sync member, for fault-injection tests: ``hook(role, k)`` runs each time
    this process has handled bucket level ``k`` of a push (role ``"trainer"``: offered it to
    every stream; ``"receiver"``: took it in), e.g. to kill the process at a named point
    instead of after a guessed delay. ``None`` removes it."""
    _fault_point[:] = [hook] if hook is not None else []


def _at_fault_point(role: str, k: int) -> None:
    for hook in _fault_point:
        hook(role, k)


def holder_value(actor: object, where: str | None, role: str) -> dict[str, Any]:
    """The named tensors of an actor: ``actor.<where>`` (a module, a dict, or a method giving
    either); by default its ``state_dict()`` method when it has one, else its ``model``."""
    if where is None:
        method = getattr(actor, "state_dict", None)
        if callable(method):
            return _as_dict(method(), "state_dict()", role)
        where = "model"
    if not isinstance(where, str) or not where:
        raise ValueError(f"{role} must name an attribute or method of the actor")
    if not hasattr(actor, where):
        raise AttributeError(
            f"the {role} actor ({type(actor).__name__}) has no attribute {where!r}; pass {role}=<the attribute "
            "or method that gives an nn.Module or a dict of tensors>"
        )
    value = getattr(actor, where)
    if callable(value) and not isinstance(value, torch.nn.Module):
        value = value()
    return _as_dict(value, where, role)


def _as_dict(value: Any, where: str, role: str) -> dict[str, Any]:
    if isinstance(value, torch.nn.Module):
        value = value.state_dict(keep_vars=False)
    if not isinstance(value, dict):
        raise TypeError(f"{role} {where!r} gives {type(value).__name__}, not an nn.Module or a dict of tensors")
    return value


@actor_hook
def layout(actor: object, where: str | None, role: str) -> list[HeldParam]:
    """Hook: the pieces this actor holds (``role``: "source" or "target")."""
    return describe_value(holder_value(actor, where, role), role)[0]


def _memo(obj: Any, make: Callable[[Any], Any]) -> Any:
    """``make(obj)`` for a part of a kept spec, computed once (pushes repeat the same spec)."""
    kept = _prepared.get(id(obj))
    if kept is None or kept[0] is not obj:
        if len(_prepared) > 100_000:
            _prepared.clear()
        kept = _prepared[id(obj)] = (obj, make(obj))
    return kept[1]


def _layout_key(layout: Sequence[HeldParam]) -> list[tuple[Any, ...]]:
    """A layout as plain tuples: compared in C (dataclass equality of thousands of entries is not)."""
    return [(h.name, h.global_shape, h.dtype, h.box.offsets, h.box.sizes, h.placements) for h in layout]


def _bucket_views(
    bucket: tuple[Region, ...], layout: Sequence[HeldParam]
) -> list[tuple[int, tuple[slice, ...] | None, torch.dtype]]:
    """(param, the slices of its piece or None for the whole local tensor, wire dtype) per region."""
    result = []
    for r in bucket:
        whole = not any(r.box.offsets) and r.box.sizes == layout[r.param].box.sizes
        result.append((r.param, None if whole else r.box.slices(), _dtype(r.wire_dtype)))
    return result


def _view(tensor: torch.Tensor, where: tuple[slice, ...] | None) -> torch.Tensor:
    return tensor if where is None else tensor[where]


def _tensors(actor: object, spec: PushSpec, role: str) -> list[torch.Tensor]:
    mine, tensors = describe_value(holder_value(actor, spec.where, role), role)
    if _layout_key(mine) != _memo(spec.layout, _layout_key):
        who = "trainer" if role == "source" else "receiver"
        raise ValueError(f"the {who}'s tensors changed shape, dtype or names since the WeightSync was made")
    return tensors


@actor_hook
def versions_hook(_actor: object, name: str) -> int:
    return weight_version(name)


@actor_hook
def arrived_hook(_actor: object, sync_id: str, version: int) -> list[receiver_state.Received]:
    """Hook, receiver: the pieces of ``version`` that arrived here (for a failover's second try)."""
    return receiver_state.received(sync_id, version)


@actor_hook
def release(_actor: object, sync_id: str) -> None:
    """Hook, every member: drop the staging, mappings and shadows of sync ``sync_id``."""
    release_staging(sync_id)
    _specs.clear()
    _prepared.clear()
    receiver_state.release(sync_id)


def _channel(spec: PushSpec) -> Channel:
    members = [member_from(r, d) for r, d in enumerate(spec.members)]
    return Channel(spec.channel, spec.rank, members, spec.timeout_s)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _fanouts(channel: Channel, spec: PushSpec, on_done: Callable[[int, int], None] | None = None) -> dict[int, Fanout]:
    result = {}
    for role in spec.roles:
        if role.children:
            done = (lambda k, s=role.stream: on_done(s, k)) if on_done else (lambda _k: None)
            result[role.stream] = Fanout(
                channel,
                role.children,
                sync_id=spec.sync_id,
                stream=role.stream,
                slot_nbytes=role.slot_nbytes,
                transport=spec.transport,
                on_done=done,
            )
    return result


def _load(spec: PushSpec | bytes, version: int | None, channel: str | None) -> PushSpec:
    """The spec of this push: given, or serialised by the driver (kept while it is the same)."""
    if isinstance(spec, bytes):
        kept = _specs.get(spec)
        if kept is None:
            _specs.clear()
            _prepared.clear()
            kept = _specs[spec] = pickle.loads(spec)  # from our driver, through Ray's own channel
        spec = kept
    if version is not None:
        spec = dataclasses.replace(spec, version=version, channel=channel or spec.channel)
    return spec


@actor_hook
def send(actor: object, spec: PushSpec | bytes, version: int | None = None, channel: str | None = None) -> SendResult:
    """Hook, trainer: serve every stream it is the server of, bucket level by level."""
    start = time.perf_counter()
    spec = _load(spec, version, channel)
    channel = _channel(spec)
    driver = peer_from_bytes(spec.driver) if spec.driver else None

    def report_progress(stream: int, k: int) -> None:
        if driver is not None:
            with contextlib.suppress(TensorwireError):  # progress is best effort
                runtime_agent().rendezvous_push(driver, spec.channel, f"progress/{stream}/{k}", b"", timeout_s=5.0)

    fanouts = _fanouts(channel, spec, report_progress)
    checksum_s = 0.0
    try:
        with serving(list(fanouts.values()), f"trainer {spec.rank}"):  # a failure here tells the receivers at once
            tensors = _tensors(actor, spec, "source")
            for k in range(max((len(r.buckets) for r in spec.roles), default=0)):
                for role in spec.roles:
                    if k >= len(role.buckets):
                        continue
                    pieces = _pieces(tensors, spec, role.buckets[k])
                    check_start = time.perf_counter()
                    check = checksum([_wire(p) for p in pieces]) if spec.verify else 0
                    checksum_s += time.perf_counter() - check_start
                    fanouts[role.stream].offer(k, pieces, check)
                _at_fault_point("trainer", k)
    finally:
        channel.close()
    failed: dict[int, str] = {}
    for fanout in fanouts.values():
        failed.update(fanout.failed)
    return SendResult(
        rank=spec.rank,
        pack_s=sum(f.pack_s for f in fanouts.values()),
        checksum_s=checksum_s,
        seconds=time.perf_counter() - start,
        failed=failed,
        sent_nbytes=sum(f.sent_nbytes for f in fanouts.values()),
        in_place_nbytes=sum(f.in_place_nbytes for f in fanouts.values()),
        peak_nbytes=sum(f.peak_nbytes for f in fanouts.values()),
    )


def _pieces(tensors: list[torch.Tensor], spec: PushSpec, bucket: tuple[Region, ...]) -> list[Piece]:
    prepared = _memo(bucket, lambda b: _bucket_views(b, spec.layout))
    if spec.transform is None:
        return [(_view(tensors[param], where), dtype) for param, where, dtype in prepared]
    pieces = []
    for param, where, dtype in prepared:
        view = _view(tensors[param], where)
        name = spec.layout[param].name
        changed = spec.transform(name, view)
        if tuple(changed.shape) != tuple(view.shape):
            raise ValueError(f"transform changed the shape of {name!r}: {tuple(view.shape)} -> {tuple(changed.shape)}")
        pieces.append((changed, dtype))
    return pieces


def _wire(piece: Piece) -> torch.Tensor:
    view, dtype = piece
    return view if view.dtype == dtype else view.to(dtype)


def _arrived(spec: PushSpec, bucket: tuple[Region, ...]) -> list[receiver_state.Received]:
    return [(spec.layout[r.param].name, r.wire_dtype, r.box.offsets, r.box.sizes) for r in bucket]


@actor_hook
def receive(
    actor: object, spec: PushSpec | bytes, version: int | None = None, channel: str | None = None
) -> ReceiveResult:
    """Hook, receiver: read every stream it is in into its tensors; serve the ones it leads."""
    start = time.perf_counter()
    spec = _load(spec, version, channel)
    receiver_state.start_receiving(spec)
    channel = _channel(spec)
    fanouts = _fanouts(channel, spec)
    aborted = abort_check(spec)
    transfer_s = unpack_s = verify_s = 0.0
    nbytes = 0
    transports: dict[str, int] = {}
    acks: list[Callable[[], None]] = []
    spans: list[BucketSpan] = []
    acked = {role.stream: 0 for role in spec.roles}
    lost: dict[int, TrainerLost] = {}  # stream -> its trainer died or stalled: the others are still read
    refused: str | None = None
    try:
        with serving(list(fanouts.values()), f"relay {spec.rank}"):
            try:
                targets = _tensors(actor, spec, "target")
                if spec.in_place:
                    _vote_first(actor, spec)
                dsts = receiver_state.destinations(spec, targets)
                for k in range(max((len(r.buckets) for r in spec.roles), default=0)):
                    for role in spec.roles:
                        if k >= len(role.buckets) or role.stream in lost:
                            continue
                        key = f"s{role.stream}/b{k}"
                        what = f"bucket {k} from member {role.parent}"
                        bucket = role.buckets[k]
                        prepared = _memo(bucket, lambda b: _bucket_views(b, spec.layout))
                        views = [_view(dsts[param], where) for param, where, _d in prepared]
                        dtypes = [dtype for _p, _w, dtype in prepared]
                        try:
                            message = intake.next_bucket(channel, spec, role.parent, key, aborted)
                            kind, expected, payload = parse_message(message, what)
                            if kind is BucketKind.ABORT:
                                _aborted(spec, role.parent, what, payload)
                            began, fetch_start = time.time(), time.perf_counter()
                            transport, slow_s, sent = intake.take_from(
                                channel, spec, role.parent, (kind, payload), views=views, dtypes=dtypes
                            )
                        except TrainerLost as e:  # what the others send is kept for the failover
                            lost[role.stream] = e
                            if role.stream in fanouts:  # node-mates go on with their other streams too
                                fanouts[role.stream].abort(_LOST + str(e))
                            continue
                        took = time.perf_counter() - fetch_start
                        transports[transport] = transports.get(transport, 0) + 1
                        unpack_s += slow_s
                        transfer_s += took - slow_s
                        size = sum(v.numel() * d.itemsize for v, d in zip(views, dtypes, strict=True))
                        nbytes += size
                        spans.append(BucketSpan(role.parent, k, transport, began, took, size))
                        if spec.verify:
                            verify_start = time.perf_counter()
                            intact = checksum(views) == expected
                            verify_s += time.perf_counter() - verify_start
                            if not intact:
                                raise TensorwireError(f"bucket {k} from member {role.parent}: checksum mismatch")
                        arrived = _memo(role.buckets, lambda buckets: [_arrived(spec, b) for b in buckets])
                        receiver_state.note_received(spec, arrived[k])
                        acks.append(intake.acknowledge(channel, spec, role.parent, f"{key}/ack"))
                        acked[role.stream] = k + 1
                        if role.stream in fanouts:
                            fanouts[role.stream].offer(k, [(t, t.dtype) for t in sent], expected)
                    while len(acks) > len(spec.roles):
                        acks.pop(0)()
                    _at_fault_point("receiver", k)
                for ack in acks:
                    ack()
                if lost:
                    raise next(iter(lost.values()))
                if not receiver_state.committed_already(spec):
                    receiver_state.quantise(spec, targets, dsts)
                receiver_state.check_commit(actor, spec)  # a missing fence or hook fails before the vote
                refused = commit_vote(spec) if spec.commit == "all" and not spec.in_place else None
                if refused is None:
                    receiver_state.commit(actor, spec, targets)
            except _NotWriting as e:  # in place, and the vote aborted: nothing was written
                refused = str(e)
                _tell_parents(channel, spec, acked, f"receiver {spec.rank}: not writing: {refused}")
            except BaseException as e:  # tell the parents, so that they stop waiting for this receiver
                if spec.in_place and isinstance(e, TrainerLost):
                    receiver_state.pause(spec)  # the fence stays held for the failover's next try
                elif spec.in_place:
                    receiver_state.let_go(spec.sync_id)  # torn, if it wrote part of the version
                _tell_parents(channel, spec, acked, f"receiver {spec.rank}: {type(e).__name__}: {e}")
                raise
    finally:
        channel.close()
    relay_failed: dict[int, str] = {}
    for fanout in fanouts.values():
        relay_failed.update(fanout.failed)
    return ReceiveResult(
        rank=spec.rank,
        version=spec.version if refused is None else weight_version(spec.name),
        nbytes=nbytes,
        transfer_s=transfer_s,
        unpack_s=unpack_s,
        verify_s=verify_s,
        seconds=time.perf_counter() - start,
        transports=transports,
        relay_failed=relay_failed,
        peak_nbytes=sum(f.peak_nbytes for f in fanouts.values()),
        committed=refused is None,
        refused=refused or "",
        spans=tuple(spans),
        aside_nbytes=receiver_state.aside_nbytes(spec.sync_id),
    )


class _NotWriting(TensorwireError):
    """An in-place receiver's vote came back ``abort``: it writes nothing."""


def _vote_first(actor: object, spec: PushSpec) -> None:
    """In place: hold the fence and vote before the first write (once per version: a failover's
    next try goes on writing).

    Raises:
        _NotWriting: The driver aborted the push (the fence is let go; nothing was written).
    """
    if receiver_state.promised(spec) or receiver_state.committed_already(spec):
        return
    receiver_state.check_commit(actor, spec)  # a missing fence or hook fails before the vote
    receiver_state.hold_fence(actor, spec, voted=spec.voted)
    if spec.voted:  # a failover's next try, for a receiver that let go (its hold ran out, say): write
        return
    refused = commit_vote(spec)
    if refused is not None:
        receiver_state.let_go(spec.sync_id)
        raise _NotWriting(refused)
    receiver_state.mark_voted(spec)


_LOST = "trainer lost: "  # a relay's abort when its trainer was lost (its node-mates read the others on)


def _aborted(spec: PushSpec, parent: int, what: str, payload: bytes) -> None:
    """Raise for an ``ABORT`` from channel rank ``parent``: ``TrainerLost`` when a relay lost its
    trainer, or (in place, where a failover replaces a trainer that failed too) a trainer failed."""
    why = payload.decode(errors="replace")
    if why.startswith(_LOST) or (spec.in_place and parent < spec.trainers):
        raise TrainerLost(f"{what} will not come: {why}")
    raise TensorwireError(f"{what} will not come: {why}")


def _tell_parents(channel: Channel, spec: PushSpec, acked: dict[int, int], reason: str) -> None:
    """So that they stop waiting for this receiver's acknowledgements."""
    for role in spec.roles:
        with contextlib.suppress(TensorwireError):
            channel.send(role.parent, f"s{role.stream}/b{acked[role.stream]}/ack", reason.encode()[:4096])


@actor_hook
def abandon(_actor: object, sync_id: str) -> None:
    """Hook, receiver: the driver gave up an in-place push: let go of the fence (the receiver is
    ``TORN`` if it wrote part of the version)."""
    receiver_state.let_go(sync_id)
