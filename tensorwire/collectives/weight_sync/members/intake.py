"""How a weight-sync receiver takes one bucket in (:mod:`.receiver` runs it per bucket):
waiting for the bucket's message from its parent (a trainer that sends none within ``stall_s``
stalled, one that died or stalled is ``TrainerLost``), copying it into the destination views
from the sender's staging slot, as an announced object read in place, or some pieces each way,
and acknowledging it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tensorwire.collectives.groups.channel import Channel
from tensorwire.collectives.weight_sync.protocol.messages import SLOT, BucketKind, parse_mixed
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.collectives.weight_sync.recovery.stalls import StallWatch, report_death, report_stall
from tensorwire.collectives.weight_sync.streams.staging import read_slot, ring_reader
from tensorwire.errors import PeerLostError, TensorwireError, TrainerLost, TransferTimeoutError

__all__ = ["WaitClock", "acknowledge", "next_message", "take_from"]


def _take(
    channel: Channel,
    spec: PushSpec,
    bucket: tuple[BucketKind, bytes],
    views: list[torch.Tensor],
    dtypes: list[torch.dtype],
    *,
    timeout_s: float | None,
) -> tuple[str, float, list[torch.Tensor]]:
    """Copy one bucket into ``views``: from the sender's staging slot, as an announced object
    (read in place, within ``timeout_s``), or some pieces each way. Returns the transport, the
    seconds spent on strided or converted copies, and the bucket's tensors as sent (to relay)."""
    kind, payload = bucket
    if kind is BucketKind.RING:
        transport, slow_s = _take_ring(spec, payload, views, dtypes)
        return transport, slow_s, views
    if kind is BucketKind.OBJECT:
        return _take_object(channel, spec, payload, views, dtypes, timeout_s=timeout_s)
    mask, ring_payload, announcement = parse_mixed(payload)
    if len(mask) != len(views):
        raise TensorwireError(f"a mixed bucket of {len(mask)} pieces, expected {len(views)}")
    ringed = [i for i, m in enumerate(mask) if not m]
    direct = [i for i, m in enumerate(mask) if m]
    _ring, ring_slow_s = _take_ring(spec, ring_payload, [views[i] for i in ringed], [dtypes[i] for i in ringed])
    transport, slow_s, _sent = _take_object(
        channel, spec, announcement, [views[i] for i in direct], [dtypes[i] for i in direct], timeout_s=timeout_s
    )
    return transport, ring_slow_s + slow_s, views


def _take_ring(
    spec: PushSpec, payload: bytes, views: list[torch.Tensor], dtypes: list[torch.dtype]
) -> tuple[str, float]:
    (slot_nbytes,) = SLOT.unpack_from(payload)
    transport, reader = ring_reader(spec.sync_id)
    array = reader.mapped(payload[SLOT.size :].decode(), slot_nbytes)
    return transport, read_slot(array, views, dtypes)


def _take_object(
    channel: Channel,
    spec: PushSpec,
    announcement: bytes,
    views: list[torch.Tensor],
    dtypes: list[torch.dtype],
    *,
    timeout_s: float | None,
) -> tuple[str, float, list[torch.Tensor]]:
    direct = [v.dtype == d and v.is_contiguous() for v, d in zip(views, dtypes, strict=True)]
    fetched = channel.fetch(
        announcement,
        [v if ok else None for v, ok in zip(views, direct, strict=True)],
        transport=spec.transport,
        targets=[v.device for v in views],
        timeout_s=timeout_s,
    )
    copy_start = time.perf_counter()
    for i, ok in enumerate(direct):
        if not ok:
            views[i].copy_(fetched.tensors[i])
    return fetched.transport, fetched.copy_s + time.perf_counter() - copy_start, fetched.tensors


class _Lost(Exception):
    """Out of a wait's check: the trainer of ``stream`` was lost."""

    def __init__(self, stream: int, error: TrainerLost) -> None:
        super().__init__(str(error))
        self.stream = stream
        self.error = error


