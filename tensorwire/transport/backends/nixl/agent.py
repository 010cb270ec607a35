"""This process's one NIXL agent (made on first use): its registrations of local memory, cached
per storage and dropped once their memory is freed; the liveness slots of exported objects and
the memory of freed ones, kept for a grace period; the remote agents and partial metadata it
loaded; READs kept until NIXL says they ended."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tensorwire.errors import TransportError, TransportUnavailableError
from tensorwire.transport.backends.nixl.engine import BACKENDS_ENV, new_agent
from tensorwire.transport.backends.nixl.overlaps import overlapping
from tensorwire.transport.backends.nixl.plans import Plans
from tensorwire.transport.backends.nixl.slab import Slab

if TYPE_CHECKING:
    from tensorwire.transport.backends.nixl.handles import Handle

__all__ = [
    "CACHE_ENV",
    "GRACE_S",
    "LINGER_NBYTES",
    "SLOTS",
    "KeptReads",
    "Lingering",
    "NixlAgent",
    "Registration",
    "agent_name",
    "existing_agent",
    "grace_us",
    "process_agent",
    "region",
    "stats",
]

logger = logging.getLogger(__name__)

CACHE_ENV = "TENSORWIRE_NIXL_CACHE"
SLOTS = 4096  # liveness slots per process (objects exported and live at once)
# A freed host object whose storages hold at most LINGER_NBYTES keeps its memory (its tensors,
# their registrations) this long after its tag is cleared, so a consumer's READ of data and tag
# together that saw the tag and ended within half of it read memory nothing had reused; a longer
# READ (and any READ of a larger or GPU object, whose memory goes at once) reads the tag again
# after the data.
GRACE_S = 0.02
LINGER_NBYTES = 4 << 20


def grace_us(storage_nbytes: int, host: bool) -> int:
    """The grace (microseconds) a freed object keeps its memory for (``storage_nbytes``: what its
    storages hold, all kept): 0 if it does not linger (GPU memory, or more than LINGER_NBYTES)."""
    return round(GRACE_S * 1e6) if host and storage_nbytes <= LINGER_NBYTES else 0


class Lingering(NamedTuple):
    """A freed object's memory kept for its grace."""

    until: float  # time.monotonic()
    memory: tuple  # the tensors kept alive meanwhile
    then: Callable[[], None]  # lets go of the rest (registrations, a slab slot)
    nbytes: int


class KeptReads(NamedTuple):
    """READs that did not end, kept with everything they touch until NIXL says they ended."""

    owner: str  # the producer's NIXL agent
    reads: list
    memory: list  # the buffers they write
    regs: list
    give_back: Callable[[], None]  # frees where their tag lands
    lists: list  # prepared descriptor lists they were made from


def region(tensor: Any) -> tuple[int, int, bool, int]:
    """(address, bytes, is VRAM, device) of the storage ``tensor`` lives in."""
    storage = tensor.untyped_storage()
    if tensor.is_cuda:
        return storage.data_ptr(), storage.nbytes(), True, tensor.get_device()
    return storage.data_ptr(), storage.nbytes(), False, 0


@dataclass
class Registration:
    rid: int
    key: tuple[int, int, bool, int]
    weak: Any  # torch StorageWeakRef: whether the registered memory still exists
    descs: Any  # nixlRegDList
    users: int = 0
    stale: bool = False  # its memory was freed while in use: unlisted, deregistered at its last unuse
    permanent: bool = False  # never deregistered (the tag tables, the slabs)
    overlapped: bool = False  # (permanent ones) other registrations covered some of its memory when made
    leaving: bool = False  # to be deregistered once no older registration of its key is left


