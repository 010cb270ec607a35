"""``nixl``: one-sided READ through NVIDIA's NIXL engine (extra ``nixl``; the ``tensorwire.transports`` entry point).
Backends: ``TENSORWIRE_NIXL_BACKENDS`` (default ``UCX``). Host memory is verified here, CUDA memory is not. The
producer registers each storage once (cached) and hands out a handle: partial metadata, a row per tensor, a
liveness slot. Its agent's metadata is its connection info (the contract's connection step: loaded once per peer);
a consumer loads partial metadata only when new, READs the tensors, then the slot's tag: no control call, every wait
bounded. docs/architecture.md ("nixl details") says why each step is as it is."""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import hmac
import importlib.util
import itertools
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorwire.errors import (
    OwnerDiedError,
    PermissionDeniedError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from tensorwire.transport.backends.nixl.engine import API_MODULES, BACKENDS_ENV, new_agent, nixl_api
from tensorwire.transport.contract import Capabilities, FetchRequest, PeerInfo, StoredObject, Transport
from tensorwire.transport.costs import CostEstimate, CostModel, MemoryKind, Placement

__all__ = ["BACKENDS_ENV", "CACHE_ENV", "NixlTransport", "new_agent", "nixl_api", "stats"]

logger = logging.getLogger(__name__)

CACHE_ENV = "TENSORWIRE_NIXL_CACHE"
_SLOTS = 4096  # liveness slots per process (objects exported and live at once)
_VERSION = 2
_HEADER = struct.Struct("!BHIIIQQ")  # version, name, partial count, regs, rows, flag address, tag
_ROW = np.dtype([("addr", ">u8"), ("len", ">u8"), ("dev", ">u4"), ("vram", "u1")])
_MAC = 16  # bytes of HMAC-SHA256 (key: the object's token) that end a handle
_POLL_S = (0.2, 2.0)  # seconds between liveness checks of the owner: its pid, a status call


def _region(tensor: Any) -> tuple[int, int, bool, int]:
    """(address, bytes, is VRAM, device) of the storage ``tensor`` lives in."""
    storage, cuda = tensor.untyped_storage(), tensor.device.type == "cuda"
    return storage.data_ptr(), storage.nbytes(), cuda, (tensor.device.index or 0) if cuda else 0


@dataclass
class _Reg:
    rid: int
    key: tuple[int, int, bool, int]
    weak: Any  # torch StorageWeakRef: whether the registered memory still exists
    descs: Any  # nixlRegDList
    users: int = 0


class _Agent:
    """This process's one NIXL agent: registrations, liveness slots, loaded remote agents."""

    def __init__(self, name: str) -> None:
        import torch

        self.nixl = new_agent(name)
        if not self.nixl.backends:
            raise TransportUnavailableError(f"nixl: none of the backends in {BACKENDS_ENV} could be created; "
                                            f"plug-ins available: {self.nixl.get_plugin_list()}")  # fmt: skip
        self.name, self.lock, self.stopped, self.ids = name, threading.RLock(), threading.Event(), itertools.count(1)
        self.capacity = max(16, int(os.environ.get(CACHE_ENV, "512")))
        self.regs: OrderedDict[tuple[int, int, bool, int], _Reg] = OrderedDict()
        self.idle: dict[tuple, _Reg] = {}  # users dropped to 0: checked for freed memory by _sweep
        self.partials: OrderedDict[tuple[int, ...], list[bytes]] = OrderedDict()
        self.remote: dict[str, set[int]] = {}  # remote agent name -> registration ids loaded
        self.stuck: list[tuple[str, list, list, list, int]] = []  # kept READs: (owner, READs, memory, regs, slot)
        self.stats = dict.fromkeys(("registered", "deregistered", "hits", "metadata_loads", "partial_loads",
                                    "leaked_handles"), 0)  # fmt: skip
        self.conn_md = self.nixl.get_agent_metadata()
        # producer: the tags of live objects; consumer: where tags are read into
        self.table, self.flags = (torch.zeros(_SLOTS, dtype=torch.int64) for _ in range(2))
        self.table_reg, self.flags_reg = self.acquire([self.table, self.flags])
        self.table_np, self.flags_np = self.table.numpy(), self.flags.numpy()  # cheaper to index
        self.free_table, self.free_flags = list(range(_SLOTS)), list(range(_SLOTS))
        (sweeper := threading.Thread(target=self._sweep, name="tw-nixl-sweep", daemon=True)).start()
        atexit.register(lambda: (self.stopped.set(), sweeper.join(timeout=2)))  # before NIXL goes at exit

    def acquire(self, tensors: Sequence[Any]) -> list[_Reg]:
        """The registrations covering ``tensors``, each used once more (missing ones: one call per kind)."""
        from tensorwire.transport.host_pool import liveness  # a pooled buffer's registration outlives one value

        with self.lock:
            found: dict[tuple, _Reg | None] = {}
            missing: dict[tuple, Any] = {}
            for tensor in tensors:
                key = _region(tensor)
                if key in found:
                    continue
                reg = self.regs.get(key)
                if reg is not None and reg.users == 0 and reg.weak.expired():
                    self._drop(reg)
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
                    found[key] = self.regs[key] = _Reg(next(self.ids), key, weak, descs)
                    self.stats["registered"] += 1
            regs = [r for r in found.values() if r is not None]
            for reg in regs:
                reg.users += 1
            self._trim()
            return regs

    def unuse(self, regs: Sequence[_Reg]) -> None:
        with self.lock:
            for reg in regs:
                reg.users -= 1
            self.idle.update((r.key, r) for r in regs if r.users == 0)

    def _sweep(self) -> None:
        """Thread ``tw-nixl-sweep``, every 0.2 s until exit: settle kept READs, deregister idle freed memory."""
        while not self.stopped.wait(0.2):
            with self.lock:
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

    def _drop(self, reg: _Reg) -> None:
        self.regs.pop(reg.key, None)
        self.idle.pop(reg.key, None)
        try:
            self.nixl.deregister_memory(reg.descs)
            self.stats["deregistered"] += 1
        except Exception as e:  # noqa: BLE001 - a failed deregistration leaks, never breaks a transfer
            logger.warning("nixl: deregistering %d bytes at %#x failed: %s", reg.key[1], reg.key[0], e)

    def partial_metadata(self, regs: Sequence[_Reg]) -> list[bytes]:
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

    def load_remote(self, handle: _Handle) -> None:
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
            if not any(e[0] == name for e in self.stuck) and self.remote.pop(name, None) is not None:
                with contextlib.suppress(Exception):  # the peer is gone either way
                    self.nixl.remove_remote_agent(name)

    def settle(self) -> None:
        """Release kept READs that ended: one past its deadline can still land (seen: SIGSEGV)."""
        with self.lock:
            for entry in [e for e in self.stuck if not any(self.running(x) for x in e[1])]:
                self.stuck.remove(entry)
                self.release(entry[1])
                self.unuse(entry[3])
                self.free_flags.append(entry[4])

    def release(self, xfers: list) -> None:
        """Release ended transfers' handles (``xfers`` is emptied)."""
        while xfers:
            try:
                self.nixl.release_xfer_handle(xfers.pop())
            except Exception as e:  # noqa: BLE001 - it ended: only its handle's memory is lost
                self.stats["leaked_handles"] += 1
                logger.warning("nixl: a transfer handle could not be released (%s)", e)

    def running(self, xfer: Any) -> bool:
        try:
            return self.nixl.check_xfer_state(xfer) == "PROC"
        except Exception:  # noqa: BLE001 - it ended in an error (its owner disconnected, say)
            return False

    def take(self, free: list[int]) -> int | None:
        with self.lock:
            return free.pop() if free else None  # (a list's pop is atomic; the lock orders it with settle)


_lock = threading.Lock()
_process: dict[int, _Agent] = {}
_names: dict[int, str] = {}


def _agent_name() -> str:
    return _names.setdefault(os.getpid(), f"tw-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def _agent() -> _Agent:
    """This process's NIXL agent, made on first use."""
    with _lock:
        if (pid := os.getpid()) not in _process:
            try:
                _process[pid] = _Agent(_agent_name())
            except Exception as e:
                raise TransportUnavailableError(f"nixl: no NIXL agent: {type(e).__name__}: {e}") from e
        return _process[pid]


def stats() -> dict[str, int]:
    """This process's registration cache and metadata counters (empty before first use)."""
    if (agent := _process.get(os.getpid())) is None:
        return {}
    with agent.lock:
        return {**agent.stats, "cached": len(agent.regs), "remote_agents": len(agent.remote), "idle": len(agent.idle),
                "live_slots": _SLOTS - len(agent.free_table), "stuck_reads": len(agent.stuck)}  # fmt: skip


@dataclass(frozen=True)
class _Handle:
    name: str
    partials: tuple[bytes, ...]
    rids: tuple[int, ...]
    rows: Any  # producer: a _ROW array; decoded: (address, length, device, vram) tuples
    flag_addr: int
    tag: int

    def encode(self) -> bytes:
        head = _HEADER.pack(_VERSION, len(self.name), len(self.partials), len(self.rids), len(self.rows),
                            self.flag_addr, self.tag)  # fmt: skip
        parts = [head, self.name.encode()]
        parts += [struct.pack("!I", len(b)) + b for b in self.partials]
        return b"".join([*parts, np.asarray(self.rids, dtype=">u8").tobytes(), self.rows.astype(_ROW).tobytes()])


@functools.lru_cache(maxsize=64)  # the same reference fetched again: its handle checked and decoded once
def _opened(signed: bytes, token: bytes) -> _Handle | None:
    """The handle in ``signed`` if ``token`` opens it (its HMAC), else None."""
    data, mac = signed[:-_MAC], signed[-_MAC:]
    if not hmac.compare_digest(hmac.digest(token, data, "sha256")[:_MAC], mac):
        return None
    try:
        version, n_name, n_partial, n_rids, n_rows, flag, tag = _HEADER.unpack_from(data, 0)
        if version != _VERSION:
            raise TransportError(f"nixl: handle version {version} (expected {_VERSION})")
        pos = _HEADER.size + n_name
        name = data[_HEADER.size : pos].decode()
        partials = []
        for _ in range(n_partial):
            (n,) = struct.unpack_from("!I", data, pos)
            partials.append(bytes(data[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        rids, pos = tuple(np.frombuffer(data, ">u8", n_rids, pos).tolist()), pos + 8 * n_rids
        array = np.frombuffer(data, _ROW, n_rows, pos)
        if pos + array.nbytes != len(data):
            raise TransportError("nixl: trailing bytes in handle")
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise TransportError(f"nixl: malformed handle ({e})") from None
    return _Handle(name, tuple(partials), rids, array.tolist(), flag, tag)


class NixlTransport(Transport):
    """One-sided READ of registered host or CUDA memory through one NIXL agent per process."""

    name = "nixl"
    capabilities = Capabilities(one_sided=True, same_process=False, same_node=True, cross_node=True, needs_export=True,
                                peer_setup=True, registers_buffers=True,
                                memory=frozenset({MemoryKind.HOST, MemoryKind.CUDA}))  # fmt: skip
    # Host: measured on the 2-core build VM (UCX over cma, tcp); CUDA: unverified guesses (no GPU).
    cost_model = CostModel(CostEstimate(300, 4.0), (
        (Placement.SAME_NODE, MemoryKind.HOST, CostEstimate(250, 4.0)),
        (Placement.CROSS_NODE, MemoryKind.HOST, CostEstimate(300, 4.0)),
        (Placement.SAME_NODE, MemoryKind.CUDA, CostEstimate(200, 100.0)),
        (Placement.CROSS_NODE, MemoryKind.CUDA, CostEstimate(300, 20.0))))  # fmt: skip

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._peers: dict[str, str] = {}  # tensorwire agent id -> its NIXL agent name
        self._published = False  # this process's agent metadata, in its connection info

    def unavailable_reason(self) -> str | None:
        found = any(importlib.util.find_spec(m.split(".")[0]) for m in API_MODULES)
        return None if found else "NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)"

    def connection_info(self) -> str:
        """Any process: its NIXL agent's name, and the agent's metadata once it is made (on first use)."""
        agent = _process.get(os.getpid())
        return _agent_name() if agent is None else f"{agent.name} {base64.b64encode(agent.conn_md).decode()}"

    def load_peer(self, peer: PeerInfo, info: str) -> None:
        """Consumer, once per producer: load its NIXL agent's metadata (published when that agent was made)."""
        name, _, encoded = info.partition(" ")
        if not name.startswith("tw-"):
            raise TransportUnavailableError(f"nixl: agent {peer.agent_id} published {name!r}, not a NIXL agent name")
        if not encoded:
            raise TransportUnavailableError(f"nixl: agent {peer.agent_id} published no NIXL metadata (no agent yet)")
        _agent().load_connection(name, base64.b64decode(encoded, validate=True))
        self._peers[peer.agent_id] = name

    def forget_peer(self, agent_id: str) -> None:
        name, agent = self._peers.pop(agent_id, None), _process.get(os.getpid())
        if name and agent is not None:
            agent.forget_remote(name)

    def export(self, obj: StoredObject) -> bytes | None:
        """Producer: register the object's storages (cached) and take a liveness slot."""
        tensors = obj.tensors
        if not tensors or any(not t.is_contiguous() or t.device.type not in ("cpu", "cuda") for t in tensors):
            return None
        agent = _agent()
        if not self._published:  # references leaving from now on carry the agent's metadata (twice: harmless)
            self.context.publish_transport_info(self.name, self.connection_info())
            self._published = True
        slot = agent.take(agent.free_table)
        if slot is None:
            logger.info("nixl: %d objects exported and live: this one goes through another transport", _SLOTS)
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
        rows = np.array([(t.data_ptr(), t.nbytes, t.device.index or 0, t.device.type == "cuda") for t in tensors], _ROW)
        rids, flag_addr = (*(r.rid for r in regs), agent.table_reg.rid), agent.table.data_ptr() + 8 * slot
        body = _Handle(agent.name, tuple(partials), rids, rows, flag_addr, tag).encode()
        return body + hmac.digest(obj.token, body, "sha256")[:_MAC]  # opened only with the object's token

    def release(self, obj: StoredObject) -> None:
        state, agent = obj.transport_state.pop(self.name, None), _process.get(os.getpid())
        if not isinstance(state, tuple) or agent is None:
            return
        regs, slot = state
        agent.table_np[slot] = 0  # before the memory may go: a READ after this sees "freed"
        agent.free_table.append(slot)
        agent.unuse(regs)

    def fetch(self, request: FetchRequest, dst: Sequence[Any]) -> None:
        """Consumer: one READ of every tensor, then one of the liveness slot, polled to completion."""
        opened = _opened if len(request.handle or b"") <= 1 << 16 else _opened.__wrapped__  # memo: small handles
        if (handle := opened(request.handle or b"", request.token)) is None:
            raise PermissionDeniedError(f"nixl: the token does not open object {request.object_id.hex()}")
        if self._peers.get(request.owner.agent_id, handle.name) != handle.name:
            raise TransportError(f"nixl: handle names agent {handle.name}, not the one its owner published")
        if len(handle.rows) != len(dst):
            raise TransportError(f"nixl: handle has {len(handle.rows)} tensors, the request {len(dst)}")
        agent = _agent()
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
            raise TransportUnavailableError(f"nixl: {_SLOTS} fetches in flight in this process")
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

    def _post(self, agent: _Agent, handle: _Handle, groups: list, request: FetchRequest, xfers: list) -> None:
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

    def _wait(self, agent: _Agent, xfers: list, request: FetchRequest) -> None:
        """Poll every transfer to DONE; bounded by the deadline, the owner checked meanwhile."""
        owner, start = request.owner, time.monotonic()
        remote_machine = not self.context.peer.same_machine(owner)
        next_alive, next_status = start + _POLL_S[0], start + _POLL_S[1]
        pending, spins = list(xfers), 0
        while True:
            states = [agent.nixl.check_xfer_state(x) for x in pending]
            if "ERR" in states:
                self._failed(request, "the READ")
            pending = [x for x, s in zip(pending, states, strict=True) if s != "DONE"]
            if not pending:
                return
            now = time.monotonic()
            if now >= request.deadline:
                what = f"object {request.object_id.hex()} from {owner.agent_id}"
                raise TransferTimeoutError(f"nixl: READ of {what} unfinished at its deadline ({now - start:.3g} s)")
            if now >= next_alive:  # the owner's pid, else (another machine) its status, now and then
                next_alive = now + _POLL_S[0]
                if not self.context.peer_may_be_alive(owner) or (remote_machine and now >= next_status):
                    next_status = now + _POLL_S[1]
                    self.context.check_owner(request)  # raises OwnerDiedError / PeerLostError
            if (spins := spins + 1) > 200:
                time.sleep(0 if now - start < 0.002 else 0.0001)

    def _failed(self, request: FetchRequest, what: str) -> None:
        """A transfer ended in error: the owner's death or free if that is why, else TransportError."""
        self.context.check_owner(request)
        raise TransportError(f"nixl: {what} of object {request.object_id.hex()} from {request.owner.agent_id} failed")