@dataclass
class WaitClock:
    """One stream's wait for its next bucket: the seconds spent waiting for it (blocked in
    :func:`next_message`, not copying other streams' buckets) and at what point of that to look
    at its trainer next (None: after the trainer's patience)."""

    waited_s: float = 0.0
    look_at_s: float | None = None


def next_message(
    channel: Channel,
    spec: PushSpec,
    waiting: Mapping[int, tuple[int, str]],
    *,
    check: Callable[[int], None] | None,
    watches: Mapping[int, StallWatch],
    clocks: dict[int, WaitClock],
) -> tuple[int, bytes | TrainerLost]:
    """The first bucket message to come of ``waiting`` (stream -> (parent's channel rank, key);
    of those here at once, the earliest in ``waiting``), as (stream, message); or (stream,
    ``TrainerLost``) for a stream whose trainer died or stalled first (:mod:`..recovery.stalls`:
    one that sent nothing while this receiver waited its patience for it, ``clocks[stream]``,
    and cannot act; ``watches``: each trainer's progress, by its rank). So a stream whose
    trainer is gone does not hold the others: they are read as their buckets come.
    ``check(parent)`` may raise to stop the wait on one stream (``TrainerLost``: a cover reads
    that trainer's share, or the driver said it was lost) or on all.

    Raises:
        PeerLostError: A relay parent (a receiver) exited.
        TransferTimeoutError: A relay parent sent nothing within ``spec.timeout_s``.
    """
    streams = list(waiting)
    for s in streams:
        clock = clocks.setdefault(s, WaitClock())
        if clock.look_at_s is None:
            clock.look_at_s = _patience(spec, watches, waiting[s][0])
    while True:
        began = time.monotonic()
        slice_s = min((clocks[s].look_at_s or 0.0) - clocks[s].waited_s for s in streams)
        try:
            index, message = channel.recv_any(
                [waiting[s] for s in streams],
                timeout_s=max(0.0, slice_s),
                check=lambda: _look(channel, spec, waiting, check),
            )
        except _Lost as e:
            _waited(clocks, streams, began)
            return e.stream, e.error
        except TransferTimeoutError as e:
            _waited(clocks, streams, began)
            lost = _look_at_trainers(channel, spec, waiting, watches, clocks, error=e)
            if lost is not None:
                return lost
            continue
        _waited(clocks, streams, began)
        stream = streams[index]
        clocks[stream] = WaitClock()  # (the next bucket's wait starts afresh)
        watch = watches.get(waiting[stream][0])
        if watch is not None:
            watch.arrived()
        return stream, message


def _waited(clocks: dict[int, WaitClock], streams: list[int], began: float) -> None:
    spent = time.monotonic() - began
    for s in streams:
        clocks[s].waited_s += spent


def _look_at_trainers(
    channel: Channel,
    spec: PushSpec,
    waiting: Mapping[int, tuple[int, str]],
    watches: Mapping[int, StallWatch],
    clocks: dict[int, WaitClock],
    *,
    error: TransferTimeoutError,
) -> tuple[int, TrainerLost] | None:
    """After a wait ran out: each stream waited for as long as its next look says, looked at
    (``_raise_if_stalled``): (stream, ``TrainerLost``) for one whose trainer stalled; a slow one
    is looked at again after its patience more."""
    for stream, (parent, key) in waiting.items():
        clock = clocks[stream]
        if clock.look_at_s is None or clock.waited_s < clock.look_at_s:
            continue
        if parent not in watches:
            raise error  # a relay: as long as a message may take
        try:
            _raise_if_stalled(
                channel,
                spec,
                parent,
                watch=watches[parent],
                waited_s=clock.waited_s,
                what=f"no {key} within",
                error=error,
            )
        except TrainerLost as lost:
            return stream, lost
        clock.look_at_s = clock.waited_s + watches[parent].patience_s()  # slow, not stalled
    return None