class NixlAgent:
    """This process's one NIXL agent: registrations, liveness slots, loaded remote agents."""

    def __init__(self, name: str) -> None:
        import torch

        self.nixl = new_agent(name)
        if not self.nixl.backends:
            raise TransportUnavailableError(
                f"nixl: none of the backends in {BACKENDS_ENV} could be created; "
                f"plug-ins available: {self.nixl.get_plugin_list()}"
            )
        self.name, self.lock, self.stopped, self.ids = name, threading.RLock(), threading.Event(), itertools.count(1)
        self.wake = threading.Event()  # the sweep's: something lingers
        self.capacity = max(16, int(os.environ.get(CACHE_ENV, "512")))
        self.regs: OrderedDict[tuple[int, int, bool, int], Registration] = OrderedDict()
        self.registered: dict[int, Registration] = {}  # every registration NIXL holds, stale ones too (by rid)
        self.twins: dict[tuple, list[Registration]] = {}  # key -> its registrations in NIXL, oldest first
        self.idle: dict[tuple, Registration] = {}  # users dropped to 0: checked for freed memory by _sweep
        self.partials: OrderedDict[tuple[int, ...], list[bytes]] = OrderedDict()
        self.remote: dict[str, set[int]] = {}  # remote agent name -> registration ids loaded
        self.stuck: list[KeptReads] = []
        self.lingering: deque[Lingering] = deque()  # freed objects' memory, by the end of their grace
        self.stats = dict.fromkeys(
            (
                "registered",
                "deregistered",
                "hits",
                "metadata_loads",
                "partial_loads",
                "leaked_handles",
                "plans_made",  # consumer: (object, destination) pairs whose READs were prepared
                "plans_repeated",  # consumer: repeated fetches that posted a kept plan through the repeater
                "tags_after",  # consumer: fetches that read the tag again after the data
                "packed_exports",  # producer: small host objects copied into a slab slot with their tag
                "packed_fetches",  # consumer: such objects read in one descriptor into a landing slot
            ),
            0,
        )
        self.conn_md = self.nixl.get_agent_metadata()
        # producer: the tags of live objects; consumer: where tags are read into
        self.table, self.flags = (torch.zeros(SLOTS, dtype=torch.int64) for _ in range(2))
        self.table_reg, self.flags_reg = self.acquire([self.table, self.flags])
        self.table_reg.permanent = self.flags_reg.permanent = True
        self.table_np, self.flags_np = self.table.numpy(), self.flags.numpy()  # cheaper to index
        self.free_table, self.free_flags = list(range(SLOTS)), list(range(SLOTS))
        self.plans = Plans(self)  # consumer: READs made once per (object, destination), posted again
        self.objects = Slab(self._registered)  # producer: small host objects with their tags
        self.landing = Slab(self._registered)  # consumer: where they land
        (sweeper := threading.Thread(target=self._sweep, name="tw-nixl-sweep", daemon=True)).start()
        atexit.register(lambda: (self.stopped.set(), self.wake.set(), sweeper.join(timeout=2)))  # before NIXL goes

    def acquire(self, tensors: Sequence[Any]) -> list[Registration]:
        """The registrations covering ``tensors``, each used once more (missing ones: one call per kind)."""
        from tensorwire.transport.host_pool import liveness  # a pooled buffer's registration outlives one value

        with self.lock:
            found: dict[tuple, Registration | None] = {}
            missing: dict[tuple, Any] = {}
            for tensor in tensors:
                key = region(tensor)
                if key in found:
                    continue
                reg = self.regs.get(key)
                if reg is not None and reg.weak.expired():  # new memory at a freed one's address
                    self._retire(reg)
                    reg = None
                found[key] = reg
                if reg is None:
                    missing[key] = tensor
                else:
                    self.stats["hits"] += 1
                    self.regs.move_to_end(key)
            for vram in (False, True):
                if not (keys := [k for k in missing if k[2] is vram]):
                    continue
                mem = "VRAM" if vram else "DRAM"
                self.nixl.register_memory([(k[0], k[1], k[3], "") for k in keys], mem)
                for key in keys:  # one descriptor list per region, to deregister it alone
                    descs = self.nixl.get_reg_descs([(key[0], key[1], key[3], "")], mem)
                    weak = liveness(missing[key])
                    found[key] = self.regs[key] = reg = Registration(next(self.ids), key, weak, descs)
                    self.registered[reg.rid] = reg
                    self.twins.setdefault(key, []).append(reg)
                    self.stats["registered"] += 1
            regs = [r for r in found.values() if r is not None]
            for reg in regs:
                reg.users += 1
            self._trim()
            return regs

    def unuse(self, regs: Sequence[Registration]) -> None:
        with self.lock:
            for reg in regs:
                reg.users -= 1
                if reg.users == 0 and reg.stale:
                    self._deregister(reg)
            self.idle.update((r.key, r) for r in regs if r.users == 0 and not r.stale)

    def _retire(self, reg: Registration) -> None:
        """A registration whose memory was freed: deregistered now if unused, else unlisted (the
        memory at its address is registered anew) and deregistered at its last unuse."""
        if reg.users == 0:
            self._drop(reg)
            return
        self.regs.pop(reg.key, None)
        self.idle.pop(reg.key, None)
        reg.stale = True

    def hold_overlapping(
        self, rows: Sequence[tuple[int, int, int]], vram: bool, held: Sequence[Registration]
    ) -> list[Registration]:
        """Use once more every registration a READ of ``rows`` ((address, bytes, device) of
        ``vram`` memory) may resolve to, other than ``held`` and permanent ones; those (a plan's,
        given back with its own). One whose memory was freed and that nothing uses goes now
        instead (:mod:`.overlaps` says why).
        """
        with self.lock:
            mine = {r.rid for r in held}
            found = []
            for reg in overlapping(self.registered.values(), rows, vram):
                if reg.rid in mine or reg.permanent:
                    continue
                if not reg.users and self.regs.get(reg.key) is reg and reg.weak.expired():
                    self._drop(reg)
                    continue
                reg.users += 1
                found.append(reg)
            return found

    def _registered(self, buffer: Any) -> Registration:
        """``buffer`` registered for the process's life (a slab's block); ``overlapped`` if
        registrations of memory freed before it was allocated still cover some of it (READs
        into it then hold them, as any plan does)."""
        with self.lock:
            (reg,) = self.acquire([buffer])
            reg.permanent = True
            others = self.hold_overlapping([(reg.key[0], reg.key[1], reg.key[3])], reg.key[2], [reg])
            reg.overlapped = bool(others)
            self.unuse(others)
            return reg

    def linger(self, memory: Sequence[Any], then: Callable[[], None], grace_s: float, nbytes: int) -> None:
        """Producer: keep a freed object's ``memory`` (``nbytes``) for ``grace_s``, then call
        ``then`` (the sweep does)."""
        with self.lock:
            self.lingering.append(Lingering(time.monotonic() + grace_s, tuple(memory), then, nbytes))
        self.wake.set()

    def _sweep(self) -> None:
        """Thread ``tw-nixl-sweep``, every 0.2 s until exit (and when a lingering object's grace
        ends): let go of freed objects past their grace, settle kept READs, deregister idle freed memory."""
        while not self.stopped.is_set():
            first = self.lingering[0][0] if self.lingering else None
            self.wake.wait(0.2 if first is None else min(0.2, max(0.0, first - time.monotonic())))
            self.wake.clear()
            if self.stopped.is_set():
                return
            try:
                self._sweep_once()
            except Exception:  # a failure here must not end the thread: lingering memory would grow
                logger.exception("nixl: the sweep failed (it goes on)")

    def _sweep_once(self) -> None:
        with self.lock:
            now = time.monotonic()
            while self.lingering and self.lingering[0].until <= now:
                self.lingering.popleft().then()
            self.plans.sweep()
            self.settle()
            for key, reg in list(self.idle.items()):
                if reg.users or self.regs.get(key) is not reg:
                    del self.idle[key]
                elif reg.weak.expired():
                    self._drop(reg)  # unlisted there too

    def _trim(self) -> None:  # the least recently used unused registrations beyond the capacity go
        excess = len(self.regs) - self.capacity
        for reg in [r for r in self.regs.values() if r.users == 0][:excess] if excess > 0 else ():
            self._drop(reg)

    def _drop(self, reg: Registration) -> None:
        self.regs.pop(reg.key, None)
        self.idle.pop(reg.key, None)
        self._deregister(reg)

    def _deregister(self, reg: Registration) -> None:
        """Deregister ``reg`` (unused) now, or once every older registration of its key went:
        NIXL's deregistration removes the *oldest* one of an (address, bytes, device), so new
        memory registered at a stale registration's address waits for that one (still in use)."""
        reg.leaving = reg.stale = True  # (a registration waiting here comes back at its last unuse)
        twins = self.twins.get(reg.key, [reg])
        while twins and twins[0].leaving and not twins[0].users:
            self._deregister_now(twins.pop(0))
        if not twins:
            self.twins.pop(reg.key, None)

    def _deregister_now(self, reg: Registration) -> None:
        self.registered.pop(reg.rid, None)
        try:
            self.nixl.deregister_memory(reg.descs)
            self.stats["deregistered"] += 1
        except Exception as e:  # noqa: BLE001 - a failed deregistration leaks, never breaks a transfer
            logger.warning("nixl: deregistering %d bytes at %#x failed: %s", reg.key[1], reg.key[0], e)

    def partial_metadata(self, regs: Sequence[Registration]) -> list[bytes]:
        """NIXL's metadata of exactly ``regs`` (one blob per memory kind), cached."""
        key = tuple(sorted(r.rid for r in regs))
        with self.lock:
            cached = self.partials.get(key)
            if cached is not None:
                self.partials.move_to_end(key)
                return cached
            blobs = []
            for vram in (False, True):
                rows = [(r.key[0], r.key[1], r.key[3], "") for r in regs if r.key[2] is vram]
                if rows:
                    descs = self.nixl.get_reg_descs(rows, "VRAM" if vram else "DRAM")
                    blobs.append(self.nixl.get_partial_agent_metadata(descs, False))
            self.partials[key] = blobs
            while len(self.partials) > 64:
                self.partials.popitem(last=False)
            return blobs

    def load_connection(self, name: str, blob: bytes) -> None:
        """Consumer: the agent ``name``'s metadata, once (still known while READs from it run)."""
        with self.lock:
            if name not in self.remote:
                self._add_remote(name, blob)
                self.stats["metadata_loads"] += 1
                self.remote[name] = set()

    def load_remote(self, handle: Handle) -> None:
        """Consumer: the registrations a handle names that this process has not loaded yet."""
        with self.lock:
            if (known := self.remote.get(handle.name)) is None:
                raise TransportError(f"nixl: agent {handle.name}'s metadata is not loaded here (forgotten as gone?)")
            if not set(handle.rids) <= known:
                for blob in handle.partials:
                    self._add_remote(handle.name, blob)
                self.stats["partial_loads"] += 1
                known.update(handle.rids)

    def _add_remote(self, expected: str, blob: bytes) -> None:
        name = self.nixl.add_remote_agent(blob)
        if (name := name.decode() if isinstance(name, bytes) else name) != expected:
            raise TransportError(f"nixl: metadata said to be agent {expected}'s belongs to agent {name}")

    def forget_remote(self, name: str) -> None:
        with self.lock:  # kept READs from it still run (after a disconnect NIXL says ERR, yet they land)
            self.plans.forget(name)
            if not any(e.owner == name for e in self.stuck) and self.remote.pop(name, None) is not None:
                with contextlib.suppress(Exception):  # the peer is gone either way
                    self.nixl.remove_remote_agent(name)

    def keep_running(
        self, owner: str, reads: list, *, memory: list, regs: list, give_back: Callable[[], None], lists: list
    ) -> None:
        """READs from ``owner`` that did not end: kept, with all they touch, until NIXL says they
        ended (:meth:`settle`)."""
        logger.warning("nixl: %d READs from %s unfinished; their memory is kept", len(reads), owner)
        with self.lock:
            self.stuck.append(KeptReads(owner, reads, memory, regs, give_back, lists))

    def settle(self) -> None:
        """Release kept READs that ended: one past its deadline can still land (seen: SIGSEGV)."""
        with self.lock:
            for entry in [e for e in self.stuck if not any(self.running(x) for x in e.reads)]:
                self.stuck.remove(entry)
                self.release(entry.reads)
                self.release_lists(entry.lists)
                self.unuse(entry.regs)
                entry.give_back()

    def release(self, xfers: list) -> None:
        """Release ended transfers' handles (``xfers`` is emptied)."""
        while xfers:
            try:
                self.nixl.release_xfer_handle(xfers.pop())
            except Exception as e:  # noqa: BLE001 - it ended: only its handle's memory is lost
                self.stats["leaked_handles"] += 1
                logger.warning("nixl: a transfer handle could not be released (%s)", e)

    def release_lists(self, dlists: list) -> None:
        """Release prepared descriptor lists (after the READs made from them; ``dlists`` is emptied)."""
        while dlists:
            try:
                self.nixl.release_dlist_handle(dlists.pop())
            except Exception as e:  # noqa: BLE001 - only the list's memory is lost
                self.stats["leaked_handles"] += 1
                logger.warning("nixl: a prepared descriptor list could not be released (%s)", e)

    def running(self, xfer: Any) -> bool:
        try:
            return self.nixl.check_xfer_state(xfer) == "PROC"
        except Exception:  # noqa: BLE001 - it ended in an error (its owner disconnected, say)
            return False

    def take(self, free: list[int]) -> int | None:
        with self.lock:
            return free.pop() if free else None  # (a list's pop is atomic; the lock orders it with settle)


