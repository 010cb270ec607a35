"""The owner's object store: registered objects, their one-sided exports, and freeing.

An object stays in the store while it has a local reference, a remote holder or a transit
pin (:mod:`tensorwire.transport.agent.holders` keeps those counts on each :class:`Entry`). A freed
object's id is remembered for a while (a *tombstone*) to tell "freed" from "never existed".
"""

from __future__ import annotations

import collections
import hmac
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorwire.errors import ObjectFreedError, PermissionDeniedError, TensorwireError, TransportError
from tensorwire.transport.agent.instances import LoadedTransports
from tensorwire.transport.config import Config
from tensorwire.transport.contract import ObjectDescriptor, StoredObject, Transport
from tensorwire.transport.metadata import facts

__all__ = ["Entry", "ObjectStore", "check_token"]

logger = logging.getLogger(__name__)

_TOMBSTONES = 65536  # freed object ids remembered, to tell "freed" from "never existed"


@dataclass
class Entry:
    """Owner-side bookkeeping of one stored object."""

    stored: StoredObject
    local_refs: int = 0
    holders: set[str] = field(default_factory=set)
    pins: dict[bytes, float] = field(default_factory=dict)  # pin id -> expiry (monotonic)
    handles: dict[str, bytes] | None = None
    handles_across_nodes: bool = False  # whether ``handles`` include the exports for other nodes
    export_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def unreferenced(self) -> bool:
        """No local reference, no holder, no pin: the owner may free it."""
        return self.local_refs <= 0 and not self.holders and not self.pins


def check_token(expected: bytes, given: bytes) -> None:
    """Raise ``PermissionDeniedError`` unless ``given`` is the object's capability token."""
    if not hmac.compare_digest(expected, given):
        raise PermissionDeniedError("wrong capability token for this object")