def _patience(spec: PushSpec, watches: Mapping[int, StallWatch], parent: int) -> float:
    """How long a stream from ``parent`` may send nothing before a look (a relay: the push's timeout)."""
    watch = watches.get(parent)
    return watch.patience_s() if watch is not None else spec.timeout_s


def _look(
    channel: Channel, spec: PushSpec, waiting: Mapping[int, tuple[int, str]], check: Callable[[int], None] | None
) -> None:
    """While waiting: a parent that exited (a trainer: ``_Lost``, the driver told), and ``check``
    (once per parent)."""
    looked: set[int] = set()
    for stream, (parent, key) in waiting.items():
        if parent in looked:
            continue
        looked.add(parent)
        if not channel.alive(parent):
            if parent >= spec.trainers:
                raise PeerLostError(f"group {channel.name}: member {parent} exited (waiting for {key!r})")
            report_death(spec, parent)
            raise _Lost(
                stream, TrainerLost(parent, f"group {channel.name}: member {parent} exited (waiting for {key!r})")
            )
        if check is not None:
            try:
                check(parent)
            except TrainerLost as e:
                raise _Lost(stream, e) from None


def _raise_if_stalled(
    channel: Channel, spec: PushSpec, parent: int, *, watch: StallWatch, waited_s: float, what: str, error: Exception
) -> None:
    """After a wait on trainer ``parent`` ran out of patience: ``TrainerLost`` (the driver told)
    when it stalled (:meth:`StallWatch.stalled`: an explicit ``stall_s``, a process that cannot
    act, or one that sent nothing for too long); else return, to wait again."""
    responds = bool(watch.explicit_s) or channel.responds(parent)
    if not watch.stalled(waited_s, responds):
        return
    report_stall(spec, parent)
    within = f"{watch.explicit_s:g} s" if watch.explicit_s else f"{waited_s:.1f} s"
    how = "" if responds else " (its process is stopped or does not answer)"
    raise TrainerLost(parent, f"trainer member {parent} stalled: {what} {within}{how}") from error


def take_from(
    channel: Channel,
    spec: PushSpec,
    parent: int,
    bucket: tuple[BucketKind, bytes],
    *,
    views: list[torch.Tensor],
    dtypes: list[torch.dtype],
    watch: StallWatch | None = None,
) -> tuple[str, float, list[torch.Tensor]]:
    """:func:`_take` of a bucket from ``parent``. From a trainer (``watch``: its progress) each
    read is bounded by its patience: one that cannot act then (stopped: a read may need it, a
    descriptor to hand out) stalled, one that runs is read again; a trainer that died or
    stalled while it was read is lost (the pieces read in part are not counted as arrived: the
    failover reads them again)."""
    start = time.monotonic()
    while True:
        try:
            patience_s = watch.patience_s() if watch is not None else None
            return _take(channel, spec, bucket, views, dtypes, timeout_s=patience_s)
        except TensorwireError as e:
            if parent >= spec.trainers:
                raise
            if not channel.alive(parent):
                report_death(spec, parent)
                raise TrainerLost(parent, f"member {parent} exited while its bucket was read: {e}") from e
            if watch is None or not isinstance(e, TransferTimeoutError):
                raise
            _raise_if_stalled(
                channel,
                spec,
                parent,
                watch=watch,
                waited_s=time.monotonic() - start,
                what=f"its bucket not read ({e}) within",
                error=e,
            )


def acknowledge(channel: Channel, spec: PushSpec, parent: int, key: str) -> Callable[[], None]:
    """Start acknowledging a bucket; the returned function waits for it (a relay's). A
    trainer's acknowledgement is not waited for: a trainer that stopped must not hold the
    receiver, and one that died or stalled shows in its next bucket's wait (or it had sent
    them all)."""
    wait = channel.post(parent, key, b"")
    return wait if parent >= spec.trainers else _no_wait


def _no_wait() -> None:
    return None
