"""The one bucket policy of a weight sync: how big a bucket is, how many are in flight, how a
stream's pieces are cut into buckets, how big a staging slot is, and how long a push may take.

* A push moves each stream in buckets of about ``bucket_bytes`` (default
  :data:`DEFAULT_BUCKET_BYTES`): a piece larger than that is split by rows (:func:`split_rows`),
  and pieces are grouped in order (:func:`cut`).
* A server has at most :data:`IN_FLIGHT` buckets published at once (double buffering: it
  prepares bucket k+1 while its readers copy bucket k), so its staging is
  ``IN_FLIGHT`` slots of the stream's largest bucket (:func:`slot_nbytes`).
* Every wait inside a push has ``timeout_s``; the whole push has
  :func:`push_deadline_s` (one ``timeout_s`` per bucket, plus two for setup and the commit).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tensorwire.transport.packing import InOrderGroups, packed_layout

__all__ = ["DEFAULT_BUCKET_BYTES", "IN_FLIGHT", "cut", "push_deadline_s", "slot_nbytes", "split_rows"]

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
IN_FLIGHT = 2  # buckets a server has published at once (double buffering)


def cut(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices cut in order into buckets of at most ``bucket_bytes`` (a larger item gets a
    bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    groups = InOrderGroups(bucket_bytes)
    buckets = [closed for index, size in enumerate(nbytes) if (closed := groups.add(index, size))]
    if rest := groups.rest():
        buckets.append(rest)
    return buckets


def split_rows(nbytes: int, itemsize: int, bucket_bytes: int) -> int | None:
    """The most elements a piece of ``nbytes`` may keep per part so that each fits a bucket
    (None: it fits whole)."""
    return None if nbytes <= bucket_bytes else max(1, bucket_bytes // itemsize)


def slot_nbytes(buckets: Iterable[Iterable[int]]) -> int:
    """A staging slot for a stream whose buckets hold pieces of these sizes: its largest bucket
    packed (at least 1 byte)."""
    return max((packed_layout(bucket)[1] for bucket in buckets), default=1) or 1


def push_deadline_s(timeout_s: float, buckets: int) -> float:
    """How long a whole push of ``buckets`` buckets may take, when each wait has ``timeout_s``
    (the driver's wait and the receivers' decision wait use the same)."""
    return timeout_s * (buckets + 2)
