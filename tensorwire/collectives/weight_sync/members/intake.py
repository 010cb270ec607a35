"""How a weight-sync receiver takes one bucket in (:mod:`.receiver` runs it per bucket):
waiting for the bucket's message from its parent (a trainer that sends none within ``stall_s``
stalled, one that died or stalled is ``TrainerLost``), copying it into the destination views
from the sender's staging slot, as an announced object read in place, or some pieces each way,
and acknowledging it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tensorwire.collectives.groups.channel import Channel
from tensorwire.collectives.weight_sync.protocol.messages import SLOT, BucketKind, parse_mixed
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.collectives.weight_sync.recovery.stalls import StallWatch, report_death, report_stall
from tensorwire.collectives.weight_sync.streams.staging import read_slot, ring_reader
from tensorwire.errors import PeerLostError, TensorwireError, TrainerLost, TransferTimeoutError

__all__ = ["acknowledge", "next_bucket", "take_from"]


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


def next_bucket(
    channel: Channel,
    spec: PushSpec,
    parent: int,
    key: str,
    aborted: Callable[[int], None] | None,
    *,
    watch: StallWatch | None = None,
) -> bytes:
    """The message of the next bucket from ``parent``; a trainer (``watch``: its progress) that
    makes none stalled (:mod:`..recovery.stalls`: the driver is told, to replace it)."""
    check = (lambda: aborted(parent)) if aborted is not None else None
    if parent >= spec.trainers or watch is None:
        return channel.recv(parent, key, check=check)
    start = time.monotonic()
    while True:
        try:
            message = channel.recv(parent, key, timeout_s=watch.patience_s(), check=check)
        except PeerLostError as e:
            report_death(spec, parent)
            raise TrainerLost(parent, str(e)) from e
        except TransferTimeoutError as e:
            _raise_if_stalled(channel, spec, parent, watch=watch, start=start, what=f"no {key} within", error=e)
            continue  # its process runs: slow, not stalled
        watch.arrived()
        return message


def _raise_if_stalled(
    channel: Channel, spec: PushSpec, parent: int, *, watch: StallWatch, start: float, what: str, error: Exception
) -> None:
    """After a wait on trainer ``parent`` ran out of patience: ``TrainerLost`` (the driver told)
    when it stalled (:meth:`StallWatch.stalled`: an explicit ``stall_s``, a process that cannot
    act, or one that sent nothing for too long); else return, to wait again."""
    waited = time.monotonic() - start
    responds = bool(watch.explicit_s) or channel.responds(parent)
    if not watch.stalled(waited, responds):
        return
    report_stall(spec, parent)
    within = f"{watch.explicit_s:g} s" if watch.explicit_s else f"{waited:.1f} s"
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
                channel, spec, parent, watch=watch, start=start, what=f"its bucket not read ({e}) within", error=e
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
