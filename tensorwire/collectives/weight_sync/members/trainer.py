"""A trainer's side of a push (hook the driver calls through Ray): serve every stream it is the
server of, bucket level by level (bucket k of each, then k+1), reporting progress to the driver
when it draws a bar."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from tensorwire.collectives.weight_sync.members import snapshot
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
from tensorwire.collectives.weight_sync.protocol.messages import progress_key
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec, Region, SendResult
from tensorwire.collectives.weight_sync.streams.fanout import Fanout, serving
from tensorwire.collectives.weight_sync.streams.staging import Piece, as_wire, checksum
from tensorwire.errors import TensorwireError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.ray.hooks import actor_hook
from tensorwire.transport.agent.wire import peer_from_bytes

__all__ = ["bucket_checksums", "send"]


@actor_hook
def send(actor: object, spec: PushSpec | bytes, version: int | None = None, channel: str | None = None) -> SendResult:
    """Hook, trainer: serve every stream it is the server of, bucket level by level."""
    start = time.perf_counter()
    spec = load_spec(spec, version, channel)
    members = channel_of(spec)
    fanouts = fanouts_of(members, spec, _progress_reporter(spec))
    try:
        with serving(list(fanouts.values()), f"trainer {spec.rank}"):  # a failure here tells the receivers at once
            checksum_s = _serve(actor, spec, fanouts)
        at_fault_point("trainer", max((len(r.buckets) for r in spec.roles), default=0))  # every bucket taken
    finally:
        members.close()
    return _result(spec, fanouts, checksum_s, time.perf_counter() - start)


def _progress_reporter(spec: PushSpec) -> Callable[[int, int], None]:
    """``report(stream, k)``: tell the driver (when it draws a progress bar) that every reader
    of ``stream`` acknowledged bucket ``k``."""
    driver = peer_from_bytes(spec.driver) if spec.driver else None

    def report(stream: int, k: int) -> None:
        if driver is not None:
            with contextlib.suppress(TensorwireError):  # progress is best effort
                runtime_agent().rendezvous_push(driver, spec.channel, progress_key(stream, k), b"", timeout_s=5.0)

    return report


@actor_hook
def bucket_checksums(actor: object, spec: PushSpec | bytes, version: int) -> dict[tuple[int, int], int]:
    """Hook, trainer: the checksum of every bucket it would serve in this push, by (stream,
    bucket level), of its bytes on the wire (``skip_unchanged``: one pass over them)."""
    spec = load_spec(spec, version, None)
    tensors = _tensors(actor, spec)
    return {
        (role.stream, k): checksum([as_wire(p) for p in _pieces(tensors, spec, bucket)])
        for role in spec.roles
        for k, bucket in enumerate(role.buckets)
    }


def _tensors(actor: object, spec: PushSpec) -> list[torch.Tensor]:
    """What this push serves: the copy ``push_async`` took when it started, else the tensors."""
    tensors = snapshot.taken(spec)
    return member_tensors(actor, spec, "source") if tensors is None else tensors


def _serve(actor: object, spec: PushSpec, fanouts: dict[int, Fanout]) -> float:
    """Offer every bucket of every stream, level by level; returns the seconds spent on checksums."""
    checksum_s = 0.0
    tensors = _tensors(actor, spec)
    at_fault_point("trainer", -1)
    for k in range(max((len(r.buckets) for r in spec.roles), default=0)):
        for role in spec.roles:
            if k >= len(role.buckets):
                continue
            pieces = _pieces(tensors, spec, role.buckets[k])
            check_start = time.perf_counter()
            check = checksum([as_wire(p) for p in pieces]) if spec.verify else 0
            checksum_s += time.perf_counter() - check_start
            fanouts[role.stream].offer(k, pieces, check)
        at_fault_point("trainer", k)
    return checksum_s


def _pieces(tensors: list[torch.Tensor], spec: PushSpec, bucket: tuple[Region, ...]) -> list[Piece]:
    """A bucket's pieces as views of the trainer's tensors (after the user's ``transform``)."""
    prepared = memo(bucket, lambda b: bucket_views(b, spec.layout))
    if spec.transform is None:
        return [(view(tensors[param], where), dtype) for param, where, dtype in prepared]
    pieces = []
    for param, where, dtype in prepared:
        piece = view(tensors[param], where)
        name = spec.layout[param].name
        changed = spec.transform(name, piece)
        if tuple(changed.shape) != tuple(piece.shape):
            raise ValueError(f"transform changed the shape of {name!r}: {tuple(piece.shape)} -> {tuple(changed.shape)}")
        pieces.append((changed, dtype))
    return pieces


def _result(spec: PushSpec, fanouts: dict[int, Fanout], checksum_s: float, seconds: float) -> SendResult:
    failed: dict[int, str] = {}
    for fanout in fanouts.values():
        failed.update(fanout.failed)
    return SendResult(
        rank=spec.rank,
        pack_s=sum(f.pack_s for f in fanouts.values()),
        checksum_s=checksum_s,
        seconds=seconds,
        failed=failed,
        sent_nbytes=sum(f.sent_nbytes for f in fanouts.values()),
        in_place_nbytes=sum(f.in_place_nbytes for f in fanouts.values()),
        peak_nbytes=sum(f.peak_nbytes for f in fanouts.values()),
    )
