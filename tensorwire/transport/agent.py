"""The per-process agent: object store, holder bookkeeping, control service, fetch dispatch.

One agent per process, started lazily by :func:`get_agent`. It owns the objects registered
in this process (tensors kept alive while any holder remains), keeps the holds this process
has on other agents' objects, serves the control service on background threads, and runs
fetches through the transport the selector picks.

Holder protocol (DESIGN.md section 5):

* A process *holds* an object while it has at least one live reference to it. Holders tell
  the owner with batched, asynchronous ``REGISTER``/``RELEASE`` operations sent in order by
  one background thread, so a one-sided fetch never waits on a control call.
* A reference that leaves a process (pickled) creates a *transit pin* at the owner; the pin
  is consumed when the receiving process registers (or, if nobody ever deserializes it, it
  expires after ``Config.transit_ttl_s``).
* The owner frees an object when it has no local reference, no remote holder and no pin, or
  on ``free()``. Holders on this machine that exit are detected by pid; holders elsewhere
  that stop answering lose their holds after ``Config.holder_lost_after_s``.
"""

from __future__ import annotations

import atexit
import collections
import hmac
import logging
import os
import secrets
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import torch

from tensorwire.errors import (
    InvalidRequestError,
    NoTransportError,
    ObjectFreedError,
    OwnerDiedError,
    PeerLostError,
    PermissionDeniedError,
    TensorwireError,
    TransferAbortedError,
    TransferTimeoutError,
    TransportError,
)
from tensorwire.transport import calibration, metrics, registry, selector, topology
from tensorwire.transport.base import (
    Capabilities,
    CostModel,
    FetchRequest,
    MemoryKind,
    ObjectDescriptor,
    PeerInfo,
    StoredObject,
    TensorKind,
    TensorMeta,
    Transport,
    TransportContext,
)
from tensorwire.transport.config import Config, validate_timeout
from tensorwire.transport.control import (
    ControlClient,
    ControlServer,
    cluster_token,
    map_rpc_error,
    socket_dir,
)
from tensorwire.transport.metrics import TransferRecord
from tensorwire.transport.outbox import Outbox
from tensorwire.transport.peer_setup import PeerSetup
from tensorwire.transport.shutdown import run_bounded
from tensorwire.transport.wire import HolderOpKind, ObjectState, decode_peer, encode_peer, messages

__all__ = ["Agent", "TransferRecord", "add_startup_hook", "get_agent", "shutdown_agent"]

logger = logging.getLogger(__name__)

_TOMBSTONES = 65536  # freed object ids remembered, to tell "freed" from "never existed"


@dataclass
class _Entry:
    """Owner-side bookkeeping of one stored object."""

    stored: StoredObject
    local_refs: int = 0
    holders: set[str] = field(default_factory=set)
    pins: dict[bytes, float] = field(default_factory=dict)  # pin id -> expiry (monotonic)
    handles: dict[str, bytes] | None = None
    export_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def unreferenced(self) -> bool:
        """No local reference, no holder, no pin: the owner may free it."""
        return self.local_refs <= 0 and not self.holders and not self.pins


@dataclass
class _Held:
    """Holder-side bookkeeping of another agent's object referenced in this process."""

    owner: PeerInfo
    token: bytes
    count: int = 0


