"""The one wait helper (``transport/waiting.py``): a result, the deadline, the check, the pace."""

from __future__ import annotations

import threading
import time

import pytest

from tensorwire.errors import PeerLostError, TransferTimeoutError
from tensorwire.transport.waiting import backoff, wait_until


def test_returns_what_the_step_found_once_it_found_it():
    polls = []

    def step(slice_s: float) -> str | None:
        polls.append(slice_s)
        return "done" if len(polls) == 3 else None

    assert wait_until(step, deadline=time.monotonic() + 5, what="x", pause=backoff(0.001, 0.001)) == "done"
    assert len(polls) == 3 and all(0 < s <= 0.25 for s in polls)


def test_the_deadline_raises_naming_the_wait_or_the_callers_error():
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="reading bucket 3: not complete before the deadline"):
        wait_until(lambda s: None, deadline=start + 0.1, what="reading bucket 3", pause=backoff(0.01, 0.01))
    assert 0.1 <= time.monotonic() - start < 2.0
    with pytest.raises(ValueError, match="still held"):
        wait_until(lambda s: None, deadline=time.monotonic(), what="x", on_timeout=lambda: ValueError("still held"))


def test_the_check_stops_a_wait_for_a_peer_that_is_gone():
    calls = []

    def check() -> None:
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise PeerLostError("member 1 exited")

    event = threading.Event()  # never set: a blocking step that only times out
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="member 1 exited"):
        wait_until(lambda s: event.wait(s) or None, deadline=start + 30, what="x", check=check, check_every_s=0.05)
    assert len(calls) == 2 and time.monotonic() - start < 5  # well before the deadline


def test_a_blocking_step_gets_slices_no_longer_than_the_check_interval_and_the_time_left():
    slices = []
    event = threading.Event()
    threading.Timer(0.3, event.set).start()

    def step(slice_s: float) -> bool | None:
        slices.append(slice_s)
        return event.wait(slice_s) or None

    assert wait_until(step, deadline=time.monotonic() + 10, what="x", check_every_s=0.1) is True
    assert len(slices) >= 3 and max(slices) <= 0.1
    slices.clear()
    event = threading.Event()  # never set now: the step only times out
    with pytest.raises(TransferTimeoutError):
        wait_until(step, deadline=time.monotonic() + 0.05, what="x", check_every_s=1.0)
    assert slices and max(slices) <= 0.05


def test_pause_decides_between_polls_and_none_polls_at_once():
    seen = []

    def pause(polls: int, elapsed_s: float) -> float | None:
        seen.append(polls)
        return None if polls < 5 else 0.0

    count = []
    assert (
        wait_until(
            lambda s: (count.append(1) or None) if len(count) < 8 else 1,
            deadline=time.monotonic() + 5,
            what="x",
            pause=pause,
        )
        == 1
    )
    assert seen == list(range(8))
    assert backoff(0.001, 0.004)(0, 0.0) == 0.001 and backoff(0.001, 0.004)(5, 0.0) == 0.004
