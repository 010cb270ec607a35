"""A receiver's side of a push (hooks the driver calls through Ray).

:func:`receive` runs the push in a receiver, in four steps:

1. **in place only**: hold the fence and vote before the first write (:func:`_vote_first`);
2. **read**: every stream it is in, each in order and the streams as their buckets come (a
   relay at most one bucket ahead of its slowest stream), into where
   :func:`..commit.aside.destinations` says each piece lands (its tensors, their shadows, or a
   float8 staging tensor), relaying each bucket on to its node-mates when it leads a node
   (:class:`_Intake`); a trainer lost on one stream does not stop the others (the failover
   reads what is missing);
3. **vote**: with ``commit="all"`` (shadows), tell the driver the version is assembled and wait
   for its decision (:func:`..commit.vote.vote`);
4. **commit**: quantise float8 parameters, publish inside the fence, run ``on_commit``
   (:func:`..commit.receiver.commit`).

A receiver records the version only when every stream completed; on any failure it tells its
parents (so that they stop waiting for it) and, in place, lets go of its fence (``TORN`` if it
wrote part of the version) or keeps it for the failover's next try.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch

from tensorwire.collectives.groups.channel import Channel
from tensorwire.collectives.weight_sync.commit import aside
from tensorwire.collectives.weight_sync.commit import receiver as commit
from tensorwire.collectives.weight_sync.commit.receiver import weight_version
from tensorwire.collectives.weight_sync.commit.vote import abort_check, any_abort_check, vote
from tensorwire.collectives.weight_sync.members.common import (
    at_fault_point,
    bucket_views,
    channel_of,
    fanouts_of,
    load_spec,
    member_tensors,
    memo,
    view,
)
from tensorwire.collectives.weight_sync.members.intake import WaitClock, acknowledge, next_message, take_from
from tensorwire.collectives.weight_sync.protocol import messages
from tensorwire.collectives.weight_sync.protocol.messages import BucketKind, parse_bucket_message
from tensorwire.collectives.weight_sync.protocol.spec import BucketSpan, PushSpec, ReceiveResult, Region, Role
from tensorwire.collectives.weight_sync.recovery import arrivals, covered
from tensorwire.collectives.weight_sync.recovery.stalls import StallWatch
from tensorwire.collectives.weight_sync.streams.fanout import serving
from tensorwire.collectives.weight_sync.streams.staging import checksum
from tensorwire.errors import TensorwireError, TrainerLost
from tensorwire.runtime.ray.hooks import actor_hook

__all__ = ["abandon", "cover_read", "receive"]


@actor_hook
def receive(
    actor: object,
    spec: PushSpec | bytes,
    version: int | None = None,
    channel: str | None = None,
    *,
    rehearsal: bool = False,
) -> ReceiveResult:
    """Hook, receiver: read every stream it is in into its tensors, serve the ones it leads,
    and commit (see the module doc). ``rehearsal``: read everything aside (shadows) and commit
    nothing, so that what pushes need is made and touched once (``WeightSync.prepare``)."""
    start = time.perf_counter()
    spec = load_spec(spec, version, channel)
    arrivals.start_receiving(spec)
    intake = _Intake(spec)
    try:
        with serving(list(intake.fanouts.values()), f"relay {spec.rank}"):
            refused = _receive_and_commit(actor, spec, intake, rehearsal=rehearsal)
    finally:
        intake.channel.close()
    return intake.result(refused, time.perf_counter() - start)


def _receive_and_commit(actor: object, spec: PushSpec, intake: _Intake, *, rehearsal: bool) -> str | None:
    """Steps 1-4 of the module doc; None once committed, else why not (the vote aborted, or a
    rehearsal)."""
    try:
        targets = member_tensors(actor, spec, "target")
        if spec.shadow and spec.publish == "swap":
            _check_swappable(actor, spec, targets)
        if rehearsal and not spec.shadow:
            raise ValueError("a rehearsal reads aside only: this receiver writes in place")
        if spec.in_place:
            _vote_first(actor, spec)
        dsts = aside.destinations(spec, targets)
        intake.read_all(dsts, coverable=not rehearsal and spec.shadow and spec.commit == "all")
        if rehearsal:
            return messages.REHEARSAL
        return _commit(actor, spec, targets, dsts)
    except _NotWriting as e:  # in place, and the vote aborted: nothing was written
        intake.tell_parents(f"receiver {spec.rank}: not writing: {e}")
        return str(e)
    except BaseException as e:  # tell the parents, so that they stop waiting for this receiver
        if spec.in_place and isinstance(e, TrainerLost):
            commit.pause(spec)  # the fence stays held for the failover's next try
        elif spec.in_place:
            commit.let_go(spec.sync_id)  # torn, if it wrote part of the version
        intake.tell_parents(f"receiver {spec.rank}: {type(e).__name__}: {e}")
        raise


def _commit(actor: object, spec: PushSpec, targets: list[torch.Tensor], dsts: list[torch.Tensor]) -> str | None:
    """Quantise, vote (all-or-none with shadows), publish; None once committed, else why not."""
    if not commit.committed_already(spec):
        aside.quantise(spec, targets, dsts)
    commit.check_commit(actor, spec)  # a missing fence or hook fails before the vote
    refused = vote(spec) if spec.commit == "all" and not spec.in_place else None
    if refused is None:
        commit.commit(actor, spec, targets)
    return refused


def _check_swappable(actor: object, spec: PushSpec, targets: list[torch.Tensor]) -> None:
    """``publish="swap"`` re-points the tensor objects the receiver gives: they must be its own
    (the same objects every time it is asked, not fresh views or copies, which the swap would
    leave behind while the receiver went on reading the old memory) and contiguous (as shadows
    are).

    Raises:
        ValueError: Naming the first tensor that is not.
    """
    again = member_tensors(actor, spec, "target")
    for held, first, second in zip(spec.layout, targets, again, strict=True):
        if first is not second:
            raise ValueError(
                f"publish='swap': the receiver gives a new tensor object for {held.name!r} each time it is asked "
                "(a view or a copy: state_dict() of a dict it builds, a DTensor's to_local()); swapping memory "
                "into it would not reach the receiver's own tensor: give its own tensors, or use publish='copy'"
            )
        if not first.is_contiguous():
            raise ValueError(f"publish='swap': {held.name!r} is not contiguous; use publish='copy'")


@actor_hook
def cover_read(  # noqa: PLR0917 (a hook: the driver passes its arguments in order)
    actor: object, spec: PushSpec | bytes, version: int, channel: str, of_try: str, trainers: tuple[int, ...]
) -> ReceiveResult:
    """Hook, receiver: read the share of ``trainers`` (lost in the try running beside on channel
    ``of_try``, by their channel ranks there) from the others into the same shadows, and commit
    nothing: the try commits once it is in (:mod:`..recovery.covered`, :mod:`..recovery.cover`)."""
    start = time.perf_counter()
    spec = load_spec(spec, version, channel)
    arrivals.start_receiving(spec)
    covered.began(spec.sync_id, of_try, trainers)
    intake = _Intake(spec, cover=True)
    try:
        with serving(list(intake.fanouts.values()), f"relay {spec.rank}"):
            try:
                intake.read_all(aside.destinations(spec, member_tensors(actor, spec, "target")), coverable=False)
            except BaseException as e:
                covered.ended(spec.sync_id, of_try, trainers, f"{type(e).__name__}: {e}")
                intake.tell_parents(f"receiver {spec.rank}: {type(e).__name__}: {e}")
                raise
            covered.ended(spec.sync_id, of_try, trainers)
    finally:
        intake.channel.close()
    return intake.result(messages.COVER_READ, time.perf_counter() - start)


_RELAY_AHEAD = 1  # how many buckets a relay's fastest stream may run ahead of its slowest


class _NotWriting(TensorwireError):
    """An in-place receiver's vote came back ``abort``: it writes nothing."""