class Agent(TransportContext):
    """The per-process agent. Use :func:`get_agent`; do not construct directly in user code."""

    def __init__(self, config: Config | None = None) -> None:
        self._config = config or Config.from_env()
        self._lock = threading.RLock()
        self._objects: dict[bytes, _Entry] = {}
        self._tombstones: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._early_unpins: dict[bytes, float] = {}
        self._holder_peers: dict[str, PeerInfo] = {}
        self._holder_seen: dict[str, float] = {}
        self._held: dict[bytes, _Held] = {}
        self._transports: dict[str, Transport] = {}
        self._unusable: dict[str, str] = {}
        self._warned: set[str] = set()
        self._records: collections.deque[TransferRecord] = collections.deque(maxlen=1000)
        self._counters: dict[str, list[int]] = {}
        self._closed = threading.Event()
        self._serving_now = 0
        self._rendezvous: collections.OrderedDict[str, dict[str, bytes]] = collections.OrderedDict()
        self._rendezvous_changed = threading.Condition(self._lock)
        self.pid = os.getpid()

        token = cluster_token()
        agent_id = secrets.token_hex(8)
        self._client = ControlClient(token=token)
        self._server = ControlServer(
            self,
            token=token,
            unix_path=os.path.join(socket_dir(), f"{agent_id}.sock"),
            tcp_host=self._config.host,
        )
        self._server.start()
        self._peer = PeerInfo(
            agent_id=agent_id,
            node_id=topology.node_id(),
            machine_id=topology.machine_id(),
            hostname=socket.gethostname(),
            pid=self.pid,
            start_time=topology.process_start_time(self.pid),
            unix_address=self._server.unix_address,
            tcp_address=self._server.tcp_address,
            devices=topology.visible_devices(),
            gpu_links=topology.gpu_links(),
        )
        self._costs = calibration.load_costs()  # this machine's `tensorwire bench --calibrate`, if any
        self._selections: dict[tuple[Any, ...], selector.Selection] = {}
        self._peer_setup = PeerSetup(self)  # one-sided transports' per-peer connection step
        self._refresh_transports()
        metrics.enable_prometheus()  # when prometheus-client is installed
        self._outbox = Outbox(
            self._client,
            sender=lambda: encode_peer(self._peer),
            address=self._address,
            may_be_alive=self.peer_may_be_alive,
            rpc_timeout_s=self._config.rpc_timeout_s,
        )
        self._reaper = threading.Thread(target=self._reap_loop, name="tensorwire-reaper", daemon=True)
        self._reaper.start()
        logger.debug("agent %s started: %s %s", agent_id, self._server.unix_address, self._server.tcp_address)

    # ------------------------------------------------------------------ identity, transports

    @property
    def peer(self) -> PeerInfo:
        return self._peer

    @property
    def config(self) -> Config:
        return self._config

    def set_config(self, config: Config) -> None:
        """Replace the settings (tests; takes effect for new exports and fetches)."""
        self._config = config

    def _refresh_transports(self) -> None:
        """Instantiate newly registered transports, cache every registered transport's
        capabilities for the selector, and publish the usable ones in ``peer``."""
        self._registry_version = registry.version()
        names = registry.registered_transports()
        self._capabilities: dict[str, Capabilities] = {}
        self._cost_models: dict[str, CostModel | None] = {}
        for name in names:
            try:
                cls = registry.get_transport_class(name)
            except Exception:  # noqa: BLE001 - a broken plug-in is simply not a candidate
                continue
            self._capabilities[name], self._cost_models[name] = cls.capabilities, cls.cost_model
        for name in names:
            if name in self._transports or name in self._unusable:
                continue
            try:
                transport = registry.get_transport_class(name)(self)
                reason = transport.unavailable_reason()
            except Exception as e:  # noqa: BLE001 - a broken plug-in must not break the agent
                reason = f"failed to load: {type(e).__name__}: {e}"
            if reason is None and transport.capabilities.peer_setup:
                reason = self._peer_setup.publish(transport)
            if reason is None:
                self._transports[name] = transport
            else:
                self._unusable[name] = reason
                logger.debug("transport %s not usable here: %s", name, reason)
        for name in list(self._transports):
            if name not in names:
                self._transports.pop(name).close()
        self._peer = replace(self._peer, transports=tuple(self._transports))

    def publish_transport_info(self, transport: str, info: str) -> None:
        with self._lock:
            others = tuple(item for item in self._peer.transport_info if item[0] != transport)
            self._peer = replace(self._peer, transport_info=(*others, (transport, info)))

    def unusable_transports(self) -> dict[str, str]:
        """Registered transports that cannot run here, with the reason."""
        return dict(self._unusable)

    # ------------------------------------------------------------------ producer side

    def register(
        self,
        tensors: list[torch.Tensor],
        metas: tuple[TensorMeta, ...],
        packed_nbytes: int,
        ready: list[Any] | None = None,
    ) -> ObjectDescriptor:
        """Producer: keep ``tensors`` under a new object id; the caller attaches a reference next.

        ``ready``: CUDA events recorded after the work that produced the tensors; transports
        make their streams wait for them before reading.
        """
        if registry.version() != self._registry_version:
            self._refresh_transports()
        object_id = secrets.token_bytes(16)
        token = secrets.token_bytes(16)
        stored = StoredObject(object_id, token, tensors, metas, packed_nbytes, ready=list(ready or ()))
        with self._lock:
            self._objects[object_id] = _Entry(stored)
        return ObjectDescriptor(object_id, token, self._peer, metas, packed_nbytes)

    def export_handles(self, desc: ObjectDescriptor) -> dict[str, bytes]:
        """Producer, when a reference leaves the process: handles of one-sided transports.

        Inline is tried first; when it carries the bytes no other export is made. Exports
        are made once per object and cached. A failed export is logged and skipped: the
        consumer then falls back to a two-sided transport.
        """
        with self._lock:
            entry = self._owned_entry(desc)
        if entry is None:
            return {}
        with entry.export_lock:
            if entry.handles is not None:
                return dict(entry.handles)
            handles: dict[str, bytes] = {}
            memory = {m.memory for m in entry.stored.metas}
            exporters = [
                n
                for n, t in self._transports.items()
                if t.capabilities.needs_export and not t.capabilities.export_per_consumer
            ]
            exporters.sort(key=lambda n: not self._transports[n].capabilities.carries_value)
            for name in exporters:
                transport = self._transports[name]
                if not memory <= transport.capabilities.memory:
                    continue
                try:
                    handle = transport.export(entry.stored)
                except Exception as e:  # noqa: BLE001 - fall back to another transport
                    self._warn_once(
                        f"export:{name}",
                        "transport %s could not export an object (%s); consumers will use another transport",
                        name,
                        e,
                    )
                    continue
                if handle is not None:
                    handles[name] = handle
                    if transport.capabilities.carries_value:
                        break  # the bytes travel in the reference: no other handle needed
            entry.handles = handles
            return dict(handles)

    def _export_on_request(self, entry: _Entry, name: str) -> bytes:
        """Producer: export ``entry`` for transport ``name`` now (a consumer forced it)."""
        transport = self._transports.get(name)
        if transport is None or not (transport.capabilities.needs_export or transport.capabilities.export_per_consumer):
            raise InvalidRequestError(f"transport {name!r} cannot export here")
        per_consumer = transport.capabilities.export_per_consumer
        with entry.export_lock:
            if not per_consumer and entry.handles is not None and name in entry.handles:
                return entry.handles[name]
            try:
                handle = transport.export(entry.stored)
            except TensorwireError as e:
                raise TransportError(f"{name} export failed: {e}") from None
            if handle is None:
                limit = f"; {name} takes at most {self._config.inline_max_nbytes} (TENSORWIRE_INLINE_NBYTES)"
                raise TransportError(
                    f"{name} declined to export this object of {entry.stored.nbytes} bytes"
                    f"{limit if transport.capabilities.carries_value else ''}",
                )
            if not per_consumer:  # a per-consumer handle is this consumer's alone
                entry.handles = {**(entry.handles or {}), name: handle}
            return handle

    def free(self, desc: ObjectDescriptor, *, timeout_s: float | None = None) -> None:
        """Free the object now, wherever its owner is. Idempotent; a dead owner is a no-op."""
        if desc.owner.agent_id == self._peer.agent_id:
            with self._lock:
                entry = self._objects.get(desc.object_id)
                if entry is None:
                    return
                self._check_token(entry.stored.token, desc.token)
            self._free(entry)
            return
        request = messages["ObjectRequest"](object_id=desc.object_id, token=desc.token)
        try:
            self._ask(desc.owner, "Free", request, "StatusReply", timeout_s=timeout_s or self.config.rpc_timeout_s)
        except (PeerLostError, OwnerDiedError, ObjectFreedError) as e:
            logger.debug("free of object %s: %s", desc.object_id.hex(), e)

    def _free(self, entry: _Entry) -> None:
        stored = entry.stored
        with self._lock:
            if self._objects.pop(stored.object_id, None) is None:
                return
            self._tombstones[stored.object_id] = stored.token
            while len(self._tombstones) > _TOMBSTONES:
                self._tombstones.popitem(last=False)
        for transport in list(self._transports.values()):
            try:
                transport.release(stored)
            except Exception:
                logger.warning("transport %s failed to release an object", transport.name, exc_info=True)
        stored.tensors = []

    def owned_objects(self) -> int:
        """How many objects this process owns right now."""
        with self._lock:
            return len(self._objects)

    def owned_sharing(self, storage_ptrs: frozenset[int]) -> int:
        """How many owned objects hold a tensor stored at one of ``storage_ptrs``
        (``untyped_storage().data_ptr()``): the producer's ``wait_tensor_freed`` polls it."""
        with self._lock:
            return sum(
                any(t.untyped_storage().data_ptr() in storage_ptrs for t in e.stored.tensors)
                for e in self._objects.values()
            )

    def owned_nbytes(self) -> int:
        with self._lock:
            return sum(e.stored.nbytes for e in self._objects.values())

    # ------------------------------------------------------------------ references (both sides)

    def ref_detached(self, desc: ObjectDescriptor) -> None:
        """A local reference object was garbage-collected (finalizer; never raises)."""
        if self._closed.is_set():
            return
        if desc.owner.agent_id == self._peer.agent_id:
            with self._lock:
                entry = self._owned_entry(desc)
                if entry is None:
                    return
                entry.local_refs -= 1
                free = entry.unreferenced
            if free:
                self._free(entry)
            return
        with self._lock:
            held = self._held.get(desc.object_id)
            if held is None:
                return
            held.count -= 1
            if held.count > 0:
                return
            del self._held[desc.object_id]
        for transport in list(self._transports.values()):
            try:
                transport.forget_object(desc.object_id)  # close mappings before the owner may free
            except Exception:
                logger.debug("transport %s failed to forget an object", transport.name, exc_info=True)
        self._send(held.owner, HolderOpKind.RELEASE, desc.object_id, desc.token)

    def holds(self, object_id: bytes) -> bool:
        with self._lock:
            return object_id in self._held

    def ref_pickled(self, desc: ObjectDescriptor) -> bytes:
        """A reference is leaving this process: pin its object until the receiver registers."""
        pin_id = secrets.token_bytes(12)
        self.announce_pin(desc, pin_id)
        return pin_id

    def announce_pin(self, desc: ObjectDescriptor, pin_id: bytes) -> None:
        """Pin ``desc``'s object under ``pin_id`` (a reference travels under it)."""
        if desc.owner.agent_id == self._peer.agent_id:
            with self._lock:
                entry = self._owned_entry(desc)
                if entry is not None:
                    self._apply_holder_op(entry, HolderOpKind.PIN, self._peer.agent_id, pin_id, time.monotonic())
        else:
            self._send(desc.owner, HolderOpKind.PIN, desc.object_id, desc.token, pin_id)

    def consume_pin(self, desc: ObjectDescriptor, pin_id: bytes) -> None:
        """Drop the transit pin ``pin_id`` without registering as a holder (nobody received it)."""
        if desc.owner.agent_id != self._peer.agent_id:
            self._send(desc.owner, HolderOpKind.UNPIN, desc.object_id, desc.token, pin_id)
            return
        with self._lock:
            entry = self._owned_entry(desc)
            if entry is None:
                return
            self._apply_holder_op(entry, HolderOpKind.UNPIN, self._peer.agent_id, pin_id, time.monotonic())
            free = entry.unreferenced
        if free:
            self._free(entry)

    def ref_attached(self, desc: ObjectDescriptor, pin_id: bytes = b"") -> None:
        """A reference object was created in this process (by ``put``, or by unpickling with
        the ``pin_id`` it travelled under): count it, register as holder, consume the pin."""
        if desc.owner.agent_id == self._peer.agent_id:
            with self._lock:
                entry = self._owned_entry(desc)
                if entry is None:
                    return
                entry.local_refs += 1
                self._apply_holder_op(entry, HolderOpKind.UNPIN, self._peer.agent_id, pin_id, time.monotonic())
            return
        with self._lock:
            held = self._held.get(desc.object_id)
            first = held is None
            if first:
                held = self._held[desc.object_id] = _Held(desc.owner, desc.token)
            held.count += 1
        kind = HolderOpKind.REGISTER if first else HolderOpKind.UNPIN
        if first or pin_id:
            self._send(desc.owner, kind, desc.object_id, desc.token, pin_id)

    # ------------------------------------------------------------------ holder messages

    def _send(self, owner: PeerInfo, kind: HolderOpKind, object_id: bytes, token: bytes, pin_id: bytes = b"") -> None:
        self._outbox.send(owner, kind, object_id, token, pin_id)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued holder message was sent; False on timeout."""
        return self._outbox.flush(timeout_s)

    def handle_holders(self, request: Any) -> Any:
        sender = decode_peer(request.sender)
        now = time.monotonic()
        applied = rejected = 0
        to_free: list[_Entry] = []
        with self._lock:
            self._holder_peers[sender.agent_id] = sender
            self._holder_seen[sender.agent_id] = now
            for op in request.ops:
                entry = self._objects.get(op.object_id)
                valid_kind = op.kind in HolderOpKind._value2member_map_
                if entry is None or not valid_kind or not hmac.compare_digest(entry.stored.token, op.token):
                    rejected += 1
                    continue
                applied += 1
                self._apply_holder_op(entry, HolderOpKind(op.kind), sender.agent_id, op.pin_id, now)
                to_free.append(entry)
        for entry in to_free:
            with self._lock:
                free = entry.stored.object_id in self._objects and entry.unreferenced
            if free:
                self._free(entry)
        return messages["HolderReply"](applied=applied, rejected=rejected)

    def _apply_holder_op(self, entry: _Entry, kind: HolderOpKind, holder: str, pin_id: bytes, now: float) -> None:
        """Owner, under the lock: apply one holder operation to ``entry``."""
        expiry = now + self._config.transit_ttl_s
        if kind is HolderOpKind.REGISTER:
            entry.holders.add(holder)
        elif kind is HolderOpKind.RELEASE:
            entry.holders.discard(holder)
        elif kind is HolderOpKind.PIN and self._early_unpins.pop(pin_id, None) is None:
            entry.pins[pin_id] = expiry
        if kind in (HolderOpKind.REGISTER, HolderOpKind.UNPIN) and pin_id and entry.pins.pop(pin_id, None) is None:
            self._early_unpins[pin_id] = expiry  # the pin's PIN message is still on its way

    def _reap_loop(self) -> None:
        while not self._closed.wait(self.config.holder_check_interval_s):
            try:
                self._reap()
            except Exception:
                logger.warning("holder check failed", exc_info=True)

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            peers = dict(self._holder_peers)
        dead = {agent_id for agent_id, peer in peers.items() if not self._holder_alive(peer, now)}
        to_free = []
        with self._lock:
            holding = set().union(*(e.holders for e in self._objects.values()))
            for agent_id in dead | (set(self._holder_peers) - holding):  # exited, or holds nothing now
                self._holder_peers.pop(agent_id, None)
                self._holder_seen.pop(agent_id, None)
            for entry in self._objects.values():
                expired = [p for p, expiry in entry.pins.items() if expiry <= now]
                for pin_id in expired:
                    del entry.pins[pin_id]
                if expired:
                    logger.info(
                        "object %s: %d reference(s) in transit were never received; unpinned",
                        entry.stored.object_id.hex(),
                        len(expired),
                    )
                if dead & entry.holders:
                    entry.holders -= dead
                if (expired or dead) and entry.unreferenced:
                    to_free.append(entry)
            for pin_id in [p for p, expiry in self._early_unpins.items() if expiry <= now]:
                del self._early_unpins[pin_id]
        for entry in to_free:
            self._free(entry)
        if dead:
            logger.info("released the holds of %d exited process(es)", len(dead))
            for agent_id in dead:
                self._forget_peer(agent_id)

    def _forget_peer(self, agent_id: str) -> None:
        self._peer_setup.forget(agent_id)
        for transport in list(self._transports.values()):
            try:
                transport.forget_peer(agent_id)
            except Exception:
                logger.warning("transport %s failed to forget agent %s", transport.name, agent_id, exc_info=True)

    def _holder_alive(self, peer: PeerInfo, now: float) -> bool:
        if peer.same_machine(self._peer):
            return topology.process_alive(peer.pid, peer.start_time)
        try:
            self._client.call(self._address(peer), "Ping", messages["PingRequest"](), "PingReply", timeout_s=1.0)
            with self._lock:
                self._holder_seen[peer.agent_id] = now
            return True
        except grpc.RpcError:
            return now - self._holder_seen.get(peer.agent_id, now) < self.config.holder_lost_after_s

    # ------------------------------------------------------------------ control service handlers

    def handle_ping(self, request: Any) -> Any:
        return messages["PingReply"](peer=encode_peer(self._peer))

    def _owned_entry(self, desc: ObjectDescriptor) -> _Entry | None:
        """Owner, under the lock: the entry ``desc`` names, if its token matches (a reference
        forged in this very process gets nothing either)."""
        entry = self._objects.get(desc.object_id)
        if entry is None or not hmac.compare_digest(entry.stored.token, desc.token):
            return None
        return entry

    def _lookup(self, object_id: bytes, token: bytes) -> _Entry:
        """The live entry for ``object_id`` if ``token`` matches, else a mapped error."""
        with self._lock:
            entry = self._objects.get(object_id)
            if entry is not None:
                self._check_token(entry.stored.token, token)
                return entry
            freed_token = self._tombstones.get(object_id)
        if freed_token is not None:
            self._check_token(freed_token, token)
            raise ObjectFreedError(f"object {object_id.hex()} was freed by its owner (agent {self._peer.agent_id})")
        raise ObjectFreedError(
            f"object {object_id.hex()} is unknown to its owner (agent {self._peer.agent_id}): "
            "freed long ago, or the reference was forged"
        )

    def _lookup_for_peer(self, request: Any) -> _Entry:
        """``_lookup`` for a control-service request (its errors become statuses in ``control``)."""
        return self._lookup(request.object_id, request.token)

    @staticmethod
    def _check_token(expected: bytes, given: bytes) -> None:
        if not hmac.compare_digest(expected, given):
            raise PermissionDeniedError("wrong capability token for this object")

    def handle_status(self, request: Any) -> Any:
        try:
            self._lookup(request.object_id, request.token)
            state = ObjectState.LIVE
        except ObjectFreedError:
            state = ObjectState.FREED
        return messages["StatusReply"](state=int(state))

    def handle_free(self, request: Any) -> Any:
        try:
            entry = self._lookup(request.object_id, request.token)
        except ObjectFreedError:
            return messages["StatusReply"](state=int(ObjectState.FREED))
        self._free(entry)
        return messages["StatusReply"](state=int(ObjectState.FREED))

    def handle_export(self, request: Any) -> Any:
        entry = self._lookup_for_peer(request)
        return messages["ExportReply"](handle=self._export_on_request(entry, request.transport))

    def request_export(self, request: FetchRequest, transport: str) -> bytes:
        """Consumer: ask the owner to export the object for ``transport`` (forced, no handle)."""
        message = messages["TransferRequest"](object_id=request.object_id, token=request.token, transport=transport)
        timeout_s = max(0.05, min(request.remaining_s(), self._config.rpc_timeout_s))
        return self._ask(request.owner, "Export", message, "ExportReply", timeout_s=timeout_s).handle

    def handle_transfer(self, request: Any) -> Iterator[bytes]:
        entry = self._lookup_for_peer(request)
        transport = self._transports.get(request.transport)
        if transport is None or transport.capabilities.one_sided:
            raise InvalidRequestError(f"transport {request.transport!r} cannot serve two-sided transfers here")
        return self._serving(transport.serve(entry.stored, request.params))

    def handle_connect(self, request: Any) -> Any:
        transport = self._transports.get(request.transport)
        if transport is None or transport.capabilities.one_sided:
            raise InvalidRequestError(f"transport {request.transport!r} takes no connections here")
        try:
            answer = transport.accept(decode_peer(request.sender), request.payload)
        except TensorwireError as e:
            raise TransferAbortedError(f"{request.transport}: accepting a connection failed: {e}") from None
        return messages["ConnectReply"](payload=answer)

    def handle_rendezvous(self, request: Any) -> Any:
        if len(request.value) > _RENDEZVOUS_MAX_VALUE or not request.group or not request.key:
            raise InvalidRequestError("malformed rendezvous key")
        self._rendezvous_put(request.group, request.key, request.value)
        return messages["RendezvousReply"]()

    def _serving(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """Count a served stream while it runs (it ends when done, failed, or cancelled)."""
        with self._lock:
            self._serving_now += 1
        try:
            yield from chunks
        finally:
            with self._lock:
                self._serving_now -= 1

    def local_object(self, object_id: bytes, token: bytes) -> StoredObject:
        return self._lookup(object_id, token).stored

    # ------------------------------------------------------------------ consumer side

    def _address(self, peer: PeerInfo) -> str:
        if peer.same_node(self._peer) and peer.same_machine(self._peer) and peer.unix_address:
            return peer.unix_address
        return peer.tcp_address

    def peer_may_be_alive(self, peer: PeerInfo) -> bool:
        return not peer.same_machine(self._peer) or topology.process_alive(peer.pid, peer.start_time)

    def _owner_error(self, owner: PeerInfo, error: Exception) -> Exception:
        """Turn a lost-peer error into ``OwnerDiedError`` when the owner is known to have exited."""
        if isinstance(error, (PeerLostError, TransferTimeoutError)) and not self.peer_may_be_alive(owner):
            self._client.drop(self._address(owner))
            return OwnerDiedError(
                f"the owner of this object (pid {owner.pid} on {owner.hostname}, agent {owner.agent_id}) has exited; "
                "its tensors are gone"
            )
        return error

    def connect(
        self, peer: PeerInfo, transport: str, payload: bytes, *, timeout_s: float, concurrently: Callable[[], None]
    ) -> bytes:
        message = messages["ConnectRequest"](transport=transport, sender=encode_peer(self._peer), payload=payload)
        what = f"{transport} connection to agent {peer.agent_id}"
        try:
            future = self._client.call_async(
                self._address(peer), "Connect", message, "ConnectReply", timeout_s=max(0.05, timeout_s)
            )
        except grpc.RpcError as e:
            raise self._owner_error(peer, map_rpc_error(e, what)) from None
        try:
            concurrently()
        except BaseException:
            future.cancel()
            raise
        try:
            return future.result().payload
        except grpc.RpcError as e:
            raise self._owner_error(peer, map_rpc_error(e, what)) from None

    def _rendezvous_put(self, group: str, key: str, value: bytes) -> None:
        with self._rendezvous_changed:
            self._rendezvous.setdefault(group, {})[key] = value
            self._rendezvous.move_to_end(group)
            while len(self._rendezvous) > _RENDEZVOUS_MAX_GROUPS:
                self._rendezvous.popitem(last=False)
            self._rendezvous_changed.notify_all()

    def rendezvous_set(self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float) -> None:
        self._rendezvous_put(group, key, value)
        self.rendezvous_push(peer, group, key, value, timeout_s=timeout_s)

    def rendezvous_push(self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float) -> None:
        """Set ``key`` in ``peer``'s rendezvous table only (this agent's own is left alone)."""
        if peer.agent_id == self._peer.agent_id:
            self._rendezvous_put(group, key, value)
            return
        message = messages["RendezvousRequest"](group=group, key=key, value=value)
        self._ask(peer, "Rendezvous", message, "RendezvousReply", timeout_s=timeout_s)

    def rendezvous_push_async(
        self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float
    ) -> Callable[[], None]:
        """Start :meth:`rendezvous_push`; the returned function waits for it (and raises its
        error). Lets a sender tell several peers at once."""
        if peer.agent_id == self._peer.agent_id:
            self._rendezvous_put(group, key, value)
            return lambda: None
        message = messages["RendezvousRequest"](group=group, key=key, value=value)
        try:
            future = self._client.call_async(
                self._address(peer), "Rendezvous", message, "RendezvousReply", timeout_s=timeout_s
            )
        except grpc.RpcError:
            future = None

        def wait() -> None:
            try:
                if future is not None:
                    future.result()
                    return
            except grpc.RpcError:
                pass
            self.rendezvous_push(peer, group, key, value, timeout_s=timeout_s)  # retried once, errors mapped

        return wait

    def rendezvous_get(self, group: str, key: str, *, timeout_s: float) -> bytes:
        return self._rendezvous_wait(group, key, timeout_s, take=False)

    def rendezvous_take(self, group: str, key: str, *, timeout_s: float) -> bytes:
        """Like :meth:`rendezvous_get`, and remove the key (a message consumed once)."""
        return self._rendezvous_wait(group, key, timeout_s, take=True)

    def _rendezvous_wait(self, group: str, key: str, timeout_s: float, *, take: bool) -> bytes:
        deadline = time.monotonic() + timeout_s
        with self._rendezvous_changed:
            while True:
                table = self._rendezvous.get(group, {})
                value = table.pop(key, None) if take else table.get(key)
                if value is not None:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"rendezvous {group}: key {key!r} not set before the deadline")
                self._rendezvous_changed.wait(left)

    def rendezvous_forget(self, group: str) -> None:
        with self._lock:
            self._rendezvous.pop(group, None)

    def check_owner(self, request: FetchRequest) -> None:
        owner = request.owner
        if not self.peer_may_be_alive(owner):
            raise self._owner_error(owner, PeerLostError("owner exited"))
        status_request = messages["ObjectRequest"](object_id=request.object_id, token=request.token)
        timeout_s = max(0.05, min(request.remaining_s(), self.config.rpc_timeout_s))
        reply = self._ask(owner, "Status", status_request, "StatusReply", timeout_s=timeout_s)
        if reply.state != ObjectState.LIVE:
            raise ObjectFreedError(f"object {request.object_id.hex()} was freed by its owner (agent {owner.agent_id})")

    def _ask(self, owner: PeerInfo, method: str, request: Any, reply_type: str, *, timeout_s: float) -> Any:
        """An idempotent call to ``owner``'s agent: a dropped connection is retried once on a
        new connection within the deadline; errors come back as tensorwire errors."""
        deadline = time.monotonic() + timeout_s
        address = self._address(owner)
        for attempt in (1, 2):
            try:
                left = max(0.05, deadline - time.monotonic())
                return self._client.call(address, method, request, reply_type, timeout_s=left)
            except grpc.RpcError as e:
                retry = attempt == 1 and e.code() == grpc.StatusCode.UNAVAILABLE and self.peer_may_be_alive(owner)
                if retry and deadline - time.monotonic() > 0.1:
                    logger.debug("%s to %s: connection dropped, retrying once", method, owner.agent_id)
                    self._client.drop(address)
                    time.sleep(0.05)
                    continue
                raise self._owner_error(owner, map_rpc_error(e, f"{method} call to agent {owner.agent_id}")) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def open_stream(self, request: FetchRequest, transport: str, params: bytes) -> Iterator[bytes]:
        """Consumer: a two-sided transfer's stream. Reading is idempotent, so a connection
        dropped before the first chunk arrived is retried once on a new connection."""
        message = messages["TransferRequest"](
            object_id=request.object_id,
            token=request.token,
            transport=transport,
            params=params,
            sender=encode_peer(self._peer),
        )
        what = f"{transport} transfer of object {request.object_id.hex()} from agent {request.owner.agent_id}"
        address = self._address(request.owner)
        for attempt in (1, 2):
            received = False
            stream = self._client.stream(address, message, timeout_s=max(0.05, request.remaining_s()))
            try:
                for chunk in stream:
                    received = True
                    yield chunk
                return
            except grpc.RpcError as e:
                retry = attempt == 1 and not received and e.code() == grpc.StatusCode.UNAVAILABLE
                if retry and self.peer_may_be_alive(request.owner) and request.remaining_s() > 0.1:
                    logger.debug("%s: connection dropped before data, retrying once", what)
                    self._client.drop(address)
                    time.sleep(0.05)
                    continue
                raise self._owner_error(request.owner, map_rpc_error(e, what)) from None
            finally:
                stream.cancel()

    def fetch(
        self,
        desc: ObjectDescriptor,
        handles: dict[str, bytes],
        *,
        dst: Sequence[torch.Tensor | None] | None,
        targets: Sequence[torch.device] | None = None,
        transport: str = "",
        view: bool = False,
        timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], TransferRecord]:
        """Consumer: the object's tensors as host (or local) tensors, and how they came.

        Args:
            desc: The object's descriptor.
            handles: Export handles carried by the reference.
            dst: Contiguous tensors to fill (matching ``desc.metas``; None entries, or None,
                to allocate). Ignored for zero-copy views. A CUDA tensor is filled directly
                only by transports that write CUDA memory; otherwise a host tensor is returned
                and the caller copies.
            targets: Where the caller wants each tensor; transports that write CUDA memory
                receive straight onto a CUDA target (default: the CPU).
            transport: Forced transport name; "" uses ``TENSORWIRE_TRANSPORT`` or the selector.
            view: Prefer zero-copy views (same process: the producer's tensors; shm: a
                copy-on-write mapping) over a private copy.
            timeout_s: Deadline of the whole fetch (default ``Config.timeout_s``).
        """
        timeout_s = self.config.timeout_s if timeout_s is None else validate_timeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        forced = transport or self.config.transport
        if forced:
            registry.get_transport_class(forced)  # unknown names: "did you mean"
        if registry.version() != self._registry_version:
            self._refresh_transports()
        summary = selector.ObjectSummary(
            nbytes=desc.nbytes,
            memory=frozenset(m.memory for m in desc.metas) or frozenset({MemoryKind.HOST}),
            exported=frozenset(handles),
            foreign_memory=any(m.memory is MemoryKind.CUDA and m.kind in _FOREIGN_KINDS for m in desc.metas),
            src_devices=frozenset(m.device_uuid for m in desc.metas if m.device_uuid),
            dst_devices=frozenset(topology.cuda_uuid(t.index or 0) for t in (targets or ()) if t.type == "cuda"),
        )
        selection = self._select(desc.owner, summary, forced)
        if not selection.choices:
            hint = " (forced by argument or TENSORWIRE_TRANSPORT)" if forced else ""
            raise NoTransportError(f"cannot fetch object {desc.object_id.hex()}{hint}: {selection.reason}")
        request = FetchRequest(desc.object_id, desc.token, desc.owner, desc.metas, desc.packed_nbytes, None, deadline)
        errors: list[str] = []
        names = [c.transport for c in selection.choices]
        # Bytes that travel inside the reference stay readable when the owner no longer has
        # them (it does not track such objects once they left, even when the reference comes
        # back to it and the selector ranks "local" first): the last resort, forced or not.
        carriers = [n for n in handles if n != forced and n in self._transports and self._capabilities[n].carries_value]
        inline_rescue = bool(carriers)
        names += [n for n in carriers if n not in names]
        for name in names:
            instance = self._transports[name]
            attempt = replace(request, handle=handles.get(name))
            start = time.perf_counter()
            try:
                if time.monotonic() >= deadline:
                    raise TransferTimeoutError(
                        f"fetch of object {desc.object_id.hex()} not started before its deadline ({timeout_s} s)"
                    )
                if attempt.handle is None and instance.capabilities.needs_export:
                    attempt = replace(attempt, handle=self.request_export(attempt, name))
                if instance.capabilities.peer_setup:
                    self._peer_setup.ensure(instance, desc.owner)
                if view and instance.capabilities.zero_copy_view:
                    tensors, zero_copy = instance.view(attempt), True
                    if instance.capabilities.needs_device_access:
                        self._hold_while_alive(desc, tensors)
                else:
                    tensors = _destinations(desc.metas, dst, targets, instance.capabilities)
                    instance.fetch(attempt, tensors)
                    zero_copy = False
            except (ObjectFreedError, OwnerDiedError, PeerLostError) as e:
                if inline_rescue and name not in carriers:
                    errors.append(f"{name}: {e}")
                    continue
                if isinstance(e, PeerLostError):
                    raise self._owner_error(desc.owner, e) from e
                raise
            except (PermissionDeniedError, TransferTimeoutError):
                raise
            except TensorwireError as e:
                if forced:
                    raise
                errors.append(f"{name}: {e}")
                self._warn_once(f"fallback:{name}", "transport %s failed (%s); falling back to the next one", name, e)
                continue
            record = TransferRecord(
                transport=name,
                reason=selection.reason if not errors else f"{name} after: {'; '.join(errors)}",
                nbytes=desc.nbytes,
                duration_s=time.perf_counter() - start,
                src=desc.owner.agent_id,
                dst=self._peer.agent_id,
                zero_copy=zero_copy,
            )
            self._record(record)
            return tensors, record
        raise NoTransportError(f"every transport failed for object {desc.object_id.hex()}: {'; '.join(errors)}")

    def _select(self, owner: PeerInfo, summary: selector.ObjectSummary, forced: str) -> selector.Selection:
        """The selector's answer, memoised: it is a pure function of these inputs (and of the
        registry, whose changes reset the memo), and repeated fetches ask the same question."""
        key = (owner, summary, forced, self._registry_version)
        selection = self._selections.get(key)
        if selection is None:
            selection = selector.select(
                owner,
                self._peer,
                summary,
                self._capabilities,
                usable_here=frozenset(self._transports),
                forced=forced,
                costs=self._costs,
                cost_models=self._cost_models,
            )
            if len(self._selections) >= 1024:
                self._selections.clear()
            self._selections[key] = selection
        return selection

    def _hold_while_alive(self, desc: ObjectDescriptor, tensors: list[torch.Tensor]) -> None:
        """Views that map the producer's own allocation hold the object while they live."""
        for tensor in tensors:
            self.ref_attached(desc)
            weakref.finalize(tensor, self.ref_detached, desc)

    def _record(self, record: TransferRecord) -> None:
        with self._lock:
            self._records.append(record)
            counts = self._counters.setdefault(record.transport, [0, 0])
            counts[0] += 1
            counts[1] += record.nbytes
        metrics.notify(record)

    def stats(self) -> dict[str, Any]:
        """Objects owned, holds, and transfers by transport (count, bytes) with recent records."""
        with self._lock:
            return {
                "agent_id": self._peer.agent_id,
                "node_id": self._peer.node_id,
                "objects_owned": len(self._objects),
                "bytes_owned": sum(e.stored.nbytes for e in self._objects.values()),
                "objects_held": len(self._held),
                "holders": len(self._holder_peers),
                "transfers_serving": self._serving_now,
                "transports_usable": list(self._transports),
                "transports_unusable": dict(self._unusable),
                "transfers": {n: {"count": c, "nbytes": b} for n, (c, b) in self._counters.items()},
                "recent": list(self._records),
            }

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key in self._warned:
            logger.debug(message, *args)
            return
        self._warned.add(key)
        warnings.warn(message % args, RuntimeWarning, stacklevel=3)
        logger.warning(message, *args)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Release every owned object and stop the service. Holder releases are flushed first."""
        if self._closed.is_set():
            return
        self.flush(timeout_s=1.0)
        self._closed.set()
        self._outbox.close()
        with self._lock:
            entries = list(self._objects.values())
        for entry in entries:
            self._free(entry)
        # Each step is bounded: a native library whose own shutdown blocks is left behind with
        # a warning, and the process still exits.
        for transport in self._transports.values():
            run_bounded(transport.close, what=f"closing transport {transport.name}")
        run_bounded(lambda: self._server.stop(grace_s=0.2), what="stopping the control service")
        run_bounded(self._client.close, what="closing the control client")


_FOREIGN_KINDS = frozenset({TensorKind.CUPY, TensorKind.DLPACK})  # memory torch did not allocate
_RENDEZVOUS_MAX_GROUPS = 256  # groups being connected at once; older ones are dropped
_RENDEZVOUS_MAX_VALUE = 1024 * 1024  # an announcement of a bucket of many tensors


def _destinations(
    metas: Sequence[TensorMeta],
    dst: Sequence[torch.Tensor | None] | None,
    targets: Sequence[torch.device] | None,
    caps: Capabilities,
) -> list[torch.Tensor]:
    """The tensors a transport fills: the caller's buffers where the transport can write
    their memory, else new tensors on the target (CUDA only for CUDA-capable transports)."""

    def writable(device: torch.device) -> bool:
        return device.type == "cpu" or (device.type == "cuda" and MemoryKind.CUDA in caps.memory)

    result = []
    for i, meta in enumerate(metas):
        given = dst[i] if dst is not None else None
        target = targets[i] if targets else torch.device("cpu")
        if given is not None and writable(given.device):
            result.append(given)
        else:
            device = target if writable(target) else torch.device("cpu")
            result.append(torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device))
    return result


_agent: Agent | None = None
_agent_lock = threading.Lock()
_startup_hooks: list[Callable[[], None]] = []


def add_startup_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` before this process's agent starts (the runtime sets Ray-derived settings)."""
    if hook not in _startup_hooks:
        _startup_hooks.append(hook)


def get_agent() -> Agent:
    """This process's agent, started on first use (and again in a forked child)."""
    global _agent
    agent = _agent
    if agent is not None and agent.pid == os.getpid():
        return agent
    for hook in list(_startup_hooks):
        hook()
    with _agent_lock:
        if _agent is None or _agent.pid != os.getpid():
            _agent = Agent()
        return _agent


def shutdown_agent() -> None:
    """Close this process's agent (it starts again on next use). Owned objects are freed."""
    global _agent
    with _agent_lock:
        agent, _agent = _agent, None
    if agent is not None and agent.pid == os.getpid():
        agent.close()


atexit.register(shutdown_agent)
