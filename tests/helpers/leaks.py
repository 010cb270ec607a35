"""What the leak guard (``tests/conftest.py``) counts as leaked, in one place.

A test leaks when, after it ends (its own fixtures torn down, nothing else cleaned up), this
process's agent still owns objects it did not own before, a tensorwire shared-memory segment
appeared that nobody will remove, or this process holds a new file descriptor of such a segment.
Segments count when this process or a process started during the test owns them: processes
that outlive a test on purpose (module fixtures: Ray actors, workers) may hold references
across tests.

Only :func:`segment_entries` and :func:`segment_fds` know how segments look; when the shm
transport changes how it names or passes segments (memfd handed over a Unix socket), adapt those
two functions.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

from tests.helpers.observe import wait_until


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0  # gone


def _ours(pid: int) -> bool:
    """Whether ``pid`` is this process or one of its descendants, alive (other users of the
    machine, e.g. other test runs under the same uid, have segments too)."""
    me, seen = os.getpid(), 0
    while pid > 1 and seen < 64:
        if pid == me:
            return True
        pid, seen = _parent(pid), seen + 1
    return False


def segment_entries() -> set[str]:
    """Tensorwire segments of this process and its descendants that someone alive must still
    remove.

    Segments of an owner that no longer exists are left out: today a SIGKILLed producer (failure
    tests kill them on purpose; ``ray.shutdown()`` kills workers without exit handlers) leaves
    its named segments until the next agent on the machine removes them. With anonymous
    (memfd) segments the kernel frees them instead, and this exclusion should go.
    """
    from tensorwire.transport.shm import SHM_DIR, segment_prefix

    prefix = segment_prefix()
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return set()
    return {name for name in names if _ours(_owner_pid(name))}


def _owner(name: str) -> str:
    """Who owns segment ``name``: this process, or the pid and command line of another."""
    pid = str(_owner_pid(name))
    if pid == str(os.getpid()):
        return "this process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = "?"
    return f"pid {pid} ({command[:80]})"


def segment_fds() -> dict[int, str]:
    """This process's open file descriptors that point at a tensorwire segment."""
    from tensorwire.transport.shm import SHM_DIR, segment_prefix

    targets = (os.path.join(SHM_DIR, segment_prefix()), "/memfd:tw-")
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(targets):
            found[int(fd)] = target
    return found


def _owner_pid(name: str) -> int:
    from tensorwire.transport.shm import segment_prefix

    field = name[len(segment_prefix()) :].split("-", maxsplit=1)[0]
    return int(field) if field.isdigit() else 0


def descendants() -> frozenset[int]:
    """Live descendants of this process."""
    me = os.getpid()
    return frozenset(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me and _ours(int(p)))


def owned_objects() -> int:
    """Objects this process's agent owns (0 when no agent runs; never starts one)."""
    from tensorwire.transport import agent as agent_module

    instance = agent_module._agent
    return instance.owned_objects() if instance is not None else 0


@dataclass(frozen=True)
class Snapshot:
    owned: int
    segments: frozenset[str]
    fds: frozenset[int]
    processes: frozenset[int]  # descendants alive before the test


def snapshot() -> Snapshot:
    return Snapshot(owned_objects(), frozenset(segment_entries()), frozenset(segment_fds()), descendants())


def _new_segments(before: Snapshot) -> set[str]:
    return {n for n in segment_entries() - before.segments if _owner_pid(n) not in before.processes}


def leaks_since(before: Snapshot, *, settle_s: float = 10.0) -> list[str]:
    """What leaked since ``before``, as readable lines (empty: nothing). Releases by holders in
    other processes arrive asynchronously, so each count gets ``settle_s`` to come back; what a
    garbage collection frees (references in a cycle, e.g. through a caught exception's
    traceback) is not a leak."""
    problems = []
    gc.collect()  # a cycle here may hold references to objects of this or another process
    if not wait_until(lambda: owned_objects() <= before.owned, settle_s):
        problems.append(f"this process's agent owns {owned_objects()} object(s), {before.owned} before the test")
    if not wait_until(lambda: not _new_segments(before), settle_s):
        left = sorted(_new_segments(before))
        owners = sorted({_owner(name) for name in left})
        problems.append(f"shared-memory segments left behind: {left} (owned by {', '.join(owners)})")
    fds = segment_fds()
    new_fds = {fd: target for fd, target in fds.items() if fd not in before.fds}
    if new_fds:
        problems.append(f"file descriptors of segments still open: {new_fds}")
    return problems
