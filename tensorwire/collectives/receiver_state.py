"""What a weight-sync receiver keeps between pushes, and how it commits a version.

Per process: the version of each named sync it holds completely (:func:`weight_version`), the
fence an atomic sync publishes under (:func:`weight_fence`), and the *shadows*: where a push
assembles a version aside (``atomic``, or an all-or-none commit) and the wire-dtype staging of
float8 parameters, kept across pushes. :func:`commit` makes a version visible: one local copy
of every shadow inside the fence, then the version and the receiver's ``on_commit`` hook. An
all-or-none push without shadows (``in_place``) writes into the tensors themselves while the
fence is held from the receiver's vote until it publishes (:func:`hold_fence`, :func:`let_go`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tensorwire.collectives.fence_hold import FenceHold
from tensorwire.collectives.sync_spec import PushSpec

__all__ = [
    "TORN",
    "Received",
    "aside_nbytes",
    "check_commit",
    "commit",
    "committed_already",
    "destinations",
    "hold_fence",
    "let_go",
    "mark_voted",
    "note_received",
    "pause",
    "promised",
    "quantise",
    "received",
    "release",
    "start_receiving",
    "weight_fence",
    "weight_version",
]

Received = tuple[str, str, tuple[int, ...], tuple[int, ...]]  # (parameter, wire dtype, box offsets, box sizes)

_versions: dict[str, int] = {}
_fences: dict[str, threading.Lock] = {}
_lock = threading.Lock()
_shadows: dict[tuple[str, int], torch.Tensor] = {}  # (sync id, param) -> shadow, or (sync id, -1 - param) fp8 staging
_last_commit: dict[str, tuple[str, int]] = {}  # sync name -> (sync id, version) of its last commit here
_arrived: dict[str, tuple[int, set[Received]]] = {}  # sync id -> (version, the pieces of it that arrived)
_holds: dict[str, _Held] = {}  # sync id -> the fence held while a version is written in place
TORN = -1  # weight_version() of a receiver whose tensors hold no whole version (an in-place push failed)


def weight_version(name: str = "weights") -> int:
    """Inside a receiver: the version of weight sync ``name`` it holds completely (0: none;
    :data:`TORN`, -1: none whole, after an in-place push failed half-way: the next push mends it)."""
    with _lock:
        return _versions.get(name, 0)


def weight_fence(name: str = "weights") -> threading.Lock:
    """Inside a receiver: the lock an atomic sync ``name`` publishes a version under (when
    it was given no ``fence``). Readers that hold it see one whole version."""
    with _lock:
        return _fences.setdefault(name, threading.Lock())


def release(sync_id: str) -> None:
    """Drop the shadows of sync ``sync_id`` in this process (and a fence still held for it)."""
    let_go(sync_id)
    for key in [key for key in _shadows if key[0] == sync_id]:
        del _shadows[key]
    with _lock:
        _arrived.pop(sync_id, None)


def aside_nbytes(sync_id: str) -> int:
    """Bytes this receiver keeps aside for sync ``sync_id``: shadows and float8 staging."""
    return sum(t.numel() * t.element_size() for key, t in list(_shadows.items()) if key[0] == sync_id)


@dataclass(eq=False)
class _Held:
    """The fence held for an in-place version of one sync."""

    version: int
    name: str
    hold: FenceHold
    voted: bool = False  # the driver said commit: from then on the tensors hold part of the version


def hold_fence(actor: object, spec: PushSpec, *, voted: bool = False) -> None:
    """In place: hold the receiver's fence from now (before its vote, or ``voted`` already, in
    a failover's next try) until it publishes ``spec.version`` or lets go (at most the push's
    deadline).

    Raises:
        TensorwireError: Readers kept the fence for ``timeout_s``, or entering it failed.
    """
    what = f"weight sync {spec.name} v{spec.version}"
    held = _Held(spec.version, spec.name, FenceHold(lambda: _fence(actor, spec), what, lambda: _expired(spec)), voted)
    held.hold.take(timeout_s=spec.timeout_s, limit_s=spec.deadline_s)
    with _lock:
        _holds[spec.sync_id] = held


def mark_voted(spec: PushSpec) -> None:
    """The driver said commit: a let-go without publishing now leaves the receiver :data:`TORN`."""
    with _lock:
        held = _holds.get(spec.sync_id)
        if held is not None and held.version == spec.version:
            held.voted = True


def promised(spec: PushSpec) -> bool:
    """Whether this receiver voted to write ``spec.version`` in place and still holds its fence
    for it (a failover's next try then goes on writing; the hold's limit is the push's again)."""
    with _lock:
        held = _holds.get(spec.sync_id)
    if held is None or held.version != spec.version or not held.voted or not held.hold.held:
        return False
    held.hold.extend(spec.deadline_s)
    return True


def pause(spec: PushSpec) -> None:
    """A try ended with a trainer lost: keep the fence for the next try, at most ``timeout_s``."""
    with _lock:
        held = _holds.get(spec.sync_id)
    if held is not None:
        held.hold.extend(spec.timeout_s)


def let_go(sync_id: str) -> None:
    """Leave the fence held for sync ``sync_id`` (if any); after a vote to commit, a version not
    published leaves the receiver :data:`TORN` (some of its bytes may be in the tensors)."""
    with _lock:
        held = _holds.pop(sync_id, None)
        if held is None:
            return
        torn = _voted_unpublished(sync_id, held)
    if torn:
        _tear(held.name)
    held.hold.let_go()


def _expired(spec: PushSpec) -> None:
    """A hold outlived its limit (inside the fence still): torn, unless the version was published."""
    with _lock:
        torn = _voted_unpublished(spec.sync_id, _holds.get(spec.sync_id))
    if torn:
        _tear(spec.name)


def _voted_unpublished(sync_id: str, held: _Held | None) -> bool:
    """Whether ``held``'s version was voted (so part of it may be in the tensors) and not
    published (under ``_lock``)."""
    return held is not None and held.voted and _last_commit.get(held.name) != (sync_id, held.version)


def _tear(name: str) -> None:
    with _lock:
        _versions[name] = TORN
        _last_commit.pop(name, None)


def start_receiving(spec: PushSpec) -> None:
    """A push of ``spec.version`` starts here: forget the pieces of any other version."""
    with _lock:
        kept = _arrived.get(spec.sync_id)
        if kept is None or kept[0] != spec.version:
            _arrived[spec.sync_id] = (spec.version, set())


def note_received(spec: PushSpec, pieces: list[Received]) -> None:
    """These pieces of ``spec.version`` are in place (in the shadows, the staging or the
    tensors themselves, wherever :func:`destinations` put them)."""
    with _lock:
        kept = _arrived.get(spec.sync_id)
        if kept is not None and kept[0] == spec.version:
            kept[1].update(pieces)


def received(sync_id: str, version: int) -> list[Received]:
    """The pieces of ``version`` of sync ``sync_id`` that arrived here (empty for another version)."""
    with _lock:
        kept = _arrived.get(sync_id)
        return sorted(kept[1]) if kept is not None and kept[0] == version else []


def _kept(key: tuple[str, int], shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    kept = _shadows.get(key)
    if kept is None or kept.shape != shape or kept.dtype != dtype or kept.device != device:
        kept = _shadows[key] = torch.empty(shape, dtype=dtype, device=device)
    return kept


def destinations(spec: PushSpec, targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Where each parameter's pieces land: the target itself, its shadow (assembled aside),
    or (float8) a staging tensor of the wire dtype. Kept between pushes."""
    wire = {r.param: r.wire_dtype for role in spec.roles for bucket in role.buckets for r in bucket}
    fp8 = {p for p, _scale in spec.scales}
    result = []
    for i, target in enumerate(targets):
        staged = _shadows.get((spec.sync_id, -1 - i))  # (a failover's next try may read none of it: kept)
        if i in fp8 and i in wire:
            result.append(_kept((spec.sync_id, -1 - i), target.shape, getattr(torch, wire[i]), target.device))
        elif i in fp8 and staged is not None:
            result.append(staged)
        elif spec.atomic:
            result.append(_kept((spec.sync_id, i), target.shape, target.dtype, target.device))
        else:
            result.append(target)
    return result


def _shadow(spec: PushSpec, targets: list[torch.Tensor], i: int) -> torch.Tensor:
    if not spec.atomic:
        return targets[i]
    return _kept((spec.sync_id, i), targets[i].shape, targets[i].dtype, targets[i].device)


def quantise(spec: PushSpec, targets: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    """Float8 parameters: scale = amax of the piece / the dtype's max; write both (only those
    assembled in a staging tensor of the wire dtype)."""
    for param, scale_param in spec.scales:
        if dsts[param] is not _shadows.get((spec.sync_id, -1 - param)):
            continue
        out = _shadow(spec, targets, param)
        high = dsts[param].float()
        top = torch.finfo(out.dtype).max
        scale = (high.abs().max() / top).clamp(min=1e-12)
        out.copy_((high / scale).clamp(-top, top).to(out.dtype))
        _shadow(spec, targets, scale_param).fill_(scale.item())


@contextlib.contextmanager
def _fence(actor: object, spec: PushSpec) -> Iterator[None]:
    if spec.fence is None:
        with weight_fence(spec.name):
            yield
        return
    fence = getattr(actor, spec.fence, None)
    if fence is None:
        raise AttributeError(f"the receiver ({type(actor).__name__}) has no fence attribute {spec.fence!r}")
    with fence() if callable(fence) and not hasattr(fence, "__enter__") else fence:
        yield


def check_commit(actor: object, spec: PushSpec) -> None:
    """Raise now what :func:`commit` would: a fence attribute or ``on_commit`` method the
    receiver does not have (before an all-or-none vote, so that the push aborts for all)."""
    if (spec.atomic or spec.in_place) and spec.fence is not None and getattr(actor, spec.fence, None) is None:
        raise AttributeError(f"the receiver ({type(actor).__name__}) has no fence attribute {spec.fence!r}")
    if isinstance(spec.on_commit, str) and not callable(getattr(actor, spec.on_commit, None)):
        raise AttributeError(f"the receiver ({type(actor).__name__}) has no on_commit method {spec.on_commit!r}")


def commit(actor: object, spec: PushSpec, targets: list[torch.Tensor]) -> None:
    """Make version ``spec.version`` the receiver's: assembled aside, one local copy inside its
    fence (readers holding the fence see whole versions); then its ``on_commit`` hook, once
    per version (a push of a version it committed already, a failover's second try, changes
    nothing: it read nothing new)."""
    if committed_already(spec):
        return
    if spec.atomic:
        with _fence(actor, spec):
            for i, target in enumerate(targets):
                target.copy_(_shadow(spec, targets, i))
            _publish(spec)
    else:
        _publish(spec)  # in place: inside the fence held since the vote
        let_go(spec.sync_id)
    if spec.on_commit is None:
        return
    hook = getattr(actor, spec.on_commit) if isinstance(spec.on_commit, str) else spec.on_commit
    if isinstance(spec.on_commit, str):
        hook(spec.version)
    else:
        hook(actor, spec.version)


def committed_already(spec: PushSpec) -> bool:
    """Whether this receiver committed ``spec.version`` of this sync already (a failover's next
    try then changes nothing)."""
    with _lock:
        return _last_commit.get(spec.name) == (spec.sync_id, spec.version)


def _publish(spec: PushSpec) -> None:
    with _lock:
        _versions[spec.name] = spec.version
        _last_commit[spec.name] = (spec.sync_id, spec.version)
