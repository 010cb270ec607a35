"""Observing state that settles asynchronously (holder messages, reapers) without sleeping blindly."""

from __future__ import annotations

import os
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
    """This user's tensorwire shared-memory segments."""
    from tensorwire.transport.shm import SHM_DIR, segment_prefix

    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(segment_prefix())}
    except OSError:
        return set()


def segment_count() -> int:
    return len(segment_names())
