"""Serving one weight-sync stream: a sender's buckets to its readers, at most two at a time.

A *stream* is what one server (a trainer, or a receiver relaying to its node) sends the same
way to one or more readers. For bucket k the server packs the bucket's pieces into slot
k % 2 of its staging ring for the readers on its node, where a transport offers staging rings
(``Capabilities.staging_rings``: shm; one copy, with the dtype conversion on the way), or
publishes them as an announced object of its agent for the others (whichever transport the
selector picks per pair reads them; it exports for readers on other nodes too when a
one-sided transport serves them there); it packs bucket k+1 while they copy bucket k and
reuses a slot only after every reader acknowledged it.

Messages (``<stream prefix>b<k>``): a kind byte (:class:`BucketKind`), a checksum, a payload.
``RING``: the bucket is in the sender's staging slot (payload: slot size, segment name);
``OBJECT``: an announced object (its announcement); ``ABORT``: the sender aborted (why). A
reader answers ``b<k>/ack``: empty, or why it failed (the server then drops it).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import struct
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tensorwire.collectives.channel import Channel
from tensorwire.errors import TensorwireError
from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.transport.packing import byte_view, packed_layout

__all__ = ["BucketKind", "Fanout", "checksum", "message", "parse_message", "read_slot", "release", "serving"]

IN_FLIGHT = 2  # buckets published at once by a server (double buffering)
HEADER = struct.Struct("<cQ")
SLOT = struct.Struct("<Q")
_MASK = (1 << 64) - 1

# A bucket's pieces on the sending side: (a view of the sender's tensor, the dtype to send as).
Piece = tuple[torch.Tensor, torch.dtype]

_rings: dict[tuple[str, int, int], Any] = {}  # a staging transport's rings (Transport.staging_ring)
_readers: dict[str, tuple[str, Any]] = {}  # sync id -> (its transport, a ring reader)


class BucketKind(bytes, enum.Enum):
    """The kind byte of a bucket message."""

    RING = b"R"  # in the sender's staging slot
    OBJECT = b"O"  # an announced object of the sender's agent
    ABORT = b"A"  # the sender aborted: this bucket and later ones will not come


def message(kind: BucketKind, check: int, payload: bytes) -> bytes:
    return HEADER.pack(kind.value, check) + payload


def parse_message(data: bytes, what: str) -> tuple[BucketKind, int, bytes]:
    """(kind, checksum, payload) of a bucket message; ``TensorwireError`` naming ``what``
    for one that is not."""
    try:
        kind = BucketKind(data[:1])
        _kind, check = HEADER.unpack_from(data)
    except (ValueError, struct.error):
        raise TensorwireError(
            f"{what}: not a bucket message ({len(data)} bytes, kind {data[:1]!r}; "
            f"expected one of {', '.join(k.value.decode() for k in BucketKind)})"
        ) from None
    return kind, check, data[HEADER.size :]


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """A 64-bit checksum of the tensors' bytes, in order, computed where they are (GPU or
    host) without a copy of contiguous ones: position-weighted sums of 64-bit words (or bytes)."""
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


def as_wire(piece: Piece) -> torch.Tensor:
    """A piece as a contiguous tensor of its wire dtype (a view when it already is one)."""
    view, dtype = piece
    if view.dtype != dtype:
        return view.to(dtype)
    return view if view.is_contiguous() else view.contiguous()


def _direct(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and not tensor.is_cuda and tensor.is_contiguous()


def write_slot(array: np.ndarray, pieces: Sequence[Piece]) -> None:
    """Pack host pieces into a slot's bytes at their packed-layout offsets, converting dtypes
    and gathering strided views in the one copy."""
    offsets, total = packed_layout(v.numel() * d.itemsize for v, d in pieces)
    if total > array.size:
        raise ValueError(f"a bucket of {total} bytes does not fit a {array.size}-byte slot")
    for (view, dtype), offset in zip(pieces, offsets, strict=True):
        nbytes = view.numel() * dtype.itemsize
        if _direct(view, dtype):
            np.copyto(array[offset : offset + nbytes], byte_view(view).numpy())
        elif nbytes:
            target = torch.from_numpy(array[offset : offset + nbytes]).view(dtype).view(view.shape)
            target.copy_(view)


def read_slot(array: np.ndarray, dst: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> float:
    """Copy a bucket out of a slot into ``dst`` (views of the reader's tensors; the slot holds
    each as ``dtypes[i]``). Returns the seconds spent on strided or converted targets."""
    offsets, total = packed_layout(t.numel() * d.itemsize for t, d in zip(dst, dtypes, strict=True))
    if total > array.size:
        raise ValueError(f"a bucket of {total} bytes does not fit a {array.size}-byte slot")
    slow_s = 0.0
    for tensor, dtype, offset in zip(dst, dtypes, offsets, strict=True):
        nbytes = tensor.numel() * dtype.itemsize
        if _direct(tensor, dtype):
            np.copyto(byte_view(tensor).numpy(), array[offset : offset + nbytes])
            continue
        if not nbytes:
            continue
        start = time.perf_counter()
        with warnings.catch_warnings():  # a read-only mapping: only read here
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(array[offset : offset + nbytes])
        tensor.copy_(flat.view(dtype).view(tensor.shape))
        slow_s += time.perf_counter() - start
    return slow_s


def ring_reader(sync_id: str) -> tuple[str, Any]:
    """This process's reader of sync ``sync_id``'s rings, and the transport that made it."""
    found = _readers.get(sync_id)
    if found is None:
        staging = runtime_agent().staging()
        if staging is None:
            raise TensorwireError("a bucket came in a staging ring, but no transport here offers staging rings")
        found = _readers[sync_id] = (staging.name, staging.ring_reader())
    return found


def release(sync_id: str) -> None:
    """Drop the staging rings and ring mappings of sync ``sync_id`` in this process."""
    for key in [key for key in _rings if key[0] == sync_id]:
        _rings.pop(key).close()
    found = _readers.pop(sync_id, None)
    if found is not None:
        found[1].close()


class Fanout:
    """A server's side of one stream: hand buckets to its children, at most ``IN_FLIGHT`` at
    once, and drop children that die or fail (``failed``: child rank -> why)."""

    def __init__(
        self,
        channel: Channel,
        children: Sequence[int],
        *,
        sync_id: str,
        stream: int,
        slot_nbytes: int,
        transport: str,
        on_done: Callable[[int], None] = lambda _k: None,
    ) -> None:
        self.channel = channel
        self._exports_across_nodes = channel.exports_across_nodes()
        self.live = list(children)
        self.failed: dict[int, str] = {}
        self.peak_nbytes = 0
        self.pack_s = 0.0
        self.sent_nbytes = 0  # bytes handed on (once per reader)
        self.prefix = f"s{stream}/"
        self._key = (sync_id, channel.rank, stream)
        self._slot_nbytes = slot_nbytes
        me = channel.members[channel.rank].peer
        self._staging = runtime_agent().staging()  # a transport with same-node staging rings (shm)
        use_ring = self._staging is not None and transport in ("", self._staging.name)
        self._local = {c for c in children if use_ring and channel.members[c].peer.same_node(me)}
        self.offered = 0  # buckets handed on so far: the children wait for this one next
        self._outstanding: collections.deque[tuple[int, Any, list[int], int]] = collections.deque()
        self._on_done = on_done  # called with k once every child acknowledged bucket k (or none was left)

    def _ring(self) -> Any:
        ring = _rings.get(self._key)
        if ring is None or ring.slot_nbytes < self._slot_nbytes:
            if ring is not None:
                ring.close()
            ring = _rings[self._key] = self._staging.staging_ring(self._slot_nbytes)
        return ring

    def offer(self, k: int, pieces: Sequence[Piece], check: int) -> None:
        """Hand bucket ``k`` on (waits while two older buckets are not acknowledged)."""
        self.offered = k + 1
        if not self.live:
            self._on_done(k)
            return
        while len(self._outstanding) >= IN_FLIGHT:
            self._settle_oldest()  # frees the slot and object of bucket k - 2
        start = time.perf_counter()
        host = all(v.device.type == "cpu" for v, _ in pieces)
        ring_readers = [c for c in self.live if c in self._local] if host else []
        object_readers = [c for c in self.live if c not in ring_readers]
        messages_to: dict[int, bytes] = {}
        exported = 0
        if ring_readers:
            ring = self._ring()
            slot = k % IN_FLIGHT
            write_slot(ring.arrays[slot], pieces)
            payload = SLOT.pack(ring.slot_nbytes) + ring.names[slot].encode()
            messages_to.update(dict.fromkeys(ring_readers, message(BucketKind.RING, check, payload)))
        desc = None
        if object_readers:
            me = self.channel.members[self.channel.rank].node_id
            same_node = any(self.channel.members[c].node_id == me for c in object_readers)
            other_node = any(self.channel.members[c].node_id != me for c in object_readers)
            export = same_node or (other_node and self._exports_across_nodes)  # one-sided handles (nixl)
            desc, announcement, exported = self.channel.publish([as_wire(p) for p in pieces], export=export)
            messages_to.update(dict.fromkeys(object_readers, message(BucketKind.OBJECT, check, announcement)))
        self.pack_s += time.perf_counter() - start
        nbytes = sum(v.numel() * d.itemsize for v, d in pieces)
        posts = {c: self.channel.post(c, f"{self.prefix}b{k}", m) for c, m in messages_to.items()}
        sent = []
        for child, wait in posts.items():
            try:
                wait()
                sent.append(child)
                self.sent_nbytes += nbytes
            except TensorwireError as e:
                self._fail(child, f"could not be told of bucket {k}: {e}")
        self._outstanding.append((k, desc, sent, exported))
        ring = _rings.get(self._key)
        staged = sum(entry[3] for entry in self._outstanding) + (ring.nbytes if ring is not None else 0)
        self.peak_nbytes = max(self.peak_nbytes, staged)

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
                    answer = self.channel.recv(child, f"{self.prefix}b{k}/ack")
                except TensorwireError as e:
                    self._fail(child, f"lost during bucket {k}: {e}")
                    continue
                if answer:
                    self._fail(child, answer.decode(errors="replace"))
        finally:
            if desc is not None:
                self.channel.unpublish(desc)
        self._on_done(k)

    def abort(self, reason: str) -> None:
        """Tell the live children that the next bucket and later ones will not come (never raises)."""
        note = message(BucketKind.ABORT, 0, reason.encode()[:4096])
        for child in self.live:
            with contextlib.suppress(TensorwireError):
                self.channel.send(child, f"{self.prefix}b{self.offered}", note)

    def finish(self) -> None:
        while self._outstanding:
            self._settle_oldest()

    def abandon(self) -> None:
        while self._outstanding:
            desc = self._outstanding.popleft()[1]
            if desc is not None:
                self.channel.unpublish(desc)


@contextlib.contextmanager
def serving(fanouts: Sequence[Fanout], who: str) -> Iterator[None]:
    """Around a server's loop over the buckets: wait for the last acknowledgements; on
    failure tell every stream's children that no more buckets come; always free what is
    published."""
    try:
        yield
        for fanout in fanouts:
            fanout.finish()
    except BaseException as e:
        for fanout in fanouts:
            fanout.abort(f"{who} failed: {type(e).__name__}: {e}")
        raise
    finally:
        for fanout in fanouts:
            fanout.abandon()
