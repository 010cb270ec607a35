"""The handle a reference carries for nixl, and how it is signed and opened.

A handle names the owner's NIXL agent, carries the partial metadata of registrations a
consumer may not have loaded, one row per tensor (address, length, device, memory kind) and
the object's liveness slot and tag, and how long the producer keeps an object's memory after
freeing it (its *grace*: a READ that saw the tag and ends within it read intact memory). It
ends in an HMAC keyed by the object's capability token: without the token the handle does not
open.
"""

from __future__ import annotations

import functools
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorwire.errors import TransportError

__all__ = ["ROW", "Handle", "opened"]

_VERSION = 3
_HEADER = struct.Struct("!BHIIIQQIB")  # version, name, partial count, regs, rows, flag address, tag, grace us, packed
ROW = np.dtype([("addr", ">u8"), ("len", ">u8"), ("dev", ">u4"), ("vram", "u1")])
_MAC = 16  # bytes of HMAC-SHA256 (key: the object's token) that end a handle


@dataclass(frozen=True)
class Handle:
    """What a reference carries for nixl: the owner's agent, partial metadata of new
    registrations, the rows of the tensors, the liveness slot and its tag, the producer's grace."""

    name: str
    partials: tuple[bytes, ...]
    rids: tuple[int, ...]
    rows: Any  # producer: a ROW array; decoded: (address, length, device, vram) tuples
    flag_addr: int
    tag: int
    grace_us: int  # freed memory is kept this long: a READ of data and tag ending within half of it is whole
    packed: bool = False  # the rows and then the tag lie in one slot (read as one descriptor): :mod:`.slab`

    def encode(self) -> bytes:
        head = _HEADER.pack(
            _VERSION,
            len(self.name),
            len(self.partials),
            len(self.rids),
            len(self.rows),
            self.flag_addr,
            self.tag,
            self.grace_us,
            self.packed,
        )
        parts = [head, self.name.encode()]
        parts += [struct.pack("!I", len(b)) + b for b in self.partials]
        return b"".join([*parts, np.asarray(self.rids, dtype=">u8").tobytes(), self.rows.astype(ROW).tobytes()])

    def signed(self, token: bytes) -> bytes:
        """The encoded handle and its HMAC under the object's ``token``: opened only with it."""
        body = self.encode()
        return body + hmac.digest(token, body, "sha256")[:_MAC]


@functools.lru_cache(maxsize=64)  # the same reference fetched again: its handle checked and decoded once
def opened(signed: bytes, token: bytes) -> Handle | None:
    """The handle in ``signed`` if ``token`` opens it (its HMAC), else None."""
    data, mac = signed[:-_MAC], signed[-_MAC:]
    if not hmac.compare_digest(hmac.digest(token, data, "sha256")[:_MAC], mac):
        return None
    try:
        version, n_name, n_partial, n_rids, n_rows, flag, tag, grace, packed = _HEADER.unpack_from(data, 0)
        if version != _VERSION:
            raise TransportError(f"nixl: handle version {version} (expected {_VERSION})")
        pos = _HEADER.size + n_name
        name = data[_HEADER.size : pos].decode()
        partials = []
        for _ in range(n_partial):
            (n,) = struct.unpack_from("!I", data, pos)
            partials.append(bytes(data[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        rids, pos = tuple(np.frombuffer(data, ">u8", n_rids, pos).tolist()), pos + 8 * n_rids
        array = np.frombuffer(data, ROW, n_rows, pos)
        if pos + array.nbytes != len(data):
            raise TransportError("nixl: trailing bytes in handle")
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise TransportError(f"nixl: malformed handle ({e})") from None
    return Handle(name, tuple(partials), rids, array.tolist(), flag, tag, grace, bool(packed))
