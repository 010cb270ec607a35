"""A consumer's READs of one object into one set of buffers, made once and posted again.

A fetch reads every tensor and the object's liveness tag in one trip (the tag after the data
when the producer gives the object no grace). The first fetch of an
(object, destination) pair builds its READs for that fetch only; from the second on, the pair
has a *plan*: NIXL's prepared descriptor lists of both sides and prepared READs (the data and
tag one, and the tag alone, for a trip longer than half the producer's grace), its own tag
word and the registrations its READs may use, so a repeated fetch only posts and polls. Plans are
kept per process (a bounded LRU), one fetch at a time each (a second fetch of the same pair
meanwhile builds its own READs); one holding memory that was freed, whose producer was
forgotten or whose READ failed is retired. A plan holds every registration its READs may
resolve to (:meth:`~.agent.NixlAgent.hold_overlapping`). Keeping plans is on unless
``TENSORWIRE_NIXL_PREPARED=0`` (:data:`PREPARED`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tensorwire.errors import TransportError

if TYPE_CHECKING:
    import threading

__all__ = ["KEPT", "PREPARED", "Plan", "Plans", "check_destinations", "rows_for"]

KEPT = 64  # plans a process keeps (the least recently used go first)
# Prepared READs, on unless TENSORWIRE_NIXL_PREPARED=0 (then every fetch makes its READs for
# itself: 7 us more at 4 KiB). They were off while a consumer crashed now and then inside UCX
# (`ucp_get_nbx`): a kept READ pointed at another registration overlapping its destination, which
# was deregistered under it; plans now hold every such registration.
PREPARED_ENV = "TENSORWIRE_NIXL_PREPARED"
PREPARED = os.environ.get(PREPARED_ENV, "1").strip() != "0"
_SEEN = 1024  # (object, destination) pairs remembered as fetched once: the second fetch makes a plan


class PlanOwner(Protocol):
    """What plans use of this process's NIXL agent (:class:`.agent.NixlAgent`, which owns them)."""

    nixl: Any
    lock: threading.RLock
    stats: dict[str, int]
    landing: Any  # the slab where packed objects land (its ``registration.overlapped``)

    def release(self, xfers: list) -> None: ...
    def release_lists(self, dlists: list) -> None: ...
    def unuse(self, regs: Sequence[Any]) -> None: ...
    def hold_overlapping(self, rows: Sequence[tuple[int, int, int]], vram: bool, held: Sequence[Any]) -> list: ...
    def keep_running(
        self, owner: str, reads: list, *, memory: list, regs: list, give_back: Callable[[], None], lists: list
    ) -> None: ...


@dataclass(eq=False)
class Plan:
    """The READs of one fetch: ``reads`` (one per pair of memory kinds; with a grace, the host
    one also reads the tag into ``word``), the tag-only READ, the registrations it holds (its
    destinations' and any other its READs may resolve to), and for a kept plan NIXL's prepared lists."""

    owner: str  # the producer's NIXL agent
    tag: int
    grace_s: float
    word: Any  # where the tag lands: a one-element int64 array
    give_back: Callable[[], None]  # frees where the tag (and a packed object) lands
    regs: list[Any]  # the agent's Registrations it holds: the destinations' and those overlapping them
    groups: list[tuple[tuple[bool, bool], tuple[list, list]]]  # ((local VRAM, remote VRAM), (local, remote rows))
    tag_rows: tuple[tuple, tuple]  # (the row where the tag lands, the object's liveness slot's row)
    kept: bool = False
    landing: int | None = None  # a packed object's slot in the agent's landing slab (copied out after)
    reads: list[Any] = field(default_factory=list)
    tag_read: Any = None
    dlists: list[Any] = field(default_factory=list)
    posted: list[Any] = field(default_factory=list)  # READs posted in this fetch and not seen done
    busy: bool = False

    def read_tag(self, agent: PlanOwner) -> Any:
        """The READ of the tag alone (made on first need for a one-shot plan)."""
        if self.tag_read is None:
            nixl, (local, remote) = agent.nixl, self.tag_rows
            self.tag_read = nixl.initialize_xfer(
                "READ", nixl.get_xfer_descs([local], "DRAM"), nixl.get_xfer_descs([remote], "DRAM"), self.owner
            )
        return self.tag_read


