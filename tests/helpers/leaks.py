"""What the leak guard (``tests/conftest.py``) counts as leaked, in one place.

A test leaks when, after it ends (its own fixtures torn down, nothing else cleaned up), this
process's agent still owns objects it did not own before, a tensorwire shared-memory segment
appeared that nobody will remove, or this process holds a new file descriptor of such a segment.
Segments count when this process or a process started during the test owns them: processes
that outlive a test on purpose (module fixtures: Ray actors, workers) may hold references
across tests.

Only :func:`segment_entries` and :func:`segment_fds` know how segments look (anonymous
``memfd`` segments named ``tensorwire``, found through ``/proc/<pid>/fd`` and ``maps``); a
segment named in ``/dev/shm`` is always a leak.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass

from tests.helpers import observe
from tests.helpers.observe import memfd_segments, segment_names, wait_until


def segment_entries() -> dict[int, frozenset[int]]:
    """Tensorwire's anonymous segments that this process or a live descendant holds open or
    mapped: inode -> the pids that hold it. (Segments are ``memfd``: the kernel frees one with
    its last holder, so a killed producer's segments are gone with it and need no exclusion.)"""
    holders: dict[int, set[int]] = {}
    for pid in {os.getpid(), *descendants()}:
        for inode in memfd_segments({pid}):
            holders.setdefault(inode, set()).add(pid)
    return {inode: frozenset(pids) for inode, pids in holders.items()}


def _owner(pids: frozenset[int]) -> str:
    """Who holds a segment: this process, or the pids and command lines of others."""
    names = []
    for pid in sorted(pids):
        if pid == os.getpid():
            names.append("this process")
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "?"
        names.append(f"pid {pid} ({command[:80]})")
    return ", ".join(names)


def segment_fds() -> dict[int, str]:
    """This process's open file descriptors that point at a tensorwire segment."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith("/memfd:tensorwire"):
            found[int(fd)] = target
    return found


def descendants() -> frozenset[int]:
    """Live descendants of this process."""
    return frozenset(observe.descendants(os.getpid()) - {os.getpid()})


def owned_objects() -> int:
    """Objects this process's agent owns (0 when no agent runs; never starts one)."""
    from tensorwire.transport.agent.core import current_agent

    instance = current_agent()
    return instance.owned_objects() if instance is not None else 0


@dataclass(frozen=True)
class Snapshot:
    owned: int
    segments: frozenset[int]  # inodes held before the test
    fds: frozenset[int]
    processes: frozenset[int]  # descendants alive before the test


def snapshot() -> Snapshot:
    return Snapshot(owned_objects(), frozenset(segment_entries()), frozenset(segment_fds()), descendants())


def _new_segments(before: Snapshot) -> dict[int, frozenset[int]]:
    """Segments that appeared during the test and are held by this process or by a process
    started during it (processes that outlive a test on purpose may keep references)."""
    me = os.getpid()
    return {
        inode: pids
        for inode, pids in segment_entries().items()
        if inode not in before.segments and any(p == me or p not in before.processes for p in pids)
    }


def _collecting(check: Callable[[], bool]) -> Callable[[], bool]:
    """``check``, garbage-collecting before each retry: a cycle (e.g. through a caught
    exception's traceback) may hold references to objects of this or another process, and it
    may become garbage only after a first collection ran (a pool thread that raised drops its
    work item a moment after the caller saw the error)."""

    def collected_then_check() -> bool:
        if check():
            return True
        gc.collect()
        return check()

    return collected_then_check


def leaks_since(before: Snapshot, *, settle_s: float = 10.0) -> list[str]:
    """What leaked since ``before``, as readable lines (empty: nothing). Releases by holders in
    other processes arrive asynchronously, so each count gets ``settle_s`` to come back; what a
    garbage collection frees (references in a cycle, e.g. through a caught exception's
    traceback) is not a leak."""
    problems = []
    if not wait_until(_collecting(lambda: owned_objects() <= before.owned), settle_s):
        problems.append(f"this process's agent owns {owned_objects()} object(s), {before.owned} before the test")
    if not wait_until(_collecting(lambda: not _new_segments(before)), settle_s):
        left = _new_segments(before)
        owners = "; ".join(f"inode {inode}: {_owner(pids)}" for inode, pids in sorted(left.items()))
        problems.append(f"shared-memory segments left behind: {owners}")
    named = segment_names()
    if named:
        problems.append(f"segments named in /dev/shm (they must be anonymous): {sorted(named)}")
    fds = segment_fds()
    new_fds = {fd: target for fd, target in fds.items() if fd not in before.fds}
    if new_fds:
        problems.append(f"file descriptors of segments still open: {new_fds}")
    return problems
