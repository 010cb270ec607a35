"""How a weight-sync receiver commits a version, and the versions it holds.

Per process: the version of each named sync it holds completely (:func:`weight_version`), and
the fence a sync publishes under (:func:`weight_fence`, or the receiver's own ``fence=``).
:func:`commit` makes a version visible: with shadows (:mod:`.aside`), one local copy of every
shadow inside the fence; then the version and the receiver's ``on_commit`` hook. An
all-or-none push without shadows (``in_place``) writes into the tensors themselves while the
fence is held from the receiver's vote until it publishes (:func:`hold_fence`, :func:`let_go`;
the holding thread: :mod:`.fence`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tensorwire.collectives.weight_sync.commit import aside
from tensorwire.collectives.weight_sync.commit.fence import FenceHold
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec

__all__ = [
    "TORN",
    "check_commit",
    "commit",
    "committed_already",
    "hold_fence",
    "let_go",
    "mark_voted",
    "pause",
    "promised",
    "weight_fence",
    "weight_version",
]

_versions: dict[str, int] = {}
_fences: dict[str, threading.Lock] = {}
_lock = threading.Lock()
_last_commit: dict[str, tuple[str, int]] = {}  # sync name -> (sync id, version) of its last commit here
_holds: dict[str, _InPlaceHold] = {}  # sync id -> the fence held while a version is written in place
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


@dataclass(eq=False)
class _InPlaceHold:
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
    held = _InPlaceHold(
        spec.version, spec.name, FenceHold(lambda: _fence(actor, spec), what, lambda: _expired(spec)), voted
    )
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


def _voted_unpublished(sync_id: str, held: _InPlaceHold | None) -> bool:
    """Whether ``held``'s version was voted (so part of it may be in the tensors) and not
    published (under ``_lock``)."""
    return held is not None and held.voted and _last_commit.get(held.name) != (sync_id, held.version)


def _tear(name: str) -> None:
    with _lock:
        _versions[name] = TORN
        _last_commit.pop(name, None)


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
    if (spec.shadow or spec.in_place) and spec.fence is not None and getattr(actor, spec.fence, None) is None:
        raise AttributeError(f"the receiver ({type(actor).__name__}) has no fence attribute {spec.fence!r}")
    if isinstance(spec.on_commit, str) and not callable(getattr(actor, spec.on_commit, None)):
        raise AttributeError(f"the receiver ({type(actor).__name__}) has no on_commit method {spec.on_commit!r}")
    if spec.load is not None and not callable(getattr(actor, spec.load, None)):
        raise AttributeError(f"the receiver ({type(actor).__name__}) has no loader method {spec.load!r} (load=)")


def commit(actor: object, spec: PushSpec, targets: list[torch.Tensor]) -> None:
    """Make version ``spec.version`` the receiver's: assembled aside, one local copy inside its
    fence, or (``publish="swap"``) each tensor and its shadow trade memory there (readers
    holding the fence see whole versions); then its ``on_commit`` hook, once
    per version (a push of a version it committed already, a failover's second try, changes
    nothing: it read nothing new)."""
    if committed_already(spec):
        return
    if spec.shadow and spec.load is not None:
        _feed_loader(actor, spec, targets)
    elif spec.shadow:
        chosen = range(len(targets)) if spec.published is None else spec.published  # (a subset push: its own)
        with _fence(actor, spec):
            for i in chosen:
                target = targets[i]
                if spec.publish == "swap":
                    aside.swap_in(spec, targets, i)
                else:
                    target.copy_(aside.shadow_of(spec, targets, i))
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


def _feed_loader(actor: object, spec: PushSpec, targets: list[torch.Tensor]) -> None:
    """Publish a version assembled aside through the receiver's loader (``load=``), inside the
    fence: one call with ``(name, tensor)`` for each parameter (a subset push: its own), the
    tensors being the sync's buffers, valid during the call (the loader copies what it keeps)."""
    chosen = range(len(targets)) if spec.published is None else spec.published
    loader = getattr(actor, spec.load)
    with _fence(actor, spec):
        loader([(spec.layout[i].name, aside.shadow_of(spec, targets, i)) for i in chosen])
        _publish(spec)


def committed_already(spec: PushSpec) -> bool:
    """Whether this receiver committed ``spec.version`` of this sync already (a failover's next
    try then changes nothing)."""
    with _lock:
        return _last_commit.get(spec.name) == (spec.sync_id, spec.version)


def _publish(spec: PushSpec) -> None:
    with _lock:
        _versions[spec.name] = spec.version
        _last_commit[spec.name] = (spec.sync_id, spec.version)