_lock = threading.Lock()
_process: dict[int, NixlAgent] = {}
_names: dict[int, str] = {}


def agent_name() -> str:
    return _names.setdefault(os.getpid(), f"tw-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def process_agent() -> NixlAgent:
    """This process's NIXL agent, made on first use."""
    with _lock:
        if (pid := os.getpid()) not in _process:
            try:
                _process[pid] = NixlAgent(agent_name())
            except Exception as e:
                raise TransportUnavailableError(f"nixl: no NIXL agent: {type(e).__name__}: {e}") from e
        return _process[pid]


def existing_agent() -> NixlAgent | None:
    """This process's NIXL agent if it was made, else None (never makes one)."""
    return _process.get(os.getpid())


def stats() -> dict[str, int]:
    """This process's registration cache and metadata counters (empty before first use)."""
    if (agent := _process.get(os.getpid())) is None:
        return {}
    with agent.lock:
        return {
            **agent.stats,
            "cached": len(agent.regs),
            "remote_agents": len(agent.remote),
            "idle": len(agent.idle),
            "live_slots": SLOTS - len(agent.free_table),
            "lingering": len(agent.lingering),
            "lingering_nbytes": sum(e.nbytes for e in agent.lingering),
            "plans": agent.plans.count(),
            "stuck_reads": len(agent.stuck),
        }
