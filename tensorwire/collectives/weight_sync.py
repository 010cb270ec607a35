"""``tw.WeightSync``: push a trainer's weights into N receivers' existing tensors, in buckets.

::

    sync = tw.WeightSync(trainer, rollouts, source="model")   # actors made with @tw.remote
    report = sync.push()                                        # every receiver now holds version 1
    print(report)
    sync.close()                                                # frees the staging memory

How a push runs (every actor is busy in a hidden hook method meanwhile):

* The tensors (``source``: an attribute or method of the trainer giving an ``nn.Module`` or
  a dict of tensors) are cut, in order, into buckets of about ``bucket_bytes``.
* For bucket k the trainer packs the bucket's tensors into slot k % 2 of its staging ring
  (two shared-memory segments kept for the life of the sync, :mod:`.staging`) and tells its
  same-node receivers; receivers on other nodes (and any device memory) get the bucket as an
  announced object of the trainer's agent instead (no pack copy; ucx/gloo read the tensors,
  cuda_ipc maps them). It packs bucket k+1 while they copy bucket k, and reuses a slot only
  after every reader acknowledged it: at most two buckets exist at a time.
* A receiver copies straight into its own tensors (``target``, same layout) out of the slot
  (or receives into them over the transport the selector picks). Nothing else of the model
  is allocated.
* No funnel through the trainer: receivers on the trainer's node all read the same slots;
  each other node has one leader that gets each bucket from the trainer (or from another
  leader, along a binary tree) and serves its node-mates from its own ring.
* Each bucket can carry a checksum (``verify=True``) that receivers check after unpacking.
* Versions: each push is a new version; a receiver records it when every bucket arrived
  (``sync.versions()``, or ``tw.collective.weight_version(name)`` inside the actor).
* A receiver that dies, or fails, is dropped from the rest of the push; the others go on and
  the report lists it. Receivers it relayed to are reported failed too (they are served by
  the trainer from the next push on, when the dead one is left out of the tree).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire.collectives.api import DEFAULT_TIMEOUT_S, call_hook, check_actors, describe_actors
from tensorwire.collectives.channel import Channel, member_from
from tensorwire.collectives.group import broadcast_parents
from tensorwire.collectives.staging import RingReader, StagingRing
from tensorwire.errors import TensorwireError
from tensorwire.runtime.actor import ActorHandle
from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.transport.packing import InOrderGroups, packed_layout
from tensorwire.transport.wire import peer_from_bytes, peer_to_bytes

__all__ = ["SyncReport", "WeightSync", "bucket_plan", "checksum", "weight_version"]

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
_IN_FLIGHT = 2  # buckets published at once by a trainer or a relay (double buffering)
_MASK = (1 << 64) - 1

_versions: dict[str, int] = {}
_versions_lock = threading.Lock()
_sync_ids = itertools.count(1)


# ---------------------------------------------------------------------- pure helpers


def bucket_plan(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Tensor indices cut in order into buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    groups = InOrderGroups(bucket_bytes)
    buckets = [closed for index, size in enumerate(nbytes) if (closed := groups.add(index, size))]
    if rest := groups.rest():
        buckets.append(rest)
    return buckets


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """A 64-bit checksum of the tensors' bytes, in order, computed where they are (GPU or
    host) without a copy of them: position-weighted sums of 64-bit words (or bytes)."""
    total = 0
    for position, tensor in enumerate(tensors, start=1):
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        words = flat.view(torch.uint8)
        if words.numel() % 8 == 0:
            value = int(words.view(torch.int64).sum().item())
        else:
            value = int(words.sum(dtype=torch.int64).item())
        total = (total + position * (value & _MASK) + words.numel()) & _MASK
    return total


def weight_version(name: str = "weights") -> int:
    """Inside a receiver: the version of weight sync ``name`` it holds completely (0: none)."""
    with _versions_lock:
        return _versions.get(name, 0)


def _tensor_list(actor: object, where: str, role: str) -> tuple[list[str], list[torch.Tensor]]:
    """The named tensors of ``actor.<where>`` (a module, a dict of tensors, or a method
    giving either), in a stable order. ``where=""``: the actor's ``state_dict()`` method when
    it has one, else its ``model`` attribute."""
    if where == "":
        where = "state_dict" if callable(getattr(actor, "state_dict", None)) else "model"
    if not isinstance(where, str) or not where:
        raise ValueError(f"{role} must name an attribute or method of the actor")
    if not hasattr(actor, where):
        raise AttributeError(
            f"the {role} actor ({type(actor).__name__}) has no attribute {where!r}; pass {role}=<the attribute or "
            "method that gives an nn.Module or a dict of tensors>"
        )
    value = getattr(actor, where)
    if callable(value) and not isinstance(value, torch.nn.Module):
        value = value()
    if isinstance(value, torch.nn.Module):
        value = value.state_dict(keep_vars=False)
    if not isinstance(value, dict) or not all(isinstance(t, torch.Tensor) for t in value.values()):
        raise TypeError(f"{role} {where!r} gives {type(value).__name__}, not an nn.Module or a dict of tensors")
    names = list(value)
    return names, [value[n].detach() for n in names]


def _layout(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> list[tuple[str, tuple[int, ...], str, int]]:
    return [
        (n, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
        for n, t in zip(names, tensors, strict=True)
    ]


# ---------------------------------------------------------------------- hooks (in the actors)


def layout(actor: object, source: str) -> list[tuple[str, tuple[int, ...], str, int]]:
    """Hook, trainer: (name, shape, dtype, nbytes) of each tensor to send."""
    return _layout(*_tensor_list(actor, source, "source"))


def check_target(actor: object, target: str, expected: list[tuple[str, tuple[int, ...], str, int]]) -> None:
    """Hook, receiver: raise unless ``target`` has exactly the trainer's tensors."""
    mine = _layout(*_tensor_list(actor, target, "target"))
    if mine == expected:
        return
    names = {entry[0] for entry in mine}
    theirs = {entry[0] for entry in expected}
    if names != theirs:
        missing, extra = sorted(theirs - names)[:5], sorted(names - theirs)[:5]
        raise ValueError(
            f"receiver's {target!r} does not match the trainer's tensors: missing {missing}, extra {extra}"
        )
    by_name = {entry[0]: entry for entry in mine}
    for entry in expected:
        if by_name[entry[0]] != entry:
            raise ValueError(f"receiver's tensor {entry[0]!r} is {by_name[entry[0]][1:3]}, the trainer's {entry[1:3]}")
    raise ValueError("receiver's tensors are in another order than the trainer's")


