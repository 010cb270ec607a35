"""Every message of a weight-sync push: its key, its format and the reasons it carries.

Two kinds of mailbox carry them (both the agent's rendezvous, bytes only, never pickled):

* **between members**, over the push's :class:`~tensorwire.collectives.groups.channel.Channel`:
  bucket ``k`` of stream ``s`` (:func:`bucket_key`: ``s<s>/b<k>``), a reader's acknowledgement
  of it (:func:`ack_key`: ``s<s>/b<k>/ack``: empty, or why it failed);
* **to and from the driver**, in mailboxes named after the push's channel: a trainer's progress
  (:func:`progress_key`), a receiver's vote (:func:`ready_key`), a stall report
  (:func:`stalled_key`), and the driver's decision (:data:`DECISION_KEY`: :data:`COMMIT`, or an
  abort: :data:`ABORT_PREFIX` or :data:`TRAINER_LOST_PREFIX` with the lost trainer's rank).

A bucket message is a kind byte (:class:`BucketKind`), a 64-bit checksum and a payload
(:func:`bucket_message`, :func:`parse_bucket_message`).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

from tensorwire.errors import TensorwireError

__all__ = [
    "ABORT_PREFIX",
    "COMMIT",
    "COVER_READ",
    "DECISION_KEY",
    "MAX_REASON_NBYTES",
    "REHEARSAL",
    "RELAY_LOST_TRAINER",
    "SLOT",
    "TRAINER_LOST_PREFIX",
    "BucketKind",
    "ReceiverFailure",
    "ack_key",
    "bucket_key",
    "bucket_message",
    "died_key",
    "lost_trainer_decision",
    "mixed_payload",
    "parse_bucket_message",
    "parse_lost_trainer",
    "parse_mixed",
    "progress_key",
    "ready_key",
    "stalled_key",
]

MAX_REASON_NBYTES = 4096  # a reason carried in a message is cut to this

# The driver's decision on an all-or-none vote (in each receiver's mailbox for the push).
DECISION_KEY = "decision"
COMMIT = b"commit"
ABORT_PREFIX = b"abort: "  # then why
TRAINER_LOST_PREFIX = b"abort, a trainer was lost: "  # then "<rank> <why>": receivers read the others on
# A relay's abort when its trainer was lost (its node-mates read their other streams on).
RELAY_LOST_TRAINER = "trainer lost: "
# A receiver's answer to a rehearsal (``WeightSync.prepare``): everything read aside, nothing committed.
REHEARSAL = "a rehearsal: read aside, nothing committed"
COVER_READ = "a cover: a lost trainer's share read aside, committed by the try beside it"


def bucket_key(stream: int, k: int) -> str:
    """The key of bucket ``k`` of ``stream`` (sent by the stream's server to each reader)."""
    return f"s{stream}/b{k}"


def ack_key(stream: int, k: int) -> str:
    """A reader's acknowledgement of bucket ``k`` of ``stream`` (empty, or why it failed)."""
    return f"s{stream}/b{k}/ack"


def progress_key(stream: int, k: int) -> str:
    """A trainer to the driver: every reader of ``stream`` acknowledged bucket ``k``."""
    return f"progress/{stream}/{k}"


def ready_key(rank: int) -> str:
    """A receiver (channel rank ``rank``) to the driver: its version is assembled (its vote)."""
    return f"ready/{rank}"


def stalled_key(trainer: int) -> str:
    """A receiver to the driver: trainer rank ``trainer`` sent no next bucket within ``stall_s``
    (the value: the reporting receiver's rank)."""
    return f"stalled/{trainer}"


def died_key(trainer: int) -> str:
    """A receiver to the driver: trainer rank ``trainer``'s process exited mid-push (the
    driver covers its share at once, :mod:`..recovery.cover`, without waiting for Ray to say so)."""
    return f"died/{trainer}"


def lost_trainer_decision(rank: int, why: str) -> bytes:
    """The driver's abort because trainer ``rank`` was lost (-1: a receiver lost one)."""
    return (TRAINER_LOST_PREFIX + f"{rank} ".encode() + why.encode())[:MAX_REASON_NBYTES]


def parse_lost_trainer(decision: bytes) -> tuple[int, str] | None:
    """(rank, why) of a :func:`lost_trainer_decision`; None for any other decision."""
    if not decision.startswith(TRAINER_LOST_PREFIX):
        return None
    rank, _, why = decision[len(TRAINER_LOST_PREFIX) :].partition(b" ")
    return int(rank), why.decode(errors="replace")


class ReceiverFailure(enum.Enum):
    """Why a receiver is in a report's ``failed`` (the text there says more)."""

    LEFT_OUT = "left out"  # known dead since an earlier push: not asked
    DIED = "died"  # its process died during the push
    FAILED = "failed"  # its call raised
    NOT_COMMITTED = "not committed"  # it ended without making the version its own (the vote aborted)

    @property
    def ends_the_version(self) -> bool:
        """Whether this receiver failing this way keeps an all-or-none version from committing
        (one left out, not in the push, does not)."""
        return self is not ReceiverFailure.LEFT_OUT

    @property
    def fault_of_its_own(self) -> bool:
        """Whether it failed by itself (for telemetry), not as a consequence of the push's abort."""
        return self in (ReceiverFailure.DIED, ReceiverFailure.FAILED)


class BucketKind(bytes, enum.Enum):
    """The kind byte of a bucket message."""

    RING = b"R"  # in the sender's staging slot (payload: slot size, segment name)
    OBJECT = b"O"  # an announced object of the sender's agent (payload: its announcement)
    MIXED = b"M"  # some pieces in the staging slot, the others (read in place) an announced object
    ABORT = b"A"  # the sender aborted: this bucket and later ones will not come (payload: why)


_HEADER = struct.Struct("<cQ")  # kind, checksum
SLOT = struct.Struct("<Q")  # a ring payload: the slot's size, then the segment's name
_MIXED = struct.Struct("<II")  # ring payload bytes, pieces (then the ring payload, a byte per piece, the announcement)


def bucket_message(kind: BucketKind, check: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind.value, check) + payload


def parse_bucket_message(data: bytes, what: str) -> tuple[BucketKind, int, bytes]:
    """(kind, checksum, payload) of a bucket message; ``TensorwireError`` naming ``what``
    for one that is not."""
    try:
        kind = BucketKind(data[:1])
        _kind, check = _HEADER.unpack_from(data)
    except (ValueError, struct.error):
        raise TensorwireError(
            f"{what}: not a bucket message ({len(data)} bytes, kind {data[:1]!r}; "
            f"expected one of {', '.join(k.value.decode() for k in BucketKind)})"
        ) from None
    return kind, check, data[_HEADER.size :]


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
