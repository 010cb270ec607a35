"""The holder protocol: references counted in each process, holds and pins at the owner, the reaper.

DESIGN.md section 5:

* A process *holds* an object while it has at least one live reference to it, and for
  ``Config.hold_linger_s`` after (at most :data:`LINGER_MAX` such idle holds, of objects of
  :data:`LINGER_MAX_NBYTES` in all; a larger object is let go at once): a reference to it
  received anew meanwhile takes the hold over, with no new ``REGISTER`` and the transports'
  state of the object kept (the reaper lets idle holds go). Holders tell
  the owner with batched, asynchronous ``REGISTER``/``RELEASE`` operations sent in order by
  one background thread (:mod:`tensorwire.transport.agent.outbox`), so a one-sided fetch never
  waits on a control call.
* A reference that leaves a process (pickled) creates a *transit pin* at the owner; the pin
  is consumed when the receiving process registers (or, if nobody ever deserializes it, it
  expires after ``Config.transit_ttl_s``).
* The owner frees an object when it has no local reference, no remote holder and no pin, or
  on ``free()``. Holders on this machine that exit are detected by pid; holders elsewhere
  that stop answering lose their holds after ``Config.holder_lost_after_s``.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorwire.transport.agent.instances import LoadedTransports
from tensorwire.transport.agent.outbox import Outbox
from tensorwire.transport.agent.peer_client import PeerClient
from tensorwire.transport.agent.store import Entry, ObjectStore
from tensorwire.transport.agent.wire import HolderOpKind
from tensorwire.transport.config import Config
from tensorwire.transport.contract import ObjectDescriptor, PeerInfo
from tensorwire.transport.hw import topology

__all__ = ["LINGER_MAX", "LINGER_MAX_NBYTES", "Holders"]

logger = logging.getLogger(__name__)

_HOLDER_KINDS = frozenset(int(k) for k in HolderOpKind)
LINGER_MAX = 64  # idle holds kept at once (the oldest goes first)
LINGER_MAX_NBYTES = 256 << 20  # the idle holds' objects' bytes in all


@dataclass
class _Held:
    """Holder-side bookkeeping of another agent's object referenced in this process."""

    owner: PeerInfo
    token: bytes
    count: int = 0
    idle_since: float | None = None  # no reference left since then: lingering (Config.hold_linger_s)