def _vote_first(actor: object, spec: PushSpec) -> None:
    """In place: hold the fence and vote before the first write (once per version: a failover's
    next try goes on writing).

    Raises:
        _NotWriting: The driver aborted the push (the fence is let go; nothing was written).
    """
    if commit.promised(spec) or commit.committed_already(spec):
        return
    commit.check_commit(actor, spec)  # a missing fence or hook fails before the vote
    commit.hold_fence(actor, spec, voted=spec.voted)
    if spec.voted:  # a failover's next try, for a receiver that let go (its hold ran out, say): write
        return
    refused = vote(spec)
    if refused is not None:
        commit.let_go(spec.sync_id)
        raise _NotWriting(refused)
    commit.mark_voted(spec)


class _Intake:
    """One push's reading in a receiver: every stream it is in, the relays it serves, what it
    took in (for its :class:`ReceiveResult`) and the trainers it lost."""

    def __init__(self, spec: PushSpec, *, cover: bool = False) -> None:
        self.spec = spec
        self.channel: Channel = channel_of(spec)
        self.fanouts = fanouts_of(self.channel, spec)
        self.aborted = _stop_check(spec, covers=not cover)
        self.cover = cover
        self.start = time.monotonic()
        self.transfer_s = self.unpack_s = self.verify_s = 0.0
        self.nbytes = 0
        self.transports: dict[str, int] = {}
        self.spans: list[BucketSpan] = []
        self.acks: list[Callable[[], None]] = []
        self.acked = {role.stream: 0 for role in spec.roles}  # stream -> buckets acknowledged
        self.lost: dict[int, TrainerLost] = {}  # stream -> its trainer died or stalled: the others are still read
        trainers = {role.parent for role in spec.roles if 0 <= role.parent < spec.trainers}
        me = self.channel.members[spec.rank].peer
        self.watches = {  # each trainer's progress
            rank: StallWatch(spec, same_machine=self.channel.members[rank].peer.same_machine(me)) for rank in trainers
        }

    def read_all(self, dsts: list[torch.Tensor], *, coverable: bool) -> None:
        """Every bucket of every stream, each stream's in order and the streams' as they come
        (a stream whose trainer is gone holds none of the others; a relay reads at most
        :data:`_RELAY_AHEAD` bucket ahead of its slowest stream, as two relays each waiting in
        ``offer`` for the other's acknowledgement would otherwise wait for good; at most one
        level of relay acknowledgements outstanding); once the others are read, waits for the
        cover of the trainers it lost (``coverable``: an all-or-none read aside,
        :mod:`..recovery.covered`) or raises the first of them lost."""
        roles = {role.stream: role for role in self.spec.roles}
        cursor = dict.fromkeys(roles, 0)
        active = [s for s, role in roles.items() if role.buckets]
        clocks: dict[int, WaitClock] = {}
        level = 0
        while active:
            active.sort(key=cursor.__getitem__)  # the oldest bucket first, of those here at once
            limit = cursor[active[0]] + _RELAY_AHEAD if self.fanouts else math.inf
            waiting = {s: (roles[s].parent, messages.bucket_key(s, cursor[s])) for s in active if cursor[s] <= limit}
            stream, got = next_message(
                self.channel, self.spec, waiting, check=self.aborted, watches=self.watches, clocks=clocks
            )
            role = roles[stream]
            if isinstance(got, TrainerLost):
                self._lose(role, got)
            else:
                self._take_bucket(role, cursor[stream], dsts, got)
            cursor[stream] += 1
            if stream in self.lost or cursor[stream] >= len(role.buckets):
                active.remove(stream)
            while len(self.acks) > len(self.spec.roles):
                self.acks.pop(0)()
            level = self._levels_handled(level, cursor, active)
        for ack in self.acks:
            ack()
        if self.lost and not coverable:
            raise next(iter(self.lost.values()))
        if self.lost:
            trainers = {role.stream: role.trainer for role in self.spec.roles}
            lost = {trainers[stream]: e for stream, e in self.lost.items()}
            deadline = self.start + self.spec.deadline_s
            covered.wait(self.spec, lost, aborted=any_abort_check(self.spec), deadline=deadline)

    def _levels_handled(self, level: int, cursor: dict[int, int], active: list[int]) -> int:
        """The bucket levels every stream is past now (its fault points run once each)."""
        done = min((cursor[s] for s in active), default=max((len(r.buckets) for r in self.spec.roles), default=0))
        for k in range(level, done):
            at_fault_point("receiver", k)
        return max(level, done)

    def _lose(self, role: Role, error: TrainerLost) -> None:
        """``role``'s trainer died or stalled: what the others send is kept for the failover;
        node-mates it relays to go on with their other streams too."""
        self.lost[role.stream] = error
        if role.stream in self.fanouts:
            self.fanouts[role.stream].abort(messages.RELAY_LOST_TRAINER + str(error))

    def _take_bucket(self, role: Role, k: int, dsts: list[torch.Tensor], message: bytes) -> None:
        """Bucket ``k`` of ``role``'s stream (its ``message`` came): copy it in, check it,
        record it, acknowledge it, relay it."""
        spec, what = self.spec, f"bucket {k} from member {role.parent}"
        arrived = memo(role.buckets, lambda buckets: [_received(spec, b) for b in buckets])
        if self.cover and role.stream not in self.fanouts and arrivals.holds(spec, arrived[k]):
            self._acknowledge(role, k)  # a cover's bucket the try delivered already: not read again
            return
        prepared = memo(role.buckets[k], lambda b: bucket_views(b, spec.layout))
        views = [view(dsts[param], where) for param, where, _d in prepared]
        dtypes = [dtype for _p, _w, dtype in prepared]
        try:
            kind, expected, payload = parse_bucket_message(message, what)
            if kind is BucketKind.ABORT:
                _raise_aborted(spec, role.parent, what, payload)
            began, fetch_start = time.time(), time.perf_counter()
            transport, slow_s, sent = take_from(
                self.channel,
                spec,
                role.parent,
                (kind, payload),
                views=views,
                dtypes=dtypes,
                watch=self.watches.get(role.parent),
            )
        except TrainerLost as e:
            self._lose(role, e)
            return
        took = time.perf_counter() - fetch_start
        size = sum(v.numel() * d.itemsize for v, d in zip(views, dtypes, strict=True))
        self._account(BucketSpan(role.parent, k, transport, began, took, size), slow_s)
        if spec.verify:
            self._verify(views, expected, what)
        arrivals.note_received(spec, arrived[k])
        self._acknowledge(role, k)
        if role.stream in self.fanouts:
            self.fanouts[role.stream].offer(k, [(t, t.dtype) for t in sent], expected)

    def _acknowledge(self, role: Role, k: int) -> None:
        self.acks.append(acknowledge(self.channel, self.spec, role.parent, messages.ack_key(role.stream, k)))
        self.acked[role.stream] = k + 1

    def _account(self, span: BucketSpan, slow_s: float) -> None:
        self.transports[span.transport] = self.transports.get(span.transport, 0) + 1
        self.unpack_s += slow_s
        self.transfer_s += span.seconds - slow_s
        self.nbytes += span.nbytes
        self.spans.append(span)

    def _verify(self, views: list[torch.Tensor], expected: int, what: str) -> None:
        start = time.perf_counter()
        intact = checksum(views) == expected
        self.verify_s += time.perf_counter() - start
        if not intact:
            raise TensorwireError(f"{what}: checksum mismatch")

    def tell_parents(self, reason: str) -> None:
        """So that they stop waiting for this receiver's acknowledgements (a trainer's is not
        waited for: one that stopped must not hold the receiver)."""
        waits = []
        for role in self.spec.roles:
            key = messages.ack_key(role.stream, self.acked[role.stream])
            with contextlib.suppress(TensorwireError):
                wait = self.channel.post(role.parent, key, reason.encode()[: messages.MAX_REASON_NBYTES])
                if role.parent >= self.spec.trainers:
                    waits.append(wait)
        for wait in waits:
            with contextlib.suppress(TensorwireError):
                wait()

    def result(self, refused: str | None, seconds: float) -> ReceiveResult:
        relay_failed: dict[int, str] = {}
        for fanout in self.fanouts.values():
            relay_failed.update(fanout.failed)
        return ReceiveResult(
            rank=self.spec.rank,
            version=self.spec.version if refused is None else weight_version(self.spec.name),
            nbytes=self.nbytes,
            transfer_s=self.transfer_s,
            unpack_s=self.unpack_s,
            verify_s=self.verify_s,
            seconds=seconds,
            transports=self.transports,
            relay_failed=relay_failed,
            peak_nbytes=sum(f.peak_nbytes for f in self.fanouts.values()),
            committed=refused is None,
            refused=refused or "",
            spans=tuple(self.spans),
            aside_nbytes=aside.aside_nbytes(self.spec.sync_id),
        )


