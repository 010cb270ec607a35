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

Bucket ``k`` of a stream goes to each reader as a bucket message under
:func:`~..protocol.messages.bucket_key` (its kind says where the bytes are: ``RING``,
``OBJECT``, ``MIXED``, or ``ABORT``); a reader answers under
:func:`~..protocol.messages.ack_key`: empty, or why it failed (the server then drops it).
Where the bytes wait: :mod:`.staging`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tensorwire.collectives.groups.channel import Channel
from tensorwire.collectives.weight_sync.planning.buckets import IN_FLIGHT
from tensorwire.collectives.weight_sync.protocol import messages
from tensorwire.collectives.weight_sync.protocol.messages import SLOT, BucketKind, bucket_message, mixed_payload
from tensorwire.collectives.weight_sync.streams import staging
from tensorwire.collectives.weight_sync.streams.staging import Piece, as_wire, in_place, stage, write_slot
from tensorwire.errors import TensorwireError
from tensorwire.runtime.agent import agent as runtime_agent

__all__ = ["READS_ENV", "Fanout", "serving"]

logger = logging.getLogger(__name__)

READS_ENV = "TENSORWIRE_SYNC_READS"  # auto (default), in-place or ring: how same-node readers read host pieces


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
        self.stream = stream
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
        tensors = stage(pieces, staging.pool(self._key), k % IN_FLIGHT) if one_device else [as_wire(p) for p in pieces]
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
            ring = staging.ring(self._key, self._staging, self._slot_nbytes)
            write_slot(ring.arrays[k % IN_FLIGHT], ringed)
            payload = SLOT.pack(ring.slot_nbytes) + ring.names[k % IN_FLIGHT].encode()
            if any(mask):  # the pieces contiguous in their wire dtype are read in place
                read_in_place = [p for p, m in zip(pieces, mask, strict=True) if m]
                desc, announcement, nbytes = self._publish(read_in_place, ring_readers, k)
                descs.append(desc)
                exported += nbytes
                note = bucket_message(BucketKind.MIXED, check, mixed_payload(mask, payload, announcement))
            else:
                note = bucket_message(BucketKind.RING, check, payload)
            messages_to.update(dict.fromkeys(ring_readers, note))
        if object_readers:
            desc, announcement, nbytes = self._publish(pieces, object_readers, k)
            descs.append(desc)
            exported += nbytes
            messages_to.update(dict.fromkeys(object_readers, bucket_message(BucketKind.OBJECT, check, announcement)))
        self.pack_s += time.perf_counter() - start
        sizes = [v.numel() * d.itemsize for v, d in pieces]
        nbytes = sum(sizes)
        unstaged = {  # per reader: the bytes it reads straight out of the server's tensors
            c: sum(n for n, (v, d) in zip(sizes, pieces, strict=True) if in_place(v, d)) for c in object_readers
        }
        if ring_readers:
            unstaged.update(dict.fromkeys(ring_readers, sum(n for n, m in zip(sizes, mask, strict=True) if m)))
        posts = {c: self.channel.post(c, messages.bucket_key(self.stream, k), m) for c, m in messages_to.items()}
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
        staged = sum(entry[3] for entry in self._outstanding) + staging.staged_nbytes(self._key)
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
                    answer = self.channel.recv(child, messages.ack_key(self.stream, k))
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
        note = bucket_message(BucketKind.ABORT, 0, reason.encode()[: messages.MAX_REASON_NBYTES])
        for child in self.live:
            with contextlib.suppress(TensorwireError):
                self.channel.send(child, messages.bucket_key(self.stream, self.offered), note)

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
