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
    """Anything of tensorwire's named in ``/dev/shm`` by this process or its descendants
    (segments are anonymous now: always empty unless something regressed). Names used to be
    ``tw-<uid>-<pid>-...``; other users of the machine (another checkout's tests) are ignored."""
    prefix = f"tw-{os.getuid()}-"
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except OSError:
        return set()
    ours = descendants(os.getpid()) if names else set()
    return {n for n in names if n[len(prefix) :].split("-")[0] in {str(p) for p in ours}}


def descendants(root: int) -> set[int]:
    """``root`` and its live descendants, from one pass over ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(entry))
    found, frontier = {root}, [root]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def memfd_sizes(pids: set[int] | None = None) -> dict[int, int]:
    """Tensorwire's anonymous segments that ``pids`` (default: this process and all its
    descendants: spawned workers, a local Ray's workers) hold open or mapped: inode -> bytes
    (the file size where a descriptor is open, else the mapped length)."""
    sizes: dict[int, int] = {}
    for pid in pids if pids is not None else descendants(os.getpid()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:tensorwire"):
                        info = os.stat(f"/proc/{pid}/fd/{fd}")
                        sizes[info.st_ino] = info.st_size
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps", "rb") as f:
                maps = f.read()
            if b"/memfd:tensorwire" not in maps:  # most processes: no line to parse
                continue
            for line in maps.splitlines():
                if b"/memfd:tensorwire" in line:
                    fields = line.split()
                    low, high = (int(x, 16) for x in fields[0].split(b"-"))
                    sizes.setdefault(int(fields[4]), high - low)
        except OSError:
            continue
    return sizes


def memfd_segments(pids: set[int] | None = None) -> set[int]:
    """Inodes of the segments :func:`memfd_sizes` finds."""
    return set(memfd_sizes(pids))


def segment_count() -> int:
    """How many of tensorwire's shared-memory segments this process tree keeps alive."""
    return len(memfd_segments())
