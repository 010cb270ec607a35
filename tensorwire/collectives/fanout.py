"""Serving one weight-sync stream: a sender's buckets to its readers, at most two at a time.

A *stream* is what one server (a trainer, or a receiver relaying to its node) sends the same
way to one or more readers. For bucket k the server publishes the bucket's pieces as an
announced object of its agent (whichever transport the selector picks per pair reads them; it
exports for readers on other nodes too when a one-sided transport serves them there). Pieces
that are contiguous in the wire dtype are published as they are, views of the server's own
tensors, so that readers read them in place; the others (strided, or converted to another
dtype) are gathered into slot k % 2 of a staging pool the stream keeps (on their device), with
the conversion on the way. For host buckets and readers on its node, the server packs the
bucket into slot k % 2 of a staging ring they keep mapped (``Capabilities.staging_rings``)
instead, except the pieces that can be read in place when the staging transport says that
costs these readers less (``reads_in_place(readers)``: shm's direct reads against one packing
copy and a memcpy per reader); ``TENSORWIRE_SYNC_READS`` = ``in-place`` / ``ring`` overrides
that choice. It prepares bucket k+1 while they copy bucket k and reuses a slot only after
every reader acknowledged it.

Messages (``<stream prefix>b<k>``): a kind byte (:class:`BucketKind`), a checksum, a payload.
``RING``: the bucket is in the sender's staging slot (payload: slot size, segment name);
``OBJECT``: an announced object (its announcement); ``MIXED``: both, a flag per piece saying
which (:func:`mixed_payload`); ``ABORT``: the sender aborted (why). A
reader answers ``b<k>/ack``: empty, or why it failed (the server then drops it).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
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

__all__ = [
    "BucketKind",
    "Fanout",
    "checksum",
    "in_place",
    "message",
    "mixed_payload",
    "parse_message",
    "parse_mixed",
    "read_slot",
    "release",
    "serving",
    "stage",
]

logger = logging.getLogger(__name__)

IN_FLIGHT = 2  # buckets published at once by a server (double buffering)
READS_ENV = "TENSORWIRE_SYNC_READS"  # auto (default), in-place or ring: how same-node readers read host pieces
HEADER = struct.Struct("<cQ")
SLOT = struct.Struct("<Q")
_MIXED = struct.Struct("<II")  # ring payload bytes, pieces (then the ring payload, a byte per piece, the announcement)
_MASK = (1 << 64) - 1

# A bucket's pieces on the sending side: (a view of the sender's tensor, the dtype to send as).
Piece = tuple[torch.Tensor, torch.dtype]

_rings: dict[tuple[str, int, int], Any] = {}  # a staging transport's rings (Transport.staging_ring)
_pools: dict[tuple[str, int, int], list[torch.Tensor]] = {}  # per stream: a buffer per slot (staged pieces)
_readers: dict[str, tuple[str, Any]] = {}  # sync id -> (its transport, a ring reader)


class BucketKind(bytes, enum.Enum):
    """The kind byte of a bucket message."""

    RING = b"R"  # in the sender's staging slot
    OBJECT = b"O"  # an announced object of the sender's agent
    MIXED = b"M"  # some pieces in the staging slot, the others (read in place) an announced object
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


def mixed_payload(in_place_mask: Sequence[bool], ring_payload: bytes, announcement: bytes) -> bytes:
    """A ``MIXED`` bucket's payload: which pieces are read in place (from ``announcement``,
    in order) and which from the ring slot ``ring_payload`` names."""
    flags = bytes(int(bool(m)) for m in in_place_mask)
    return _MIXED.pack(len(ring_payload), len(flags)) + ring_payload + flags + announcement


def parse_mixed(payload: bytes) -> tuple[list[bool], bytes, bytes]:
    """(in-place mask, ring payload, announcement) of a ``MIXED`` payload."""
    ring_nbytes, count = _MIXED.unpack_from(payload)
    at = _MIXED.size + ring_nbytes
    return [bool(b) for b in payload[at : at + count]], payload[_MIXED.size : at], payload[at + count :]


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


def in_place(view: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a piece can be published as it is: contiguous, already in its wire dtype."""
    return view.dtype == dtype and view.is_contiguous()


