"""A receiver's side of a cover (:mod:`.cover`): what of the push in flight is being read from
the other trainers in its place, in this process.

A try whose trainer was lost goes on: the driver starts a *cover*, in which the trainers left
serve the lost trainer's share to the receivers, beside the try's own streams and into the same
shadows (:func:`..members.receiver.cover_read`). The cover read marks here that it began
(:func:`began`: waits on the lost trainer stop at once, :func:`check`) and how it ended
(:func:`ended`). The try's reading, once its other streams are in, waits for the cover of the
trainers it lost (:func:`wait`) and then votes as if nothing had happened; a cover that failed,
or an abort from the driver, ends that wait with the trainer's loss (the driver then fails over
between two tries, :mod:`.failover`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.errors import TrainerLost

__all__ = ["began", "check", "ended", "release", "wait"]

_POLL_S = 0.02  # how often a wait for a cover also looks for the driver's abort (its end wakes it at once)

_lock = threading.Condition()
# (sync id, the try's channel) -> lost trainer's channel rank in the try -> None while its cover
# reads, "" once it read everything, else why it failed (a try's ranks are its own: a failover's
# next try numbers the trainers left anew)
_covers: dict[tuple[str, str], dict[int, str | None]] = {}


def began(sync_id: str, channel: str, trainers: Iterable[int]) -> None:
    """A cover of ``trainers`` (their channel ranks in the try on ``channel``) began reading in
    this process."""
    with _lock:
        for key in [key for key in _covers if key[0] == sync_id and key[1] != channel]:
            del _covers[key]  # (an earlier try's: it ended before this one began)
        mine = _covers.setdefault((sync_id, channel), {})
        for rank in trainers:
            mine[rank] = None
        _lock.notify_all()


def ended(sync_id: str, channel: str, trainers: Iterable[int], failure: str = "") -> None:
    """The cover of ``trainers`` of the try on ``channel`` read everything (``failure``: why it did not)."""
    with _lock:
        mine = _covers.setdefault((sync_id, channel), {})
        for rank in trainers:
            mine[rank] = failure
        _lock.notify_all()


def check(spec: PushSpec, parent: int) -> None:
    """Raise ``TrainerLost`` when trainer ``parent`` (a channel rank of the try ``spec`` is of)
    is being covered: the try stops waiting for its buckets."""
    with _lock:
        covering = parent in _covers.get((spec.sync_id, spec.channel), {})
    if covering:
        raise TrainerLost(parent, f"trainer member {parent} was lost: the others read its share")


def wait(spec: PushSpec, lost: dict[int, TrainerLost], *, aborted: Callable[[], None], deadline: float) -> None:
    """The try's reading, after its other streams: wait until every trainer in ``lost`` (its
    channel rank -> how it was lost; -1: one a relay lost) is covered, within ``deadline``
    (monotonic). ``aborted()`` raises once the driver aborted the push.

    Raises:
        TrainerLost: A cover failed, none came in time, or the driver aborted (the first loss).
    """
    first = next(iter(lost.values()))
    key = (spec.sync_id, spec.channel)
    while True:
        with _lock:
            mine = _covers.get(key, {})
            failed = [why for rank, why in mine.items() if why]
            done = {rank for rank, why in mine.items() if why == ""}
            if not failed and _all_covered(lost, done):
                return
            if not failed:
                _lock.wait(timeout=_POLL_S)
        if failed:
            raise TrainerLost(first.rank, f"{first.why}; reading its share from the others failed: {failed[0]}")
        try:
            aborted()
        except Exception:  # (the driver's abort, in whatever words)  # noqa: BLE001
            raise first from None
        if time.monotonic() > deadline:
            raise TrainerLost(first.rank, f"{first.why}; no cover read its share in time")


def _all_covered(lost: dict[int, TrainerLost], done: set[int]) -> bool:
    """Every lost trainer covered (one a relay lost, -1, by whichever cover there is)."""
    return all(rank in done if rank >= 0 else bool(done) for rank in lost)


def release(sync_id: str) -> None:
    """Forget the covers of sync ``sync_id`` in this process."""
    with _lock:
        for key in [key for key in _covers if key[0] == sync_id]:
            del _covers[key]