def versions_hook(_actor: object, name: str) -> int:
    return weight_version(name)


# Bucket messages: kind byte, checksum, then the payload. "R": the bucket is in the sender's
# staging slot (payload: slot size, segment name); "O": an announced object (payload: the
# announcement); "A": the sender aborted (payload: why).
_HEADER = struct.Struct("<cQ")
_SLOT = struct.Struct("<Q")


def _message(kind: bytes, check: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind, check) + payload


class _Fanout:
    """A server's side (the trainer, or a node's leader): hand buckets to its children, at
    most ``_IN_FLIGHT`` at once, and drop children that die or fail.

    Children on the server's node read host buckets from its :class:`StagingRing`; the
    others (and device memory) get each bucket as an announced object of the server's agent.
    """

    def __init__(
        self,
        channel: Channel,
        children: Sequence[int],
        spec: dict[str, Any],
        on_done: Callable[[int], None] = lambda _k: None,
    ) -> None:
        self.channel = channel
        self.live = list(children)
        self.failed: dict[int, str] = {}
        self.peak_nbytes = 0
        self.pack_s = 0.0
        self._spec = spec
        me = channel.members[channel.rank].peer
        use_ring = spec["transport"] in ("", "shm")
        self._local = {c for c in children if use_ring and channel.members[c].peer.same_node(me)}
        self.offered = 0  # buckets handed on so far: the children wait for this one next
        self._outstanding: collections.deque[tuple[int, Any, list[int], int]] = collections.deque()
        self._on_done = on_done  # called with k once every child acknowledged bucket k (or none was left)

    def _ring(self) -> StagingRing:
        key = (self._spec["sync_id"], self.channel.rank)
        ring = _rings.get(key)
        if ring is None:
            ring = _rings[key] = StagingRing(runtime_agent().peer, self._spec["slot_nbytes"])
        return ring

    def offer(self, k: int, tensors: Sequence[torch.Tensor], check: int) -> None:
        self.offered = k + 1
        if not self.live:
            self._on_done(k)
            return
        while len(self._outstanding) >= _IN_FLIGHT:
            self._settle_oldest()  # frees the slot and object of bucket k - 2
        start = time.perf_counter()
        host = all(t.device.type == "cpu" for t in tensors)
        ring_readers = [c for c in self.live if c in self._local] if host else []
        object_readers = [c for c in self.live if c not in ring_readers]
        messages_to: dict[int, bytes] = {}
        exported = 0
        if ring_readers:
            ring = self._ring()
            slot = k % _IN_FLIGHT
            ring.write(slot, tensors)
            payload = _SLOT.pack(ring.slot_nbytes) + ring.names[slot].encode()
            messages_to.update(dict.fromkeys(ring_readers, _message(b"R", check, payload)))
        desc = None
        if object_readers:
            same_node = any(self.channel.members[c].node_id == self._node for c in object_readers)
            desc, announcement, exported = self.channel.publish(
                [t if t.is_contiguous() else t.contiguous() for t in tensors], export=same_node
            )
            messages_to.update(dict.fromkeys(object_readers, _message(b"O", check, announcement)))
        self.pack_s += time.perf_counter() - start
        posts = {child: self.channel.post(child, f"b{k}", message) for child, message in messages_to.items()}
        sent = []
        for child, wait in posts.items():
            try:
                wait()
                sent.append(child)
            except TensorwireError as e:
                self._fail(child, f"could not be told of bucket {k}: {e}")
        self._outstanding.append((k, desc, sent, exported))
        ring = _rings.get((self._spec["sync_id"], self.channel.rank))
        staged = sum(entry[3] for entry in self._outstanding) + (ring.nbytes if ring is not None else 0)
        self.peak_nbytes = max(self.peak_nbytes, staged)

    @property
    def _node(self) -> str:
        return self.channel.members[self.channel.rank].node_id

    def _fail(self, child: int, reason: str) -> None:
        self.failed.setdefault(child, reason)
        if child in self.live:
            self.live.remove(child)

    def _settle_oldest(self) -> None:
        k, desc, sent, _nbytes = self._outstanding.popleft()
        try:
            for child in sent:
                if child not in self.live:
                    continue
                try:
                    answer = self.channel.recv(child, f"b{k}/ack")
                except TensorwireError as e:
                    self._fail(child, f"lost during bucket {k}: {e}")
                    continue
                if answer:
                    self._fail(child, answer.decode(errors="replace"))
        finally:
            if desc is not None:
                self.channel.unpublish(desc)
        self._on_done(k)

    def abort(self, k: int, reason: str) -> None:
        """Tell the live children that bucket ``k`` and later will not come (never raises)."""
        message = _message(b"A", 0, reason.encode()[:4096])
        for child in self.live:
            with contextlib.suppress(TensorwireError):
                self.channel.send(child, f"b{k}", message)

    def finish(self) -> None:
        while self._outstanding:
            self._settle_oldest()

    def abandon(self) -> None:
        while self._outstanding:
            desc = self._outstanding.popleft()[1]
            if desc is not None:
                self.channel.unpublish(desc)


