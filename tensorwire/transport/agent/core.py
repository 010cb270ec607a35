"""The per-process agent: one per process, started lazily by :func:`get_agent`.

The agent is the :class:`~tensorwire.transport.contract.TransportContext` of this process's
transports and the object layer the runtime and collectives use. It puts together:

* :mod:`~tensorwire.transport.agent.store`: the objects this process owns and their exports;
* :mod:`~tensorwire.transport.agent.holders`: the holder protocol (holds, transit pins, reaper);
* :mod:`~tensorwire.transport.agent.service`: the answers to other agents' control calls;
* :mod:`~tensorwire.transport.agent.peer_client`: the calls to other agents;
* :mod:`~tensorwire.transport.agent.rendezvous`: the rendezvous mailbox;
* :mod:`~tensorwire.transport.agent.fetch`: fetch dispatch (selection, fallback, destinations);
* :mod:`~tensorwire.transport.agent.instances`: the transports loaded here.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import secrets
import socket
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from tensorwire.errors import ObjectFreedError, OwnerDiedError, PeerLostError
from tensorwire.transport.agent import metrics
from tensorwire.transport.agent.control import ControlServer, cluster_token
from tensorwire.transport.agent.fetch import FetchDispatch, hold_while_alive
from tensorwire.transport.agent.holders import Holders
from tensorwire.transport.agent.instances import LoadedTransports
from tensorwire.transport.agent.metrics import TransferRecord
from tensorwire.transport.agent.peer_client import PeerClient
from tensorwire.transport.agent.rendezvous import Mailbox
from tensorwire.transport.agent.repeat import Repeat
from tensorwire.transport.agent.service import ControlService
from tensorwire.transport.agent.services import AgentServices
from tensorwire.transport.agent.store import ObjectStore, check_token
from tensorwire.transport.agent.wire import ObjectState
from tensorwire.transport.config import Config, socket_dir, validate_timeout
from tensorwire.transport.contract import (
    Capabilities,
    Diagnosis,
    FetchRequest,
    Health,
    ObjectDescriptor,
    PeerInfo,
    StoredObject,
    TensorMeta,
    Transport,
    TransportContext,
)
from tensorwire.transport.host_pool import HostPool
from tensorwire.transport.hw import calibration, topology
from tensorwire.transport.registry import get_transport_class
from tensorwire.transport.shutdown import run_bounded

__all__ = ["Agent", "TransferRecord", "add_startup_hook", "current_agent", "get_agent", "shutdown_agent"]

logger = logging.getLogger(__name__)


class Agent(TransportContext, AgentServices):
    """The per-process agent. Use :func:`get_agent`; do not construct directly in user code."""

    def __init__(self, config: Config | None = None) -> None:
        self._config = config or Config.from_env()
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        self._records: collections.deque[TransferRecord] = collections.deque(maxlen=1000)  # appends: no lock
        self._totals_before = metrics.totals.by_transport()  # the process's, before this agent (stats: its own)
        self._closed = threading.Event()
        self.pid = os.getpid()

        agent_id = secrets.token_hex(8)
        self._peer = PeerInfo(
            agent_id=agent_id,
            node_id=topology.node_id(),
            machine_id=topology.machine_id(),
            hostname=socket.gethostname(),
            pid=self.pid,
            start_time=topology.process_start_time(self.pid),
            devices=topology.visible_devices(),
            gpu_links=topology.gpu_links(),
        )
        self._assemble(cluster_token(), agent_id)
        self._refresh_transports()
        metrics.enable_prometheus()  # when prometheus-client is installed
        self._holders.start()
        logger.debug("agent %s started: %s %s", agent_id, self._server.unix_address, self._server.tcp_address)

    def _assemble(self, token: bytes, agent_id: str) -> None:
        """Create the agent's parts and start its control service."""
        self._client = PeerClient(token=token, peer=lambda: self._peer, config=lambda: self._config)
        self._transports = LoadedTransports(self)
        self._store = ObjectStore(
            lock=self._lock,
            transports=self._transports,
            config=lambda: self._config,
            warn_once=self._warn_once,
            agent_id=agent_id,
        )
        self._holders = Holders(
            lock=self._lock,
            store=self._store,
            transports=self._transports,
            client=self._client,
            peer=lambda: self._peer,
            config=lambda: self._config,
            closed=self._closed,
        )
        self._mailbox = Mailbox()
        self.host_pool = HostPool(self._config.host_pool_nbytes)
        self._service = ControlService(
            lock=self._lock,
            store=self._store,
            holders=self._holders,
            transports=self._transports,
            mailbox=self._mailbox,
            peer=lambda: self._peer,
        )
        self._server = ControlServer(
            self._service,
            token=token,
            unix_path=os.path.join(socket_dir(), f"{agent_id}.sock"),
            tcp_host=self._config.host,
        )
        self._server.start()
        self._peer = replace(self._peer, unix_address=self._server.unix_address, tcp_address=self._server.tcp_address)
        self._dispatch = FetchDispatch(
            transports=self._transports,
            client=self._client,
            peer=lambda: self._peer,
            costs=calibration.load_costs(),  # this machine's `tensorwire bench --calibrate`, if any
            hold=hold_while_alive(self.ref_attached, self.ref_detached),
            record=self._record,
            warn_once=self._warn_once,
            pool=self.host_pool,
        )

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
        """Load newly registered transports and publish the usable ones in ``peer``."""
        self._transports.refresh()
        with self._lock:
            self._peer = replace(self._peer, transports=self._transports.names())

    def _refresh_if_registry_changed(self) -> None:
        if self._transports.stale():
            self._refresh_transports()

    def transports(self) -> dict[str, Transport]:
        """Any caller: the usable transports by registry name (a copy of the agent's table); ones
        registered since the last ``put`` or fetch appear once one of those ran."""
        return self._transports.usable()

    def unusable_transports(self) -> dict[str, str]:
        """Registered transports that cannot run here, with the reason."""
        return self._transports.unusable()

    def capabilities(self) -> dict[str, Capabilities]:
        """Every registered transport's capabilities, by name (usable here or not)."""
        self._refresh_if_registry_changed()
        return dict(self._transports.capabilities)

    def diagnose(self) -> dict[str, list[Diagnosis]]:
        """Each usable transport's ``Transport.diagnose``; one that raises is reported as failed."""
        self._refresh_if_registry_changed()
        found: dict[str, list[Diagnosis]] = {}
        for name, transport in self._transports.usable().items():
            try:
                found[name] = list(transport.diagnose())
            except Exception as e:  # noqa: BLE001 - a broken plug-in must not break doctor
                found[name] = [Diagnosis(name, Health.FAIL, f"diagnose() failed: {type(e).__name__}: {e}")]
        return found

    def staging(self) -> Transport | None:
        """The first usable transport that offers staging rings, or None."""
        self._refresh_if_registry_changed()
        rings = [t for t in self._transports.usable().values() if t.capabilities.staging_rings]
        return rings[0] if rings else None

    def publish_transport_info(self, transport: str, info: str) -> None:
        with self._lock:
            self._peer = self._peer.with_transport_info(transport, info)

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
        self._refresh_if_registry_changed()
        object_id = secrets.token_bytes(16)
        token = secrets.token_bytes(16)
        self._store.add(StoredObject(object_id, token, tensors, metas, packed_nbytes, ready=list(ready or ())))
        return ObjectDescriptor(object_id, token, self._peer, metas, packed_nbytes)

    def export_handles(self, desc: ObjectDescriptor, *, across_nodes: bool = True) -> dict[str, bytes]:
        """Producer, when a reference leaves the process: handles of one-sided transports
        (made once per object; see :meth:`ObjectStore.export_handles`)."""
        return self._store.export_handles(desc, across_nodes=across_nodes)

    def export_nbytes(self, desc: ObjectDescriptor) -> int:
        return self._store.export_nbytes(desc)

    def described_now(self, desc: ObjectDescriptor) -> ObjectDescriptor:
        """Producer: ``desc`` naming this process as it is now, with the connection info its
        transports published since ``put`` (nixl's agent metadata, once its agent is made)."""
        if desc.owner is self._peer or desc.owner.agent_id != self._peer.agent_id:
            return desc
        return replace(desc, owner=self._peer)

    def free(self, desc: ObjectDescriptor, *, timeout_s: float | None = None) -> None:
        """Free the object now, wherever its owner is. Idempotent; a dead owner is a no-op."""
        if desc.owner.agent_id == self._peer.agent_id:
            entry = self._store.get(desc.object_id)
            if entry is None:
                return
            check_token(entry.stored.token, desc.token)
            self._store.free(entry)
            return
        try:
            self._client.free(desc.owner, desc.object_id, desc.token, timeout_s=timeout_s or self._config.rpc_timeout_s)
        except (PeerLostError, OwnerDiedError, ObjectFreedError) as e:
            logger.debug("free of object %s: %s", desc.object_id.hex(), e)

    def owned_objects(self) -> int:
        """How many objects this process owns right now."""
        return self._store.count()

    def owned_sharing(self, storage_ptrs: frozenset[int]) -> int:
        """How many owned objects hold a tensor stored at one of ``storage_ptrs``
        (``untyped_storage().data_ptr()``): the producer's ``wait_tensor_freed`` polls it."""
        return self._store.sharing(storage_ptrs)

    def owned_nbytes(self) -> int:
        return self._store.nbytes()

    def local_object(self, object_id: bytes, token: bytes) -> StoredObject:
        return self._store.lookup(object_id, token).stored

    # ------------------------------------------------------------------ references (both sides)

    def ref_attached(self, desc: ObjectDescriptor, pin_id: bytes = b"") -> None:
        """A reference object was created in this process (by ``put``, or by unpickling with
        the ``pin_id`` it travelled under): count it, register as holder, consume the pin."""
        self._holders.ref_attached(desc, pin_id)

    def ref_detached(self, desc: ObjectDescriptor) -> None:
        """A local reference object was garbage-collected (finalizer; never raises)."""
        self._holders.ref_detached(desc)

    def ref_pickled(self, desc: ObjectDescriptor) -> bytes:
        """A reference is leaving this process: pin its object until the receiver registers."""
        return self._holders.ref_pickled(desc)

    def announce_pin(self, desc: ObjectDescriptor, pin_id: bytes) -> None:
        """Pin ``desc``'s object under ``pin_id`` (a reference travels under it)."""
        self._holders.announce_pin(desc, pin_id)

    def consume_pin(self, desc: ObjectDescriptor, pin_id: bytes) -> None:
        """Drop the transit pin ``pin_id`` without registering as a holder (nobody received it)."""
        self._holders.consume_pin(desc, pin_id)

    def holds(self, object_id: bytes) -> bool:
        return self._holders.holds(object_id)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued holder message was sent; False on timeout."""
        return self._holders.outbox.flush(timeout_s=timeout_s)

    # ------------------------------------------------------------------ reaching peers

    def peer_may_be_alive(self, peer: PeerInfo) -> bool:
        return self._client.may_be_alive(peer)

    def peer_responds(self, peer: PeerInfo, *, timeout_s: float) -> bool:
        return self._client.responds(peer, timeout_s=timeout_s)

    def open_stream(self, request: FetchRequest, transport: str, params: bytes) -> Iterator[bytes]:
        return self._client.stream(request, transport, params)

    def request_export(self, request: FetchRequest, transport: str) -> bytes:
        return self._client.export(request, transport)[0]

    def connect(
        self, peer: PeerInfo, transport: str, payload: bytes, *, timeout_s: float, concurrently: Callable[[], None]
    ) -> bytes:
        return self._client.connect(peer, transport, payload, timeout_s=timeout_s, concurrently=concurrently)

    def check_owner(self, request: FetchRequest) -> None:
        owner = request.owner
        if not self.peer_may_be_alive(owner):
            raise self._client.owner_error(owner, PeerLostError("owner exited"))
        timeout_s = max(0.05, min(request.remaining_s(), self._config.rpc_timeout_s))
        state = self._client.status(owner, request.object_id, request.token, timeout_s=timeout_s)
        if state != ObjectState.LIVE:
            raise ObjectFreedError(f"object {request.object_id.hex()} was freed by its owner (agent {owner.agent_id})")

    # ------------------------------------------------------------------ rendezvous mailbox

    def rendezvous_push(self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float) -> None:
        self.rendezvous_push_async(peer, group, key, value, timeout_s=timeout_s)()  # (a failed try is made again)

    def rendezvous_push_async(
        self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float
    ) -> Callable[[], None]:
        if peer.agent_id == self._peer.agent_id:
            self._mailbox.put(group, key, value)
            return lambda: None
        return self._client.rendezvous_async(peer, group, key, value, timeout_s=timeout_s)

    def rendezvous_get(self, group: str, key: str, *, timeout_s: float) -> bytes:
        return self._mailbox.wait(group, key, timeout_s=timeout_s)

    def rendezvous_take(self, group: str, key: str, *, timeout_s: float) -> bytes:
        return self._mailbox.wait(group, key, timeout_s=timeout_s, take=True)

    def rendezvous_take_any(self, group: str, keys: Sequence[str], *, timeout_s: float) -> tuple[int, bytes]:
        return self._mailbox.take_any(group, keys, timeout_s=timeout_s)

    def rendezvous_forget(self, group: str) -> None:
        self._mailbox.forget(group)

    # ------------------------------------------------------------------ consumer side

    def fetch(
        self,
        desc: ObjectDescriptor,
        handles: dict[str, bytes],
        *,
        dst: Sequence[torch.Tensor | None] | None,
        targets: Sequence[torch.device] | None = None,
        transport: str = "",
        view: bool = False,
        pooled: bool = False,
        timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], TransferRecord]:
        """Consumer (``AgentServices.fetch`` documents it)."""
        forced, timeout_s = self._fetch_options(transport, timeout_s)
        tensors, record, _ = self._dispatch.fetch(
            desc, handles, dst, targets, forced, view=view, pooled=pooled, timeout_s=timeout_s
        )
        return tensors, record

    def fetch_repeatable(
        self,
        desc: ObjectDescriptor,
        handles: dict[str, bytes],
        *,
        dst: Sequence[torch.Tensor],
        targets: Sequence[torch.device] | None = None,
        transport: str = "",
        timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], TransferRecord, Repeat | None]:
        """Consumer (``AgentServices.fetch_repeatable`` documents it)."""
        forced, timeout_s = self._fetch_options(transport, timeout_s)
        return self._dispatch.fetch(
            desc, handles, dst, targets, forced, view=False, pooled=False, timeout_s=timeout_s, repeatable=True
        )

    def _fetch_options(self, transport: str, timeout_s: float | None) -> tuple[str, float]:
        """A fetch's forced transport ("" for none) and time limit; newly registered transports loaded."""
        timeout_s = self._config.timeout_s if timeout_s is None else validate_timeout(timeout_s)
        forced = transport or self._config.transport
        if forced and forced not in self._transports:
            get_transport_class(forced)  # unknown names: "did you mean"
        self._refresh_if_registry_changed()
        return forced, timeout_s

    def _transfers(self) -> dict[str, dict[str, int]]:
        """This agent's fetches by transport: count and bytes."""
        result = {}
        for name, row in metrics.totals.by_transport().items():
            before = self._totals_before.get(name, [0, 0])
            if row[0] > before[0]:
                result[name] = {"count": int(row[0] - before[0]), "nbytes": int(row[1] - before[1])}
        return result

    def _record(self, record: TransferRecord) -> None:
        self._records.append(record)
        metrics.notify(record)

    def stats(self) -> dict[str, Any]:
        """Objects owned, holds, and transfers by transport (count, bytes) with recent records."""
        held, holders = self._holders.counts()
        with self._lock:
            return {
                "agent_id": self._peer.agent_id,
                "node_id": self._peer.node_id,
                "objects_owned": self._store.count(),
                "bytes_owned": self._store.nbytes(),
                "objects_held": held,
                "holders": holders,
                "transfers_serving": self._service.serving_now,
                "transports_usable": list(self._transports.names()),
                "transports_unusable": self._transports.unusable(),
                "transfers": self._transfers(),
                "recent": list(self._records),
                "host_pool": self.host_pool.stats(),
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
        self._holders.let_go_idle(now=float("inf"))  # lingering holds: released with the rest
        self.flush(timeout_s=1.0)
        self._closed.set()
        self._holders.outbox.close()
        for entry in self._store.entries():
            self._store.free(entry)
        # Each step is bounded: a native library whose own shutdown blocks is left behind with
        # a warning, and the process still exits.
        for transport in self._transports.usable().values():
            run_bounded(transport.close, what=f"closing transport {transport.name}")
        run_bounded(lambda: self._server.stop(grace_s=0.2), what="stopping the control service")
        run_bounded(self._client.close, what="closing the control client")
        self.host_pool.close()


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


def current_agent() -> Agent | None:
    """This process's agent if it has started, else None (never starts one; an agent
    inherited from a parent process by ``fork`` is not this process's)."""
    agent = _agent
    return agent if agent is not None and agent.pid == os.getpid() else None


def shutdown_agent() -> None:
    """Close this process's agent (it starts again on next use). Owned objects are freed."""
    global _agent
    with _agent_lock:
        agent, _agent = _agent, None
    if agent is not None and agent.pid == os.getpid():
        agent.close()


atexit.register(shutdown_agent)