def _stop_check(spec: PushSpec, *, covers: bool) -> Callable[[int], None]:
    """``check(parent)`` for the waits on a bucket from channel rank ``parent``: raises
    ``TrainerLost`` once a cover reads that trainer's share instead (``covers``: in a try, not
    in a cover), or the vote's abort (:func:`..commit.vote.abort_check`)."""
    vote_check = abort_check(spec)

    def check(parent: int) -> None:
        if covers and parent < spec.trainers:
            covered.check(spec, parent)
        if vote_check is not None:
            vote_check(parent)

    return check


def _received(spec: PushSpec, bucket: tuple[Region, ...]) -> list[arrivals.Received]:
    return [(spec.layout[r.param].name, r.wire_dtype, r.box.offsets, r.box.sizes) for r in bucket]


def _raise_aborted(spec: PushSpec, parent: int, what: str, payload: bytes) -> None:
    """Raise for an ``ABORT`` from channel rank ``parent``: ``TrainerLost`` when a relay lost its
    trainer, or (in place, where a failover replaces a trainer that failed too) a trainer failed."""
    why = payload.decode(errors="replace")
    if why.startswith(messages.RELAY_LOST_TRAINER) or (spec.in_place and parent < spec.trainers):
        raise TrainerLost(parent if parent < spec.trainers else -1, f"{what} will not come: {why}")
    raise TensorwireError(f"{what} will not come: {why}")


@actor_hook
def abandon(_actor: object, sync_id: str) -> None:
    """Hook, receiver: the driver gave up an in-place push: let go of the fence (the receiver is
    ``TORN`` if it wrote part of the version)."""
    commit.let_go(sync_id)