@contextlib.contextmanager
def _serving(fanout: _Fanout, who: str) -> Iterator[None]:
    """Around a server's loop over the buckets: wait for the last acknowledgements; on
    failure tell the children that no more buckets come; always free what is published."""
    try:
        yield
        fanout.finish()
    except BaseException as e:
        fanout.abort(fanout.offered, f"{who} failed: {type(e).__name__}: {e}")
        raise
    finally:
        fanout.abandon()
        fanout.channel.close()


_rings: dict[tuple[str, int], StagingRing] = {}
_readers: dict[str, RingReader] = {}


def release(_actor: object, sync_id: str) -> None:
    """Hook, every member: drop the staging ring and the mappings of sync ``sync_id``."""
    for key in [key for key in _rings if key[0] == sync_id]:
        _rings.pop(key).close()
    reader = _readers.pop(sync_id, None)
    if reader is not None:
        reader.close()


def _channel(spec: dict[str, Any], rank: int) -> Channel:
    members = [member_from(r, d) for r, d in enumerate(spec["members"])]
    return Channel(spec["channel"], rank, members, spec["timeout_s"])


def _children(spec: dict[str, Any], rank: int) -> list[int]:
    return sorted(child for child, parent in spec["parents"].items() if parent == rank)


def send(actor: object, spec: dict[str, Any]) -> dict[str, Any]:
    """Hook, trainer: hand every bucket to the receivers it serves."""
    start = time.perf_counter()
    channel = _channel(spec, 0)
    driver = peer_from_bytes(spec["driver"]) if spec["driver"] else None

    def report_progress(k: int) -> None:
        if driver is not None:
            with contextlib.suppress(TensorwireError):  # progress is best effort
                runtime_agent().rendezvous_push(driver, spec["channel"], f"progress/{k}", b"", timeout_s=5.0)

    fanout = _Fanout(channel, _children(spec, 0), spec, on_done=report_progress)
    checksum_s = 0.0
    with _serving(fanout, "the trainer"):  # a failure here tells the receivers at once
        names, tensors = _tensor_list(actor, spec["source"], "source")
        if _layout(names, tensors) != spec["layout"]:
            raise ValueError("the trainer's tensors changed shape, dtype or names since the WeightSync was made")
        for k, bucket in enumerate(spec["buckets"]):
            part = [tensors[i] for i in bucket]
            check_start = time.perf_counter()
            check = checksum(part) if spec["verify"] else 0
            checksum_s += time.perf_counter() - check_start
            fanout.offer(k, part, check)
    return {
        "pack_s": fanout.pack_s,
        "checksum_s": checksum_s,
        "seconds": time.perf_counter() - start,
        "failed": fanout.failed,
        "peak_nbytes": fanout.peak_nbytes,
    }


