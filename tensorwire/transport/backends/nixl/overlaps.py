"""Which registrations of local memory a READ may resolve to.

NIXL resolves each local descriptor of a READ to *a* registration that covers it, by address,
when the READ (or its prepared list) is made; posting it again never resolves anew. A process's
registrations can overlap: a freed tensor's registration is still there when new memory is
allocated in its place, two storages view one buffer. So the READ may hold NIXL's metadata of
any registration overlapping its rows, and that registration must outlive the READ (one
deregistered under a kept READ crashed the consumer in ``ucp_get_nbx``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["overlapping"]


def overlapping(registrations: Iterable[Any], rows: Sequence[tuple[int, int, int]], vram: bool) -> list[Any]:
    """The registrations of ``vram`` memory (``key`` = (address, bytes, VRAM, device)) that
    overlap one of ``rows`` ((address, bytes, device))."""
    if not rows:
        return []
    low, high = min(r[0] for r in rows), max(r[0] + r[1] for r in rows)
    near = [r for r in registrations if r.key[2] is vram and r.key[0] < high and low < r.key[0] + r.key[1]]
    if not near:
        return []
    spans = sorted((r[0], r[0] + r[1]) for r in rows)
    starts = [start for start, _ in spans]
    reach = list(itertools.accumulate((end for _, end in spans), max))  # the furthest end of rows so far
    found = []
    for reg in near:
        start, end = reg.key[0], reg.key[0] + reg.key[1]
        before = bisect.bisect_left(starts, end)  # rows that start before it ends: does one reach into it?
        if before and reach[before - 1] > start:
            found.append(reg)
    return found
