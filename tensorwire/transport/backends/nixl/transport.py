"""``nixl``: one-sided READ through NVIDIA's NIXL engine (extra ``nixl``; found through the
``tensorwire.transports`` entry point). Backends: ``TENSORWIRE_NIXL_BACKENDS`` (default ``UCX``).
Host memory is verified here, CUDA memory is not.

The producer registers each storage once (cached, :mod:`.agent`) and hands out a signed handle
(:mod:`.handles`): partial metadata, a row per tensor, a liveness slot. Its agent's metadata is
its connection info (the contract's connection step: loaded once per peer). A consumer loads
partial metadata only when new, READs the tensors and the slot's tag in one trip (the producer
keeps freed memory for a grace period; a trip longer than half of it reads the tag again): no
control call, every wait bounded. docs/architecture.md ("nixl details") says why each step is as it is.
"""

from __future__ import annotations

import base64
import importlib.util
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tensorwire.errors import (
    OwnerDiedError,
    PermissionDeniedError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from tensorwire.transport.backends.nixl import doctor, plans
from tensorwire.transport.backends.nixl.agent import (
    SLOTS,
    NixlAgent,
    agent_name,
    existing_agent,
    grace_us,
    process_agent,
)
from tensorwire.transport.backends.nixl.engine import API_MODULES
from tensorwire.transport.backends.nixl.handles import ROW, Handle, opened
from tensorwire.transport.backends.nixl.plans import Plan, check_destinations, rows_for
from tensorwire.transport.backends.nixl.slab import fits, span
from tensorwire.transport.contract import Capabilities, Diagnosis, FetchRequest, PeerInfo, StoredObject, Transport
from tensorwire.transport.costs import CostEstimate, CostModel, MemoryKind, Placement

__all__ = ["NixlTransport"]

logger = logging.getLogger(__name__)

_ALIVE_EVERY_S = 0.2  # seconds between checks of the owner's pid while a READ runs
_STATUS_EVERY_S = 2.0  # ... and of its status, when it runs on another machine


class _Exported(NamedTuple):
    """Producer: an object read where it lies."""

    regs: list  # its storages' registrations
    slot: int  # its liveness slot in the agent's table
    grace_us: int
    storage_nbytes: int


class _Packed(NamedTuple):
    """Producer: a small host object copied with its tag into a slab slot."""

    slot: int
    grace_us: int
    word: Any  # its tag


_SPIN = 200  # polls of a READ without a pause (a small one ends in microseconds); then yield, later sleep 0.1 ms


def _plan_key(request: FetchRequest, dst: Sequence[Any]) -> tuple:
    """The kept plan of ``request``'s object into ``dst``: its handle's HMAC names the object."""
    return ((request.handle or b"")[-16:], request.token, *(t.data_ptr() for t in dst))


class NixlTransport(Transport):
    """One-sided READ of registered host or CUDA memory through one NIXL agent per process."""

    name = "nixl"
    capabilities = Capabilities(
        one_sided=True,
        same_process=False,
        same_node=True,
        cross_node=True,
        needs_export=True,
        peer_setup=True,
        registers_buffers=True,
        memory=frozenset({MemoryKind.HOST, MemoryKind.CUDA}),
    )
    # Host: measured on the 2-core build VM (UCX over cma, tcp); CUDA: unverified guesses (no GPU).
    cost_model = CostModel(
        CostEstimate(300, 4.0),
        (
            (Placement.SAME_NODE, MemoryKind.HOST, CostEstimate(250, 4.0)),
            (Placement.CROSS_NODE, MemoryKind.HOST, CostEstimate(300, 4.0)),
            (Placement.SAME_NODE, MemoryKind.CUDA, CostEstimate(200, 100.0)),
            (Placement.CROSS_NODE, MemoryKind.CUDA, CostEstimate(300, 20.0)),
        ),
    )

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._peers: dict[str, str] = {}  # tensorwire agent id -> its NIXL agent name
        self._published = False  # this process's agent metadata, in its connection info

    @classmethod
    def library_status(cls) -> str:
        return doctor.library()

    def diagnose(self) -> list[Diagnosis]:
        return doctor.diagnose()

    def unavailable_reason(self) -> str | None:
        found = any(importlib.util.find_spec(m.split(".")[0]) for m in API_MODULES)
        return None if found else "NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)"

    def connection_info(self) -> str:
        """Any process: its NIXL agent's name, and the agent's metadata once it is made (on first use)."""
        agent = existing_agent()
        return agent_name() if agent is None else f"{agent.name} {base64.b64encode(agent.conn_md).decode()}"

    def load_peer(self, peer: PeerInfo, info: str) -> None:
        """Consumer, once per producer: load its NIXL agent's metadata (published when that agent was made)."""
        name, _, encoded = info.partition(" ")
        if not name.startswith("tw-"):
            raise TransportUnavailableError(f"nixl: agent {peer.agent_id} published {name!r}, not a NIXL agent name")
        if not encoded:
            raise TransportUnavailableError(f"nixl: agent {peer.agent_id} published no NIXL metadata (no agent yet)")
        process_agent().load_connection(name, base64.b64decode(encoded, validate=True))
        self._peers[peer.agent_id] = name

    def forget_peer(self, agent_id: str) -> None:
        name, agent = self._peers.pop(agent_id, None), existing_agent()
        if name and agent is not None:
            agent.forget_remote(name)

    def export(self, obj: StoredObject) -> bytes | None:
        """Producer: register the object's storages (cached) and take a liveness slot."""
        tensors, host = obj.tensors, obj.host_only
        if not tensors or any(not (t.is_cpu or t.is_cuda) or not t.is_contiguous() for t in tensors):
            return None
        agent = process_agent()
        if not self._published:  # references leaving from now on carry the agent's metadata (twice: harmless)
            self.context.publish_transport_info(self.name, self.connection_info())
            self._published = True
        if host and fits(obj.nbytes):
            slot = agent.objects.take()
            if slot is not None:  # a small host object: copied with its tag into one slot, read in one descriptor
                return self._export_packed(agent, obj, slot)
        slot = agent.take(agent.free_table)
        if slot is None:
            logger.info("nixl: %d objects exported and live: this one goes through another transport", SLOTS)
            return None
        regs: list = []
        try:
            regs = agent.acquire(tensors)
            partials = agent.partial_metadata([*regs, agent.table_reg])
            for _device, event in obj.ready:  # READs come from another process with no stream order: wait here
                event.synchronize()
        except Exception as e:
            agent.free_table.append(slot)
            agent.unuse(regs)
            raise TransportError(f"nixl: registering {obj.nbytes} bytes failed: {e}") from e
        agent.table_np[slot] = tag = secrets.randbits(63) | 1
        if host:
            rows = np.array([(t.data_ptr(), t.nbytes, 0, False) for t in tensors], ROW)
        else:
            rows = np.array([(t.data_ptr(), t.nbytes, t.device.index or 0, t.is_cuda) for t in tensors], ROW)
        rids, flag_addr = (*(r.rid for r in regs), agent.table_reg.rid), agent.table.data_ptr() + 8 * slot
        storage_nbytes = sum(r.key[1] for r in regs)  # what a grace would keep
        grace = grace_us(storage_nbytes, host=host)
        obj.transport_state[self.name] = _Exported(regs, slot, grace, storage_nbytes)
        return Handle(agent.name, tuple(partials), rids, rows, flag_addr, tag, grace).signed(obj.token)

    def _export_packed(self, agent: NixlAgent, obj: StoredObject, slot: int) -> bytes:
        """Producer: the object's bytes as they are now, then its tag, in ``slot`` of the agent's slab."""
        slab = agent.objects
        try:
            partials = agent.partial_metadata([slab.registration])
        except Exception as e:
            slab.give(slot)
            raise TransportError(f"nixl: the metadata of the small-object slab failed: {e}") from e
        rows = np.array([(address, n, 0, False) for address, n in slab.fill(slot, obj.tensors)], ROW)
        flag_addr = slab.address(slot) + span(obj.nbytes) - 8
        (word := slab.word(flag_addr))[0] = tag = secrets.randbits(63) | 1
        grace = grace_us(span(obj.nbytes), host=True)
        obj.transport_state[self.name] = _Packed(slot, grace, word)
        agent.stats["packed_exports"] += 1
        handle = Handle(agent.name, tuple(partials), (slab.registration.rid,), rows, flag_addr, tag, grace, packed=True)
        return handle.signed(obj.token)

    def release(self, obj: StoredObject) -> None:
        state, agent = obj.transport_state.pop(self.name, None), existing_agent()
        if agent is None:
            return
        if isinstance(state, _Packed):
            state.word[0] = 0  # a READ of the tag from now on sees "freed"
            if not state.grace_us:
                agent.objects.give(state.slot)
                return
            slot = state.slot  # reused after the grace
            agent.linger((), lambda: agent.objects.give(slot), state.grace_us / 1e6, span(obj.nbytes))
        elif isinstance(state, _Exported):
            agent.table_np[state.slot] = 0  # a READ of the tag from now on sees "freed"
            agent.free_table.append(state.slot)
            if not state.grace_us:
                agent.unuse(state.regs)
                return
            regs = state.regs  # a READ that saw the tag before reads intact memory: kept for the grace
            agent.linger(obj.tensors, lambda: agent.unuse(regs), state.grace_us / 1e6, state.storage_nbytes)

    def fetch(self, request: FetchRequest, dst: Sequence[Any]) -> None:
        """Consumer: one READ of every tensor and of the liveness slot, polled to completion; the
        slot once more after the data if that took longer than half the producer's grace."""
        agent = process_agent()
        key = _plan_key(request, dst)
        plan = agent.plans.take(key)  # this object into these buffers before: its READs prepared
        if plan is None:
            plan = self._plan(agent, request, dst, key)
        self._run_plan(agent, plan, request, dst)

    def repeater(self, request: FetchRequest, dst: Sequence[Any]) -> Callable[[float], bool] | None:
        """Consumer: the same fetch again, blocking until its READs are done or the deadline,
        with the agent and the plan's key worked out once: it posts the kept plan (False when
        there is none: not yet kept, retired, or busy in another thread; ``fetch`` then makes
        one). A freed object raises as ``fetch`` does. It holds the buffers weakly (a plan whose
        buffers went is dropped, their registrations with it). None without prepared READs."""
        if not plans.PREPARED:
            return None
        agent, key = process_agent(), _plan_key(request, dst)
        buffers = tuple(weakref.ref(t) for t in dst)

        def repeat(deadline: float) -> bool:
            live = [b() for b in buffers]
            if any(t is None for t in live):
                return False
            plan = agent.plans.take(key)
            if plan is None:
                return False
            self._run_plan(agent, plan, request._replace(deadline=deadline), live)
            agent.stats["plans_repeated"] += 1
            return True

        return repeat

    def _run_plan(self, agent: NixlAgent, plan: Plan, request: FetchRequest, dst: Sequence[Any]) -> None:
        """Run ``plan`` (taken, busy) for ``request``; given back to the kept ones after, or
        retired if it failed."""
        try:
            self._run(agent, plan, request, dst)
        except BaseException as e:  # a READ still running could overwrite a fallback's bytes: no fallback then
            final = isinstance(e, (TransferTimeoutError, OwnerDiedError))  # an exited owner sends nothing more
            running = any(agent.running(x) for x in plan.posted)
            agent.plans.failed(plan, list(dst) if running else None)
            if running and not final and isinstance(e, Exception):
                raise TransferTimeoutError(f"nixl: a READ was still running when the fetch failed: {e}") from e
            raise
        agent.plans.done(plan)

    def _plan(self, agent: NixlAgent, request: FetchRequest, dst: Sequence[Any], key: tuple) -> Plan:
        """The READs of a fetch with no kept plan: the handle opened and checked, its metadata
        loaded, the destinations registered, a flag slot taken."""
        open_handle = opened if len(request.handle or b"") <= 1 << 16 else opened.__wrapped__  # memo: small ones
        if (handle := open_handle(request.handle or b"", request.token)) is None:
            raise PermissionDeniedError(f"nixl: the token does not open object {request.object_id.hex()}")
        if self._peers.get(request.owner.agent_id, handle.name) != handle.name:
            raise TransportError(f"nixl: handle names agent {handle.name}, not the one its owner published")
        if len(handle.rows) != len(dst):
            raise TransportError(f"nixl: handle has {len(handle.rows)} tensors, the request {len(dst)}")
        try:
            agent.load_remote(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own classes
            self._failed(request, f"loading agent {handle.name}'s metadata ({e})")
        plan = self._packed_plan(agent, handle, dst) if handle.packed else None
        if plan is None:
            plan = self._unpacked_plan(agent, handle, dst)
        try:
            return agent.plans.make(key, plan)
        except Exception as e:
            self._failed(request, f"preparing the READ ({type(e).__name__}: {e})")
            raise

    def _unpacked_plan(self, agent: NixlAgent, handle: Handle, dst: Sequence[Any]) -> Plan:
        """READs of the tensors where they are into ``dst`` (registered), the tag into a flag slot."""
        groups = rows_for(dst, handle.rows)
        regs = agent.acquire([t for t, row in zip(dst, handle.rows, strict=True) if row[1]])
        slot = agent.take(agent.free_flags)
        if slot is None:
            agent.unuse(regs)
            raise TransportUnavailableError(f"nixl: {SLOTS} fetches in flight in this process")
        tag = ((agent.flags.data_ptr() + 8 * slot, 8, 0), (handle.flag_addr, 8, 0))
        if handle.grace_us:  # the tag read with the data (the host group's last row)
            groups[-1][1][0].append(tag[0])
            groups[-1][1][1].append(tag[1])
        groups = [g for g in groups if g[1][0]]
        word, give_back = agent.flags_np[slot : slot + 1], lambda: agent.free_flags.append(slot)
        return Plan(handle.name, handle.tag, handle.grace_us / 1e6, word, give_back, regs, groups, tag)

    def _packed_plan(self, agent: NixlAgent, handle: Handle, dst: Sequence[Any]) -> Plan | None:
        """One READ of a packed object's slot (its bytes, then its tag) into a slot of this
        process's landing slab; None where ``dst`` is not host memory or no slot is free."""
        nbytes = sum(row[1] for row in handle.rows)
        if handle.flag_addr != handle.rows[0][0] + span(nbytes) - 8:
            raise TransportError("nixl: a packed handle whose tag does not follow its bytes")
        check_destinations(dst, handle.rows)
        if any(t.device.type != "cpu" for t in dst) or (slot := agent.landing.take()) is None:
            return None
        local = agent.landing.address(slot)
        tag = ((local + span(nbytes) - 8, 8, 0), (handle.flag_addr, 8, 0))
        groups = [((False, False), ([(local, span(nbytes), 0)], [(handle.rows[0][0], span(nbytes), 0)]))]
        word, give_back = agent.landing.word(tag[0][0]), lambda: agent.landing.give(slot)
        return Plan(handle.name, handle.tag, handle.grace_us / 1e6, word, give_back, [], groups, tag, landing=slot)

    def _run(self, agent: NixlAgent, plan: Plan, request: FetchRequest, dst: Sequence[Any]) -> None:
        """Post the plan's READs and wait; the tag (again) after them unless they ended within
        half the producer's grace; the object freed if the tag is not its own; a packed object
        copied out into ``dst``."""
        plan.word[0] = 0
        start = time.monotonic()
        self._post(agent, plan.reads, plan, request)
        if time.monotonic() - start >= plan.grace_s / 2:  # no grace, or its memory may have gone meanwhile
            plan.word[0] = 0
            agent.stats["tags_after"] += 1
            self._post(agent, [plan.read_tag(agent)], plan, request)
        if int(plan.word[0]) != plan.tag:
            self.context.check_owner(request)  # raises ObjectFreedError / OwnerDiedError
            raise TransportError(f"nixl: object {request.object_id.hex()} was freed by its owner")
        if plan.landing is not None:
            agent.landing.empty_into(plan.landing, dst)
            agent.stats["packed_fetches"] += 1

    def _post(self, agent: NixlAgent, reads: list, plan: Plan, request: FetchRequest) -> None:
        """Post ``reads`` and wait for all (those not seen done stay in ``plan.posted``)."""
        nixl, pending = agent.nixl, plan.posted
        try:
            for read in reads:
                pending.append(read)
                state = nixl.transfer(read)
                if state == "ERR":
                    self._failed(request, "posting the READ")
                if state == "DONE":
                    pending.pop()
            if pending:
                self._wait(nixl, pending, request)
        except Exception as e:
            if type(e).__name__.startswith("nixl"):  # NIXL's own errors: the owner's fate, else failed
                self._failed(request, f"the READ ({type(e).__name__}: {e})")
            raise

    def _wait(self, nixl: Any, pending: list, request: FetchRequest) -> None:
        """Poll every transfer in ``pending`` to DONE (emptying it): spin, then yield, then sleep
        0.1 ms between polls; bounded by the deadline, the owner checked meanwhile: its pid, and
        on another machine its status now and then."""
        owner, polls = request.owner, 0
        start = time.monotonic()
        alive_due, status_due = start + _ALIVE_EVERY_S, start + _STATUS_EVERY_S
        while pending:
            state = nixl.check_xfer_state(pending[-1])
            if state == "DONE":
                pending.pop()
                continue
            if state == "ERR":
                self._failed(request, "the READ")
            polls += 1
            if polls < _SPIN:
                continue
            now = time.monotonic()
            if now >= request.deadline:
                raise TransferTimeoutError(
                    f"nixl: READ of object {request.object_id.hex()} from {owner.agent_id}: "
                    "not complete before the deadline"
                )
            if now >= alive_due:
                alive_due = now + _ALIVE_EVERY_S
                remote_machine = not self.context.peer.same_machine(owner)
                if not self.context.peer_may_be_alive(owner) or (remote_machine and now >= status_due):
                    status_due = now + _STATUS_EVERY_S
                    self.context.check_owner(request)  # raises OwnerDiedError / PeerLostError
            time.sleep(0.0 if now - start < 0.002 else 0.0001)

    def _failed(self, request: FetchRequest, what: str) -> None:
        """A transfer ended in error: the owner's death or free if that is why, else TransportError."""
        self.context.check_owner(request)
        raise TransportError(f"nixl: {what} of object {request.object_id.hex()} from {request.owner.agent_id} failed")