class Holders:
    """Both sides of the holder protocol for one agent (thread-safe; shares the agent's lock).

    Args:
        lock: The agent's lock.
        store: The agent's objects (the owner side changes their entries).
        transports: The agent's transports (told when objects and peers are forgotten).
        client: The agent's peer client (holder messages, pings of remote holders).
        peer: This process's peer description.
        config: The agent's current settings.
        closed: Set when the agent closes (stops the reaper; no more messages).
    """

    def __init__(
        self,
        *,
        lock: threading.RLock,
        store: ObjectStore,
        transports: LoadedTransports,
        client: PeerClient,
        peer: Callable[[], PeerInfo],
        config: Callable[[], Config],
        closed: threading.Event,
    ) -> None:
        self._lock = lock
        self._store = store
        self._transports = transports
        self._client = client
        self._peer = peer
        self._agent_id = peer().agent_id
        self._config = config
        self._closed = closed
        self._early_unpins: dict[bytes, float] = {}
        self._holder_peers: dict[str, PeerInfo] = {}
        self._holder_seen: dict[str, float] = {}
        self._holder_seq: dict[str, int] = {}  # sender -> number of its last batch applied
        self._held: dict[bytes, _Held] = {}
        self._idle: OrderedDict[bytes, int] = OrderedDict()  # idle holds, oldest first -> their bytes
        self._idle_nbytes = 0
        self._outbox = client.outbox()
        self._reaper = threading.Thread(target=self._reap_loop, name="tensorwire-reaper", daemon=True)

    def start(self) -> None:
        """Start the reaper thread (expired pins, exited holders)."""
        self._reaper.start()

    @property
    def outbox(self) -> Outbox:
        return self._outbox

    def counts(self) -> tuple[int, int]:
        """(objects this process holds elsewhere, processes holding objects of this one)."""
        with self._lock:
            return len(self._held), len(self._holder_peers)

    def holds(self, object_id: bytes) -> bool:
        with self._lock:
            held = self._held.get(object_id)
            return held is not None and held.count > 0  # (count 0: its mappings are being closed)

    # ------------------------------------------------------------------ references

    def _mine(self, desc: ObjectDescriptor) -> bool:
        return desc.owner.agent_id == self._agent_id

    def ref_attached(self, desc: ObjectDescriptor, pin_id: bytes = b"") -> None:
        """A reference object was created in this process (by ``put``, or by unpickling with
        the ``pin_id`` it travelled under): count it, register as holder, consume the pin."""
        if self._mine(desc):
            with self._lock:
                entry = self._store.owned(desc)
                if entry is None:
                    return
                entry.local_refs += 1
                self.apply(entry, HolderOpKind.UNPIN, self._agent_id, pin_id, time.monotonic())
            return
        with self._lock:
            held = self._held.get(desc.object_id)
            first = held is None
            if first:
                held = self._held[desc.object_id] = _Held(desc.owner, desc.token)
            held.count += 1
            if held.idle_since is not None:  # a lingering hold taken over
                held.idle_since = None
                self._idle_nbytes -= self._idle.pop(desc.object_id, 0)
        kind = HolderOpKind.REGISTER if first else HolderOpKind.UNPIN
        if first or pin_id:
            self._send(desc.owner, kind, desc.object_id, desc.token, pin_id)

    def ref_detached(self, desc: ObjectDescriptor) -> None:
        """A local reference object was garbage-collected (finalizer; never raises)."""
        if self._closed.is_set():
            return
        if self._mine(desc):
            with self._lock:
                entry = self._store.owned(desc)
                if entry is None:
                    return
                entry.local_refs -= 1
            self._store.free_if_unreferenced(entry)
            return
        with self._lock:
            held = self._held.get(desc.object_id)
            if held is None:
                return
            held.count -= 1
            if held.count > 0:
                return
            nbytes = desc.nbytes
            if self._config().hold_linger_s > 0 and nbytes <= LINGER_MAX_NBYTES:
                held.idle_since = time.monotonic()
                self._idle[desc.object_id] = nbytes
                self._idle_nbytes += nbytes
                overflow = []
                while len(self._idle) > LINGER_MAX or self._idle_nbytes > LINGER_MAX_NBYTES:
                    oldest, _nbytes = next(iter(self._idle.items()))
                    self._unidle(oldest)
                    overflow.append(oldest)
            else:
                overflow = [desc.object_id]
        for object_id in overflow:
            self._let_go(object_id)

    def _unidle(self, object_id: bytes) -> None:
        """Take ``object_id`` off the idle holds (under the lock)."""
        self._idle_nbytes -= self._idle.pop(object_id, 0)

    def _let_go(self, object_id: bytes) -> None:
        """Release the idle hold of ``object_id`` (no reference left): the transports forget
        it, then the owner is told, unless a reference came back meanwhile."""
        # close mappings before the owner may free (outside the lock: a transport may wait)
        self._transports.each("forget an object", lambda t: t.forget_object(object_id), level=logging.DEBUG)
        with self._lock:
            held = self._held.get(object_id)
            if held is None or held.count > 0:
                return  # a reference came back meanwhile: this process still holds, no RELEASE
            self._unidle(object_id)
            del self._held[object_id]
            # queued under the lock: a REGISTER of a reference that comes back later follows it
            self._send(held.owner, HolderOpKind.RELEASE, object_id, held.token)

    def let_go_idle(self, now: float | None = None) -> int:
        """Release the holds idle for ``Config.hold_linger_s`` or longer (the reaper's tick);
        how many."""
        now = time.monotonic() if now is None else now
        linger = self._config().hold_linger_s
        with self._lock:
            idle = []
            for object_id in self._idle:  # oldest first
                held = self._held.get(object_id)
                if held is not None and held.idle_since is not None and now - held.idle_since < linger:
                    break
                idle.append(object_id)
        for object_id in idle:
            self._let_go(object_id)
        return len(idle)

    def ref_pickled(self, desc: ObjectDescriptor) -> bytes:
        """A reference is leaving this process: pin its object until the receiver registers."""
        pin_id = secrets.token_bytes(12)
        self.announce_pin(desc, pin_id)
        return pin_id

    def announce_pin(self, desc: ObjectDescriptor, pin_id: bytes) -> None:
        """Pin ``desc``'s object under ``pin_id`` (a reference travels under it)."""
        if not self._mine(desc):
            self._send(desc.owner, HolderOpKind.PIN, desc.object_id, desc.token, pin_id)
            return
        with self._lock:
            entry = self._store.owned(desc)
            if entry is not None:
                self.apply(entry, HolderOpKind.PIN, self._agent_id, pin_id, time.monotonic())

    def consume_pin(self, desc: ObjectDescriptor, pin_id: bytes) -> None:
        """Drop the transit pin ``pin_id`` without registering as a holder (nobody received it)."""
        if not self._mine(desc):
            self._send(desc.owner, HolderOpKind.UNPIN, desc.object_id, desc.token, pin_id)
            return
        with self._lock:
            entry = self._store.owned(desc)
            if entry is None:
                return
            self.apply(entry, HolderOpKind.UNPIN, self._agent_id, pin_id, time.monotonic())
        self._store.free_if_unreferenced(entry)

    def _send(self, owner: PeerInfo, kind: HolderOpKind, object_id: bytes, token: bytes, pin_id: bytes = b"") -> None:
        self._outbox.send(owner, kind, object_id, token, pin_id)

    # ------------------------------------------------------------------ owner side

    def receive(self, sender: PeerInfo, ops: Any, seq: int = 0) -> tuple[int, int]:
        """Owner: apply a batch of ``sender``'s holder operations; (applied, rejected).

        ``seq`` numbers the sender's batches to this owner (0: unnumbered, always applied). A
        batch whose number is not above the last one applied is dropped: it is a retry of one
        that arrived, or a call that timed out at the sender and arrives late, after later
        batches (under load it could re-register a holder after its release).
        """
        now = time.monotonic()
        applied = rejected = 0
        touched: list[Entry] = []
        with self._lock:
            self._holder_peers[sender.agent_id] = sender
            self._holder_seen[sender.agent_id] = now
            if seq:
                if seq <= self._holder_seq.get(sender.agent_id, 0):
                    return 0, 0
                self._holder_seq[sender.agent_id] = seq
            for op in ops:
                entry = self._store.get(op.object_id)
                if (
                    entry is None
                    or op.kind not in _HOLDER_KINDS
                    or not hmac.compare_digest(entry.stored.token, op.token)
                ):
                    rejected += 1
                    continue
                applied += 1
                self.apply(entry, HolderOpKind(op.kind), sender.agent_id, op.pin_id, now)
                touched.append(entry)
        for entry in touched:
            self._store.free_if_unreferenced(entry)
        return applied, rejected

    def apply(self, entry: Entry, kind: HolderOpKind, holder: str, pin_id: bytes, now: float) -> None:
        """Owner, under the lock: apply one holder operation to ``entry``."""
        expiry = now + self._config().transit_ttl_s
        if kind is HolderOpKind.REGISTER:
            entry.holders.add(holder)
        elif kind is HolderOpKind.RELEASE:
            entry.holders.discard(holder)
        elif kind is HolderOpKind.PIN and self._early_unpins.pop(pin_id, None) is None:
            entry.pins[pin_id] = expiry
        if kind in (HolderOpKind.REGISTER, HolderOpKind.UNPIN) and pin_id and entry.pins.pop(pin_id, None) is None:
            self._early_unpins[pin_id] = expiry  # the pin's PIN message is still on its way

    # ------------------------------------------------------------------ reaper

    def _reap_loop(self) -> None:
        while not self._closed.wait(self._tick_s()):
            try:
                self.let_go_idle()
                self.reap()
            except Exception:
                logger.warning("holder check failed", exc_info=True)

    def _tick_s(self) -> float:
        """The reaper's period: the holder check's, shorter when holds linger less (50 ms floor)."""
        config = self._config()
        return max(0.05, min(config.holder_check_interval_s, config.hold_linger_s or config.holder_check_interval_s))

    def reap(self) -> None:
        """Owner: drop expired pins and the holds of holders that exited or stopped answering."""
        now = time.monotonic()
        with self._lock:
            peers = dict(self._holder_peers)
        dead = {agent_id for agent_id, peer in peers.items() if not self._holder_alive(peer, now)}
        to_free = []
        with self._lock:
            entries = self._store.entries()
            holding = set().union(*(e.holders for e in entries))
            for agent_id in dead | (set(self._holder_peers) - holding):  # exited, or holds nothing now
                self._holder_peers.pop(agent_id, None)
                self._holder_seen.pop(agent_id, None)
            for agent_id in dead:  # (a live sender keeps its number: a late batch may still come)
                self._holder_seq.pop(agent_id, None)
            for entry in entries:
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
            self._store.free(entry)
        if dead:
            logger.info("released the holds of %d exited process(es)", len(dead))
            for agent_id in dead:
                self._transports.forget_peer(agent_id)

    def _holder_alive(self, peer: PeerInfo, now: float) -> bool:
        if peer.same_machine(self._peer()):
            return topology.process_alive(peer.pid, peer.start_time)
        if self._client.ping(peer, timeout_s=1.0):
            with self._lock:
                self._holder_seen[peer.agent_id] = now
            return True
        return now - self._holder_seen.get(peer.agent_id, now) < self._config().holder_lost_after_s