def _take_bucket(channel: Channel, spec: dict[str, Any], message: bytes, dst: list[torch.Tensor]) -> tuple[str, float]:
    """Copy one bucket into ``dst``: from the sender's staging slot or as an announced object.
    Returns the transport and the seconds spent copying what could not land in place."""
    kind, payload = message[:1], message[_HEADER.size :]
    if kind == b"R":
        (slot_nbytes,) = _SLOT.unpack_from(payload)
        reader = _readers.setdefault(spec["sync_id"], RingReader())
        return "shm", reader.read(payload[_SLOT.size :].decode(), slot_nbytes, dst)
    fetched = channel.fetch(payload, [t if t.is_contiguous() else None for t in dst], transport=spec["transport"])
    copy_start = time.perf_counter()
    for i, t in enumerate(dst):
        if not t.is_contiguous():
            t.copy_(fetched.tensors[i])
    return fetched.transport, fetched.copy_s + time.perf_counter() - copy_start


def receive(actor: object, spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Hook, receiver ``rank``: copy every bucket into the target tensors; serve if a leader."""
    start = time.perf_counter()
    channel = _channel(spec, rank)
    parent = spec["parents"][rank]
    fanout = _Fanout(channel, _children(spec, rank), spec)
    transfer_s = unpack_s = verify_s = 0.0
    transports: collections.Counter[str] = collections.Counter()
    ack: Callable[[], None] = lambda: None  # noqa: E731
    acked = 0  # buckets acknowledged to the parent so far
    with _serving(fanout, f"relay {rank}"):
        try:
            _names, targets = _tensor_list(actor, spec["target"], "target")
            if _layout(_names, targets) != spec["layout"]:
                raise ValueError("the receiver's tensors changed shape, dtype or names since the WeightSync was made")
            for k, bucket in enumerate(spec["buckets"]):
                message = channel.recv(parent, f"b{k}")
                if len(message) < _HEADER.size or message[:1] not in (b"R", b"O"):
                    reason = message[_HEADER.size :].decode(errors="replace") if message[:1] == b"A" else "bad message"
                    raise TensorwireError(f"bucket {k} will not come: {reason}")
                (_kind, expected) = _HEADER.unpack_from(message)
                dst = [targets[i] for i in bucket]
                fetch_start = time.perf_counter()
                transport, copy_s = _take_bucket(channel, spec, message, dst)
                transports[transport] += 1
                unpack_s += copy_s
                transfer_s += time.perf_counter() - fetch_start - copy_s
                if spec["verify"]:
                    verify_start = time.perf_counter()
                    intact = checksum(dst) == expected
                    verify_s += time.perf_counter() - verify_start
                    if not intact:
                        raise TensorwireError(f"bucket {k}: checksum mismatch after unpacking")
                ack()  # the previous bucket's acknowledgement arrived
                ack, acked = channel.post(parent, f"b{k}/ack", b""), k + 1
                fanout.offer(k, dst, expected)
            ack()
        except BaseException as e:  # tell the parent, so that it stops waiting for this receiver
            with contextlib.suppress(TensorwireError):
                channel.send(parent, f"b{acked}/ack", f"bucket {acked}: {type(e).__name__}: {e}".encode()[:4096])
            raise
    with _versions_lock:
        _versions[spec["name"]] = spec["version"]
    return {
        "rank": rank,
        "version": spec["version"],
        "transfer_s": transfer_s,
        "unpack_s": unpack_s,
        "verify_s": verify_s,
        "seconds": time.perf_counter() - start,
        "transports": dict(transports),
        "relay_failed": fanout.failed,
        "peak_nbytes": fanout.peak_nbytes,
    }


# ---------------------------------------------------------------------- driver side


@dataclass
class SyncReport:
    """What one :meth:`WeightSync.push` did.

    Attributes:
        version: The version pushed.
        nbytes: Bytes of the state (each receiver got this much).
        buckets: Number of buckets.
        seconds: Wall time of the push, seen from the caller.
        pack_s: Trainer time publishing buckets (the copy into shared memory on the host).
        transfer_s: Slowest receiver's time fetching (the copy into its tensors included).
        unpack_s: Slowest receiver's time copying what a transport could not write in place.
        verify_s: Slowest receiver's checksum time (0 without ``verify``).
        receivers: Receiver index -> its result (times, transports used).
        failed: Receiver index -> why it does not hold this version.
        peak_staging_nbytes: Most bytes the trainer had published at once (about two buckets).
    """

    version: int
    nbytes: int
    buckets: int
    seconds: float
    pack_s: float
    transfer_s: float
    unpack_s: float
    verify_s: float
    receivers: dict[int, dict[str, Any]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    peak_staging_nbytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def gbps(self) -> float:
        """Bytes delivered (state size x receivers that got it) per second, in GB/s."""
        return self.nbytes * len(self.receivers) / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        transports = sorted({t for r in self.receivers.values() for t in r["transports"]})
        text = (
            f"weight sync v{self.version}: {self.nbytes / 2**20:.1f} MiB x {len(self.receivers)} receiver(s) in "
            f"{self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s; {self.buckets} bucket(s) by "
            f"{', '.join(transports) or '-'}; pack {self.pack_s * 1e3:.1f} ms, "
            f"transfer {self.transfer_s * 1e3:.1f} ms, unpack {self.unpack_s * 1e3:.1f} ms"
        )
        if self.verify_s:
            text += f", verify {self.verify_s * 1e3:.1f} ms"
        text += ")"
        if self.failed:
            text += f"; FAILED: {self.failed}"
        return text


class WeightSync:
    """Push a trainer actor's tensors into receiver actors' tensors (see the module doc).

    Args:
        trainer: The actor that holds the weights (``@tw.remote``).
        receivers: The actors to update.
        source: Attribute or method of the trainer giving an ``nn.Module`` or a dict of tensors
            (default: its ``state_dict()`` method when it has one, else its ``model`` attribute).
        target: The same on the receivers (default: ``source``); same names, shapes, dtypes.
        bucket_bytes: Bucket size; extra memory is about two buckets (per relay as well).
        transport: "auto" (the selector, per receiver) or a transport name for every fetch.
        verify: Checksum every bucket and check it in the receivers.
        progress: Show a progress line on stderr (default: when stderr is a terminal).
        name: Name of this sync, for ``weight_version(name)`` in the receivers.
        timeout_s: Deadline of each wait inside a push (setup included).
    """

    def __init__(
        self,
        trainer: ActorHandle,
        receivers: Sequence[ActorHandle],
        *,
        source: str = "",
        target: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transport: str = "auto",
        verify: bool = False,
        progress: bool | None = None,
        name: str = "weights",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        import ray

        actors = check_actors([trainer, *receivers], "WeightSync (trainer and receivers)")
        if not receivers:
            raise ValueError("WeightSync needs at least one receiver")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be a positive number of bytes")
        if transport != "auto":
            from tensorwire.transport import registry

            registry.get_transport_class(transport)  # unknown names: "did you mean"
        self.trainer = trainer
        self.receivers = tuple(receivers)
        self.source = source
        self.target = target or source
        self.bucket_bytes = bucket_bytes
        self.transport = "" if transport == "auto" else transport
        self.verify = verify
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.name = name
        self.timeout_s = timeout_s
        self.version = 0
        self._id = f"{next(_sync_ids)}-{id(self):x}"
        self._dead: set[int] = set()
        self._layout = ray.get(call_hook(trainer, "weight_sync.layout", source), timeout=timeout_s)
        ray.get([call_hook(r, "weight_sync.check_target", self.target, self._layout) for r in receivers],
                timeout=timeout_s)  # fmt: skip
        self._descriptions = describe_actors(actors, timeout_s)
        self._buckets = bucket_plan([entry[3] for entry in self._layout], bucket_bytes)
        self._slot_nbytes = max(
            (packed_layout(self._layout[i][3] for i in bucket)[1] for bucket in self._buckets), default=1
        )
        self._closed = False

    @property
    def nbytes(self) -> int:
        return sum(entry[3] for entry in self._layout)

    def _parents(self) -> dict[int, int]:
        """The relay tree over the trainer (rank 0) and the receivers not known dead."""
        live = [0] + [i + 1 for i in range(len(self.receivers)) if i not in self._dead]
        compact = [member_from(index, self._descriptions[rank]) for index, rank in enumerate(live)]
        parents = broadcast_parents(compact, 0)
        return {live[child]: live[parent] for child, parent in parents.items()}

    def push(self) -> SyncReport:
        """Push the trainer's current tensors as the next version; returns the report.

        Receivers that die or fail are listed in ``report.failed`` (and left out of later
        pushes if they died); the others are complete. Raises if the trainer fails.
        """
        import ray

        if self._closed:
            raise RuntimeError("this WeightSync was closed")
        self.version += 1
        channel = f"tw-sync-{self._id}-{self.version}"
        parents = self._parents()
        spec = {
            "name": self.name,
            "sync_id": self._id,
            "slot_nbytes": self._slot_nbytes,
            "version": self.version,
            "channel": channel,
            "members": self._descriptions,
            "parents": parents,
            "buckets": self._buckets,
            "layout": self._layout,
            "source": self.source,
            "target": self.target,
            "verify": self.verify,
            "transport": self.transport,
            "timeout_s": self.timeout_s,
            "driver": peer_to_bytes(runtime_agent().peer) if self.progress else b"",
        }
        start = time.perf_counter()
        trainer_ref = call_hook(self.trainer, "weight_sync.send", spec)
        receiver_refs = {
            i: call_hook(actor, "weight_sync.receive", spec, i + 1)
            for i, actor in enumerate(self.receivers)
            if i + 1 in parents
        }
        self._wait(trainer_ref, list(receiver_refs.values()), channel)
        seconds = time.perf_counter() - start
        trainer = ray.get(trainer_ref, timeout=self.timeout_s)
        report = SyncReport(self.version, self.nbytes, len(self._buckets), seconds, trainer["pack_s"], 0.0, 0.0, 0.0)
        report.peak_staging_nbytes = trainer["peak_nbytes"]
        for i in range(len(self.receivers)):
            if i + 1 not in parents:
                report.failed[i] = "left out: it died in an earlier push"
        for i, ref in receiver_refs.items():
            try:
                result = ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.RayActorError as e:
                self._dead.add(i)
                report.failed[i] = f"the receiver died: {str(e).splitlines()[0]}"
                continue
            except ray.exceptions.RayTaskError as e:
                report.failed[i] = str(e.cause if e.cause is not None else e).splitlines()[0]
                continue
            report.receivers[i] = result
            report.transfer_s = max(report.transfer_s, result["transfer_s"])
            report.unpack_s = max(report.unpack_s, result["unpack_s"])
            report.verify_s = max(report.verify_s, result["verify_s"])
        return report

    def _wait(self, trainer_ref: Any, receiver_refs: list[Any], channel: str) -> None:
        """Wait for the push (bounded), drawing progress from the trainer's messages."""
        import ray

        pending = [trainer_ref, *receiver_refs]
        deadline = time.monotonic() + self.timeout_s * (len(self._buckets) + 2)
        agent = runtime_agent()
        settled = 0
        try:
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weight sync v{self.version} did not finish in time")
                _done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
                if not self.progress:
                    continue
                while settled < len(self._buckets):
                    try:
                        agent.rendezvous_take(channel, f"progress/{settled}", timeout_s=0.0)
                    except TensorwireError:
                        break
                    settled += 1
                self._draw(settled)
        finally:
            agent.rendezvous_forget(channel)
            if self.progress:
                sys.stderr.write("\n")

    def _draw(self, settled: int) -> None:
        total = len(self._buckets)
        sent = sum(sum(self._layout[i][3] for i in bucket) for bucket in self._buckets[:settled])
        width = 30
        filled = math.floor(width * settled / total) if total else width
        sys.stderr.write(
            f"\rweight sync v{self.version} [{'#' * filled}{'.' * (width - filled)}] {settled}/{total} buckets, "
            f"{sent / 2**20:.0f}/{self.nbytes / 2**20:.0f} MiB"
        )
        sys.stderr.flush()

    def close(self, timeout_s: float = 30.0) -> None:
        """Free the staging memory the sync keeps between pushes (two buckets of shared memory
        per serving process, and the receivers' mappings of them). Idempotent."""
        import ray

        if self._closed:
            return
        self._closed = True
        refs = [call_hook(actor, "weight_sync.release", self._id) for actor in (self.trainer, *self.receivers)]
        for ref in refs:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(ref, timeout=timeout_s)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def versions(self) -> list[int]:
        """The version each receiver holds completely (0: none yet; -1: unreachable)."""
        import ray

        result = []
        for actor in self.receivers:
            try:
                result.append(ray.get(call_hook(actor, "weight_sync.versions_hook", self.name), timeout=30.0))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                result.append(-1)
        return result
