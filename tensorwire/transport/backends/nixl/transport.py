"""``nixl``: one-sided READ through NVIDIA's NIXL engine (extra ``nixl``; found through the
``tensorwire.transports`` entry point). Backends: ``TENSORWIRE_NIXL_BACKENDS`` (default ``UCX``).
Host memory is verified here, CUDA memory is not.

The producer registers each storage once (cached, :mod:`.agent`) and hands out a signed handle
(:mod:`.handles`): partial metadata, a row per tensor, a liveness slot. Its agent's metadata is
its connection info (the contract's connection step: loaded once per peer). A consumer loads
partial metadata only when new, READs the tensors, then the slot's tag: no control call, every
wait bounded. docs/architecture.md ("nixl details") says why each step is as it is.
"""

from __future__ import annotations

import base64
import importlib.util
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorwire.errors import (
    OwnerDiedError,
    PermissionDeniedError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from tensorwire.transport.backends.nixl import doctor
from tensorwire.transport.backends.nixl.agent import SLOTS, NixlAgent, agent_name, existing_agent, process_agent
from tensorwire.transport.backends.nixl.engine import API_MODULES
from tensorwire.transport.backends.nixl.handles import ROW, Handle, opened
from tensorwire.transport.contract import Capabilities, Diagnosis, FetchRequest, PeerInfo, StoredObject, Transport
from tensorwire.transport.costs import CostEstimate, CostModel, MemoryKind, Placement
from tensorwire.transport.waiting import wait_until

__all__ = ["NixlTransport"]

logger = logging.getLogger(__name__)

_ALIVE_EVERY_S = 0.2  # seconds between checks of the owner's pid while a READ runs
_STATUS_EVERY_S = 2.0  # ... and of its status, when it runs on another machine


def _pace(polls: int, elapsed_s: float) -> float | None:
    """Between polls of a READ: spin first (a small READ ends in microseconds), then yield,
    then sleep 0.1 ms."""
    if polls < 200:
        return None
    return 0.0 if elapsed_s < 0.002 else 0.0001


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
        tensors = obj.tensors
        if not tensors or any(not t.is_contiguous() or t.device.type not in ("cpu", "cuda") for t in tensors):
            return None
        agent = process_agent()
        if not self._published:  # references leaving from now on carry the agent's metadata (twice: harmless)
            self.context.publish_transport_info(self.name, self.connection_info())
            self._published = True
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
        agent.table_np[slot], obj.transport_state[self.name] = (tag := secrets.randbits(63) | 1), (regs, slot)
        rows = np.array([(t.data_ptr(), t.nbytes, t.device.index or 0, t.device.type == "cuda") for t in tensors], ROW)
        rids, flag_addr = (*(r.rid for r in regs), agent.table_reg.rid), agent.table.data_ptr() + 8 * slot
        return Handle(agent.name, tuple(partials), rids, rows, flag_addr, tag).signed(obj.token)

    def release(self, obj: StoredObject) -> None:
        state, agent = obj.transport_state.pop(self.name, None), existing_agent()
        if not isinstance(state, tuple) or agent is None:
            return
        regs, slot = state
        agent.table_np[slot] = 0  # before the memory may go: a READ after this sees "freed"
        agent.free_table.append(slot)
        agent.unuse(regs)

    def fetch(self, request: FetchRequest, dst: Sequence[Any]) -> None:
        """Consumer: one READ of every tensor, then one of the liveness slot, polled to completion."""
        open_handle = opened if len(request.handle or b"") <= 1 << 16 else opened.__wrapped__  # memo: small ones
        if (handle := open_handle(request.handle or b"", request.token)) is None:
            raise PermissionDeniedError(f"nixl: the token does not open object {request.object_id.hex()}")
        if self._peers.get(request.owner.agent_id, handle.name) != handle.name:
            raise TransportError(f"nixl: handle names agent {handle.name}, not the one its owner published")
        if len(handle.rows) != len(dst):
            raise TransportError(f"nixl: handle has {len(handle.rows)} tensors, the request {len(dst)}")
        agent = process_agent()
        try:
            agent.load_remote(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own classes
            self._failed(request, f"loading agent {handle.name}'s metadata ({e})")
        targets = [(t, row) for t, row in zip(dst, handle.rows, strict=True) if row[1]]
        groups: dict[tuple[bool, bool], tuple[list, list]] = {}  # (memory kinds) -> (local, remote) rows
        for t, row in targets:
            if t.numel() * t.element_size() != row[1] or not t.is_contiguous():
                raise TransportError("nixl: a destination buffer does not match the handle")
            vram = t.device.type == "cuda"
            local, remote = groups.setdefault((vram, bool(row[3])), ([], []))
            local.append((t.data_ptr(), row[1], (t.device.index or 0) if vram else 0))
            remote.append(row[:3])
        regs = agent.acquire([t for t, _ in targets])
        slot = agent.take(agent.free_flags)
        if slot is None:
            agent.unuse(regs)
            raise TransportUnavailableError(f"nixl: {SLOTS} fetches in flight in this process")
        unfinished: list = []  # READs posted and not seen DONE
        try:
            agent.flags_np[slot] = 0
            flag = ([(agent.flags.data_ptr() + 8 * slot, 8, 0)], [(handle.flag_addr, 8, 0)])
            self._post(agent, handle, list(groups.items()), request, unfinished)
            self._post(agent, handle, [((False, False), flag)], request, unfinished)  # the tag after the data
            if int(agent.flags_np[slot]) != handle.tag:
                self.context.check_owner(request)  # raises ObjectFreedError / OwnerDiedError
                raise TransportError(f"nixl: object {request.object_id.hex()} was freed by its owner")
        except Exception as e:  # a READ still running could overwrite a fallback's bytes: no fallback then
            final = isinstance(e, (TransferTimeoutError, OwnerDiedError))  # an exited owner sends nothing more
            if not final and not any(agent.running(x) for x in unfinished):
                agent.release(unfinished)  # none runs (ended, failed): nothing of theirs can land now
            elif not final:
                raise TransferTimeoutError(f"nixl: a READ was still running when the fetch failed: {e}") from e
            raise
        finally:
            if unfinished:  # kept, with the memory they read into, until NIXL says they ended (settle)
                logger.warning("nixl: %d READs from %s unfinished; their memory is kept", len(unfinished), handle.name)
                agent.stuck.append((handle.name, unfinished, [t for t, _ in targets], regs, slot))
            else:
                agent.unuse(regs)
                agent.free_flags.append(slot)

    def _post(self, agent: NixlAgent, handle: Handle, groups: list, request: FetchRequest, xfers: list) -> None:
        """READ each group and wait for all: handles released when DONE, else left in ``xfers``."""
        try:
            for (lv, rv), (local, remote) in groups:
                ldescs = agent.nixl.get_xfer_descs(local, "VRAM" if lv else "DRAM")
                rdescs = agent.nixl.get_xfer_descs(remote, "VRAM" if rv else "DRAM")
                xfers.append(agent.nixl.initialize_xfer("READ", ldescs, rdescs, handle.name))
                if agent.nixl.transfer(xfers[-1]) == "ERR":
                    self._failed(request, "posting the READ")
            self._wait(agent, xfers, request)
        except Exception as e:
            if type(e).__name__.startswith("nixl"):  # NIXL's own errors: the owner's fate, else failed
                self._failed(request, f"the READ ({type(e).__name__}: {e})")
            raise
        agent.release(xfers)

    def _wait(self, agent: NixlAgent, xfers: list, request: FetchRequest) -> None:
        """Poll every transfer to DONE; bounded by the deadline, the owner checked meanwhile:
        its pid, and on another machine its status now and then."""
        owner, pending = request.owner, list(xfers)
        remote_machine = not self.context.peer.same_machine(owner)
        status_due = [time.monotonic() + _STATUS_EVERY_S]

        def step(_slice_s: float) -> bool | None:
            states = [agent.nixl.check_xfer_state(x) for x in pending]
            if "ERR" in states:
                self._failed(request, "the READ")
            pending[:] = [x for x, s in zip(pending, states, strict=True) if s != "DONE"]
            return None if pending else True

        def check() -> None:
            now = time.monotonic()
            if not self.context.peer_may_be_alive(owner) or (remote_machine and now >= status_due[0]):
                status_due[0] = now + _STATUS_EVERY_S
                self.context.check_owner(request)  # raises OwnerDiedError / PeerLostError

        what = f"nixl: READ of object {request.object_id.hex()} from {owner.agent_id}"
        wait_until(step, deadline=request.deadline, what=what, check=check, check_every_s=_ALIVE_EVERY_S, pause=_pace)

    def _failed(self, request: FetchRequest, what: str) -> None:
        """A transfer ended in error: the owner's death or free if that is why, else TransportError."""
        self.context.check_owner(request)
        raise TransportError(f"nixl: {what} of object {request.object_id.hex()} from {request.owner.agent_id} failed")
