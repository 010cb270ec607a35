"""The one way tensorwire waits: until something is done, a deadline passes, or a check says
waiting is pointless (the peer's process exited, the object was freed).

Waits on a transfer, a message or a peer go through :func:`wait_until`: a two-sided transfer's
posted operations, gloo works, an NCCL group's first message, a message from a group member (the
channel looks every 50 ms), a producer waiting for consumers to let go of a tensor. (nixl polls its
READs in its own loop; the rendezvous mailbox waits on a condition; waits on Ray calls, ``tw.wait``
and the weight-sync driver's, are Ray's own ``ray.wait`` in slices.) Each bounds the wait by its
deadline and runs its ``check`` every :data:`STATE_CHECK_EVERY_S` unless told otherwise (the check
raises ``PeerLostError``, ``OwnerDiedError``, ...), so a peer that dies turns into an error within a
quarter second on one machine instead of a wait for the whole deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from tensorwire.errors import TransferTimeoutError

__all__ = ["STATE_CHECK_EVERY_S", "backoff", "wait_until"]

STATE_CHECK_EVERY_S = 0.25  # how often a wait runs its check (the peer's liveness, the object's state)

T = TypeVar("T")


def backoff(first_s: float, longest_s: float) -> Callable[[int, float], float]:
    """Pauses between polls of a step that returns at once: ``first_s``, doubling up to ``longest_s``."""

    def pause(polls: int, elapsed_s: float) -> float:
        return min(longest_s, first_s * 2 ** min(polls, 30))

    return pause


def wait_until(
    step: Callable[[float], T | None],
    *,
    deadline: float,
    what: str,
    check: Callable[[], None] | None = None,
    check_every_s: float = STATE_CHECK_EVERY_S,
    pause: Callable[[int, float], float | None] | None = None,
    on_timeout: Callable[[], Exception] | None = None,
) -> T:
    """Call ``step(slice_s)`` until it returns something other than None, and return that.

    Args:
        step: One look at what is awaited; it may block for up to ``slice_s`` seconds (a
            condition or event wait) or return at once (a poll). None means "not yet".
        deadline: ``time.monotonic()`` value after which waiting stops.
        what: Names the wait in the timeout error: "{what}: not complete before the deadline".
        check: Runs every ``check_every_s`` while waiting; raises to stop early (a peer that
            exited, an object freed meanwhile).
        check_every_s: How often ``check`` runs, and the longest slice a blocking step gets.
        pause: For a step that returns at once: the pause before the next poll, given the
            number of polls so far and the seconds waited (:func:`backoff`; None from it: poll
            again at once, without yielding); None for a step that blocks by itself.
        on_timeout: Makes the error raised at the deadline (default ``TransferTimeoutError``
            naming ``what``).

    Raises:
        TransferTimeoutError: The deadline passed (or ``on_timeout``'s error).
        Whatever ``step`` or ``check`` raise.
    """
    start = time.monotonic()
    next_check = start + check_every_s
    polls = 0
    while True:
        result = step(max(0.0, min(check_every_s, deadline - time.monotonic())))
        if result is not None:
            return result
        now = time.monotonic()
        if now >= deadline:
            raise (
                on_timeout()
                if on_timeout is not None
                else TransferTimeoutError(f"{what}: not complete before the deadline")
            )
        if check is not None and now >= next_check:
            check()
            next_check = time.monotonic() + check_every_s
        if pause is not None:
            seconds = pause(polls, now - start)
            polls += 1
            if seconds is not None:
                time.sleep(min(seconds, max(0.0, deadline - now)))