class Plans:
    """This process's kept plans (under the NIXL agent's lock)."""

    def __init__(self, agent: PlanOwner) -> None:
        self._agent = agent
        self._kept: OrderedDict[tuple, Plan] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()

    def take(self, key: tuple) -> Plan | None:
        """The kept plan for ``key``, marked busy, if there is one, not busy and still good."""
        with self._agent.lock:
            plan = self._kept.get(key)
            if plan is None or plan.busy:
                return None
            if any(r.weak.expired() for r in plan.regs):  # memory it may write was freed: the address may be reused
                self._drop(key)
                return None
            plan.busy = True
            self._kept.move_to_end(key)
            return plan

    def make(self, key: tuple, plan: Plan) -> Plan:
        """``plan``'s READs, for a fetch with no kept plan: made for this fetch, or prepared and
        the plan kept from the pair's second fetch on."""
        agent, kept = self._agent, False
        if PREPARED:
            with agent.lock:
                kept = key in self._seen
                if not kept:
                    self._seen[key] = None
                    while len(self._seen) > _SEEN:
                        self._seen.popitem(last=False)
        plan.busy = True
        try:
            with agent.lock:  # no registration these READs may resolve to is made or goes meanwhile
                held = _hold_overlapping(agent, plan)
                if any(r.stale or r.weak.expired() for r in held):  # kept, it would go at its next use
                    kept = False
                plan.kept = kept
                _build(agent, plan)
        except BaseException:
            plan.kept = False
            self.retire(plan)
            raise
        if kept:
            with agent.lock:
                self._seen.pop(key, None)
                if key in self._kept:  # made meanwhile by another thread: this one is used once
                    plan.kept = False
                else:
                    self._kept[key] = plan
                    agent.stats["plans_made"] += 1
                    while len(self._kept) > KEPT:
                        self._drop(next(iter(self._kept)))
        return plan

    def done(self, plan: Plan) -> None:
        """After a fetch that succeeded: a kept plan waits for the next one, another is released."""
        with self._agent.lock:  # (a plan dropped meanwhile is no longer kept: released here)
            if plan.kept:
                plan.busy = False
                return
        self.retire(plan)

    def failed(self, plan: Plan, running: list[Any] | None) -> None:
        """After a fetch that failed: the plan goes (its READs kept until they end, with the
        memory they write, ``running``, if they may still run)."""
        with self._agent.lock:
            for key, kept in list(self._kept.items()):
                if kept is plan:
                    del self._kept[key]
        self.retire(plan, running)

    def forget(self, owner: str) -> None:
        """The plans reading from agent ``owner`` go (it is gone, or forgotten)."""
        with self._agent.lock:
            for key in [k for k, p in self._kept.items() if p.owner == owner]:
                self._drop(key)

    def sweep(self) -> None:
        """Idle plans whose destination memory was freed go (so that memory's registration can)."""
        with self._agent.lock:
            for key in [k for k, p in self._kept.items() if any(r.weak.expired() for r in p.regs)]:
                self._drop(key)

    def count(self) -> int:
        return len(self._kept)

    def _drop(self, key: tuple) -> None:
        plan = self._kept.pop(key)
        if plan.busy:  # its fetch ends it (``done`` sees it is no longer kept)
            plan.kept = False
        else:
            self.retire(plan)

    def retire(self, plan: Plan, running: list[Any] | None = None) -> None:
        """Release the plan's READs, lists, registrations and flag; if its READs may still run,
        once they end, keeping ``running`` (the memory they write) meanwhile."""
        agent, reads = self._agent, [*plan.reads, *([plan.tag_read] if plan.tag_read is not None else [])]
        if running is not None:
            agent.keep_running(
                plan.owner, reads, memory=running, regs=plan.regs, give_back=plan.give_back, lists=plan.dlists
            )
            return
        agent.release(reads)
        agent.release_lists(plan.dlists)
        agent.unuse(plan.regs)
        plan.give_back()


def _hold_overlapping(agent: PlanOwner, plan: Plan) -> list[Any]:
    """Hold every other registration the plan's READs may resolve to (:mod:`.overlaps`); those.
    A packed plan lands in the agent's slab, which only registrations older than the slab
    (``overlapped``) can overlap."""
    if plan.landing is not None and not agent.landing.registration.overlapped:
        return []
    held = []
    for (local_vram, _), (local, _) in plan.groups:
        held += agent.hold_overlapping(local, local_vram, [*plan.regs, *held])
    plan.regs += held
    return held


def _build(agent: PlanOwner, plan: Plan) -> None:
    """Plan's READs: prepared (kept plans) or made for one fetch."""
    nixl = agent.nixl
    for (lv, rv), (local, remote) in plan.groups:
        lmem, rmem = "VRAM" if lv else "DRAM", "VRAM" if rv else "DRAM"
        if not plan.kept:
            ldescs, rdescs = nixl.get_xfer_descs(local, lmem), nixl.get_xfer_descs(remote, rmem)
            plan.reads.append(nixl.initialize_xfer("READ", ldescs, rdescs, plan.owner))
        else:
            plan.reads.append(_prepared(nixl, plan, (local, lmem), (remote, rmem)))
    if plan.kept:
        plan.tag_read = _prepared(nixl, plan, ([plan.tag_rows[0]], "DRAM"), ([plan.tag_rows[1]], "DRAM"))


def _prepared(nixl: Any, plan: Plan, local: tuple[list, str], remote: tuple[list, str]) -> Any:
    """A prepared READ of ``remote`` (rows, memory kind) into ``local``; its lists kept in the plan."""
    ldl = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", *local)
    plan.dlists.append(ldl)
    rdl = nixl.prep_xfer_dlist(plan.owner, *remote)
    plan.dlists.append(rdl)
    every = list(range(len(local[0])))
    return nixl.make_prepped_xfer("READ", ldl, every, rdl, every)


def check_destinations(dst: Sequence[Any], rows: Sequence[tuple]) -> None:
    """Raises ``TransportError`` unless every buffer of ``dst`` is contiguous and as long as its row."""
    for t, row in zip(dst, rows, strict=True):
        if t.numel() * t.element_size() != row[1] or (row[1] and not t.is_contiguous()):
            raise TransportError("nixl: a destination buffer does not match the handle")


def rows_for(dst: Sequence[Any], rows: Sequence[tuple]) -> list[tuple[tuple[bool, bool], tuple[list, list]]]:
    """The READ rows of ``dst`` against the handle's ``rows``, by memory kinds (the host group
    always, and last: the tag may join it)."""
    check_destinations(dst, rows)
    groups: dict[tuple[bool, bool], tuple[list, list]] = {}
    for t, row in zip(dst, rows, strict=True):
        if not row[1]:
            continue
        vram = t.device.type == "cuda"
        local, remote = groups.setdefault((vram, bool(row[3])), ([], []))
        local.append((t.data_ptr(), row[1], (t.device.index or 0) if vram else 0))
        remote.append(row[:3])
    host = groups.pop((False, False), ([], []))
    return [*groups.items(), ((False, False), host)]