class ObjectStore:
    """The objects this process owns (thread-safe; shares the agent's lock).

    Args:
        lock: The agent's lock (holder bookkeeping changes entries under it too).
        transports: The agent's transports (exports and releases).
        config: The agent's current settings.
        warn_once: Warns once per key (a failed export), then logs at debug level.
        agent_id: This agent's id, for messages.
    """

    def __init__(
        self,
        *,
        lock: threading.RLock,
        transports: LoadedTransports,
        config: Callable[[], Config],
        warn_once: Callable[..., None],
        agent_id: str,
    ) -> None:
        self._lock = lock
        self._transports = transports
        self._config = config
        self._warn_once = warn_once
        self._agent_id = agent_id
        self._objects: dict[bytes, Entry] = {}
        self._tombstones: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()

    def add(self, stored: StoredObject) -> None:
        """Producer: keep ``stored`` under its object id."""
        with self._lock:
            self._objects[stored.object_id] = Entry(stored)

    def get(self, object_id: bytes) -> Entry | None:
        """The live entry of ``object_id`` (no token check: the caller checks)."""
        with self._lock:
            return self._objects.get(object_id)

    def owned(self, desc: ObjectDescriptor) -> Entry | None:
        """The entry ``desc`` names, if its token matches (a reference forged in this very
        process gets nothing either)."""
        with self._lock:
            entry = self._objects.get(desc.object_id)
        if entry is None or not hmac.compare_digest(entry.stored.token, desc.token):
            return None
        return entry

    def lookup(self, object_id: bytes, token: bytes) -> Entry:
        """The live entry for ``object_id`` if ``token`` matches.

        Raises:
            ObjectFreedError: Freed, or never known here.
            PermissionDeniedError: Wrong token.
        """
        with self._lock:
            entry = self._objects.get(object_id)
            if entry is not None:
                check_token(entry.stored.token, token)
                return entry
            freed_token = self._tombstones.get(object_id)
        if freed_token is not None:
            check_token(freed_token, token)
            raise ObjectFreedError(f"object {object_id.hex()} was freed by its owner (agent {self._agent_id})")
        raise ObjectFreedError(
            f"object {object_id.hex()} is unknown to its owner (agent {self._agent_id}): "
            "freed long ago, or the reference was forged"
        )

    def entries(self) -> list[Entry]:
        """A snapshot of every live entry."""
        with self._lock:
            return list(self._objects.values())

    def is_live(self, entry: Entry) -> bool:
        with self._lock:
            return self._objects.get(entry.stored.object_id) is entry

    def count(self) -> int:
        with self._lock:
            return len(self._objects)

    # Walks go over a snapshot: a finalizer run in the loop (it allocates) may free an entry.
    def nbytes(self) -> int:
        return sum(e.stored.nbytes for e in self.entries())

    def sharing(self, storage_ptrs: frozenset[int]) -> int:
        """How many entries hold a tensor stored at one of ``storage_ptrs``."""
        return sum(
            any(t.untyped_storage().data_ptr() in storage_ptrs for t in e.stored.tensors) for e in self.entries()
        )

    # ------------------------------------------------------------------ exports

    def export_handles(self, desc: ObjectDescriptor, *, across_nodes: bool = True) -> dict[str, bytes]:
        """Producer, when a reference leaves the process: handles of one-sided transports.

        A transport that carries values (inline) is tried first; when it carries the bytes
        no other export is made. Exports are made once per object and cached. A failed export
        is warned about and skipped: the consumer then falls back to a two-sided transport.
        ``across_nodes=False`` (every reader is on this node): a transport that also reaches
        other nodes exports only when none limited to this node can (a NIXL agent, which
        takes a while to start, is not made for readers that use shared memory).
        """
        entry = self.owned(desc)
        if entry is None:
            return {}
        with entry.export_lock:
            if entry.handles is None or (across_nodes and not entry.handles_across_nodes):
                entry.handles = {**(entry.handles or {}), **self._export_all(entry, across_nodes, entry.handles or {})}
                entry.handles_across_nodes = across_nodes
            return dict(entry.handles)

    def export_nbytes(self, desc: ObjectDescriptor) -> int:
        """Producer: the bytes the transports hold for the exports of ``desc``'s object."""
        entry = self.owned(desc)
        if entry is None:
            return 0
        return sum(t.export_nbytes(entry.stored) for t in self._transports.usable().values())

    def _export_all(self, entry: Entry, across_nodes: bool, made: dict[str, bytes]) -> dict[str, bytes]:
        handles: dict[str, bytes] = {}
        memory = facts(entry.stored.metas).memory if entry.stored.metas else frozenset()
        transports = self._transports.usable()
        if any(n in transports and transports[n].capabilities.carries_value for n in made):
            return handles  # the bytes travel in the reference already: no other handle needed
        exporters = [
            n
            for n, t in transports.items()
            if t.capabilities.needs_export and not t.capabilities.export_per_consumer and n not in made
        ]
        if not across_nodes and any(
            not transports[n].capabilities.cross_node and memory <= transports[n].capabilities.memory for n in exporters
        ):
            exporters = [
                n
                for n in exporters
                if not transports[n].capabilities.cross_node or transports[n].capabilities.carries_value
            ]
        exporters.sort(key=lambda n: not transports[n].capabilities.carries_value)
        for name in exporters:
            transport = transports[name]
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
            if self._released_if_freed(entry, transport):
                return {}
            if handle is not None:
                handles[name] = handle
                if transport.capabilities.carries_value:
                    break  # the bytes travel in the reference: no other handle needed
        return handles

    def can_export(self, name: str) -> bool:
        """Whether transport ``name`` is usable here and exports handles."""
        transport = self._transports.get(name)
        return transport is not None and (
            transport.capabilities.needs_export or transport.capabilities.export_per_consumer
        )

    def export_for(self, entry: Entry, name: str) -> bytes:
        """Producer: export ``entry`` for transport ``name`` now (a consumer asked).

        Raises:
            TransportError: The transport failed, or declined this object.
        """
        transport = self._transports[name]
        per_consumer = transport.capabilities.export_per_consumer
        with entry.export_lock:
            if not per_consumer and entry.handles is not None and name in entry.handles:
                return entry.handles[name]
            try:
                handle = transport.export(entry.stored)
            except TensorwireError as e:
                raise TransportError(f"{name} export failed: {e}") from None
            if self._released_if_freed(entry, transport):
                raise ObjectFreedError(f"object {entry.stored.object_id.hex()} was freed while it was exported")
            if handle is None:
                limit = f"; {name} takes at most {self._config().inline_max_nbytes} (TENSORWIRE_INLINE_NBYTES)"
                raise TransportError(
                    f"{name} declined to export this object of {entry.stored.nbytes} bytes"
                    f"{limit if transport.capabilities.carries_value else ''}"
                )
            if not per_consumer:  # a per-consumer handle is this consumer's alone
                entry.handles = {**(entry.handles or {}), name: handle}
            return handle

    def _released_if_freed(self, entry: Entry, transport: Transport) -> bool:
        """After an export: if the entry was freed meanwhile (by another thread, or by a
        finalizer run inside the export), its release may have come before the export kept
        its state; release again (releases are idempotent) so nothing stays offered."""
        if self.is_live(entry):
            return False
        transport.release(entry.stored)
        return True

    # ------------------------------------------------------------------ freeing

    def free(self, entry: Entry) -> None:
        """Drop ``entry`` now: every transport releases it, its tensors are let go."""
        stored = entry.stored
        with self._lock:
            if self._objects.pop(stored.object_id, None) is None:
                return
            self._tombstones[stored.object_id] = stored.token
            while len(self._tombstones) > _TOMBSTONES:
                self._tombstones.popitem(last=False)
        self._transports.each("release an object", lambda t: t.release(stored))
        stored.tensors = []

    def free_if_unreferenced(self, entry: Entry) -> None:
        """Free ``entry`` if it is still live and nothing references it."""
        with self._lock:
            free = self._objects.get(entry.stored.object_id) is entry and entry.unreferenced
        if free:
            self.free(entry)
