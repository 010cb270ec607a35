"""Observing state that settles asynchronously (holder messages, reapers) without sleeping blindly."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def segment_names() -> set[str]:
    """Tensorwire shared-memory segments of this process and its live descendants (other runs
    on the machine share the uid; see ``tests.helpers.leaks.segment_entries``)."""
    from tests.helpers.leaks import segment_entries

    return segment_entries()


def segment_count() -> int:
    return len(segment_names())