def stage(pieces: Sequence[Piece], pool: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
    """Pieces (on one device) as tensors to publish: views of the sender's tensors where
    they can be read in place, else copies (gathered, converted) into ``pool[slot]``, which
    grows to the largest need, follows the pieces' device and is reused."""
    staged = [i for i, (view, dtype) in enumerate(pieces) if not in_place(view, dtype)]
    if not staged:
        return [view for view, _dtype in pieces]
    offsets, total = packed_layout(pieces[i][0].numel() * pieces[i][1].itemsize for i in staged)
    device = pieces[staged[0]][0].device
    if pool[slot].numel() < total or pool[slot].device != device:
        pool[slot] = torch.empty(total, dtype=torch.uint8, device=device)
    result = [view for view, _dtype in pieces]
    for i, offset in zip(staged, offsets, strict=True):
        view, dtype = pieces[i]
        target = pool[slot][offset : offset + view.numel() * dtype.itemsize].view(dtype).view(view.shape)
        target.copy_(view)
        result[i] = target
    return result


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
    for key in [key for key in _pools if key[0] == sync_id]:
        del _pools[key]
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
        self.in_place_nbytes = 0  # of those, bytes readers read straight out of the server's tensors
        self.prefix = f"s{stream}/"
        self._key = (sync_id, channel.rank, stream)
        self._slot_nbytes = slot_nbytes
        me = channel.members[channel.rank].peer
        self._staging = runtime_agent().staging()  # a transport with same-node staging rings (shm)
        use_ring = self._staging is not None and transport in ("", self._staging.name)
        self._local = {c for c in children if use_ring and channel.members[c].peer.same_node(me)}
        self._reads = os.environ.get(READS_ENV, "auto").strip() or "auto"
        if self._reads not in ("auto", "in-place", "ring"):  # (raising here, before serving, would strand the readers)
            logger.warning("%s=%r: expected auto, in-place or ring; using auto", READS_ENV, self._reads)
            self._reads = "auto"
        self.offered = 0  # buckets handed on so far: the children wait for this one next
        self._outstanding: collections.deque[tuple[int, list[Any], list[int], int]] = collections.deque()
        self._on_done = on_done  # called with k once every child acknowledged bucket k (or none was left)

    def _ring(self) -> Any:
        ring = _rings.get(self._key)
        if ring is None or ring.slot_nbytes < self._slot_nbytes:
            if ring is not None:
                ring.close()
            ring = _rings[self._key] = self._staging.staging_ring(self._slot_nbytes)
        return ring

    def _pool(self) -> list[torch.Tensor]:
        pool = _pools.get(self._key)
        if pool is None:
            pool = _pools[self._key] = [torch.empty(0, dtype=torch.uint8) for _ in range(IN_FLIGHT)]
        return pool

    def _in_place_mask(self, pieces: Sequence[Piece], readers: int) -> list[bool]:
        """Per piece of a host bucket, whether this node's ``readers`` read it in place (the
        others come through the ring): the pieces that can be, where that costs them less."""
        if self._reads == "ring" or (self._reads == "auto" and not self._staging.reads_in_place(readers)):
            return [False] * len(pieces)
        return [in_place(v, d) for v, d in pieces]

    def _publish(self, pieces: Sequence[Piece], readers: Sequence[int], k: int) -> tuple[Any, bytes, int]:
        """Publish pieces for ``readers`` as an announced object, staging only what cannot be
        read in place: (descriptor, announcement, bytes its exports hold)."""
        me = self.channel.members[self.channel.rank].node_id
        same_node = any(self.channel.members[c].node_id == me for c in readers)
        other_node = any(self.channel.members[c].node_id != me for c in readers)
        export = same_node or (other_node and self._exports_across_nodes)  # one-sided handles (nixl)
        one_device = len({v.device for v, _ in pieces}) <= 1
        tensors = stage(pieces, self._pool(), k % IN_FLIGHT) if one_device else [as_wire(p) for p in pieces]
        return self.channel.publish(tensors, export=export, across_nodes=other_node)

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
        mask = self._in_place_mask(pieces, len(ring_readers)) if ring_readers else []
        if all(mask):  # (also when there are no ring readers)
            ring_readers = []
        object_readers = [c for c in self.live if c not in ring_readers]
        messages_to: dict[int, bytes] = {}
        descs: list[Any] = []
        exported = 0
        if ring_readers:
            ringed = [p for p, m in zip(pieces, mask, strict=True) if not m]
            ring = self._ring()
            write_slot(ring.arrays[k % IN_FLIGHT], ringed)
            payload = SLOT.pack(ring.slot_nbytes) + ring.names[k % IN_FLIGHT].encode()
            if any(mask):  # the pieces contiguous in their wire dtype are read in place
                read_in_place = [p for p, m in zip(pieces, mask, strict=True) if m]
                desc, announcement, nbytes = self._publish(read_in_place, ring_readers, k)
                descs.append(desc)
                exported += nbytes
                note = message(BucketKind.MIXED, check, mixed_payload(mask, payload, announcement))
            else:
                note = message(BucketKind.RING, check, payload)
            messages_to.update(dict.fromkeys(ring_readers, note))
        if object_readers:
            desc, announcement, nbytes = self._publish(pieces, object_readers, k)
            descs.append(desc)
            exported += nbytes
            messages_to.update(dict.fromkeys(object_readers, message(BucketKind.OBJECT, check, announcement)))
        self.pack_s += time.perf_counter() - start
        sizes = [v.numel() * d.itemsize for v, d in pieces]
        nbytes = sum(sizes)
        unstaged = {  # per reader: the bytes it reads straight out of the server's tensors
            c: sum(n for n, (v, d) in zip(sizes, pieces, strict=True) if in_place(v, d)) for c in object_readers
        }
        if ring_readers:
            unstaged.update(dict.fromkeys(ring_readers, sum(n for n, m in zip(sizes, mask, strict=True) if m)))
        posts = {c: self.channel.post(c, f"{self.prefix}b{k}", m) for c, m in messages_to.items()}
        sent = []
        for child, wait in posts.items():
            try:
                wait()
                sent.append(child)
                self.sent_nbytes += nbytes
                self.in_place_nbytes += unstaged[child]
            except TensorwireError as e:
                self._fail(child, f"could not be told of bucket {k}: {e}")
        self._outstanding.append((k, descs, sent, exported))
        ring = _rings.get(self._key)
        staged = sum(entry[3] for entry in self._outstanding) + (ring.nbytes if ring is not None else 0)
        staged += sum(buffer.numel() for buffer in _pools.get(self._key, ()))
        self.peak_nbytes = max(self.peak_nbytes, staged)

    def _fail(self, child: int, reason: str) -> None:
        self.failed.setdefault(child, reason)
        if child in self.live:
            self.live.remove(child)

    def _settle_oldest(self) -> None:
        k, descs, sent, _nbytes = self._outstanding.popleft()
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
            for desc in descs:
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
            for desc in self._outstanding.popleft()[1]:
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
