"""Small host objects in one READ: a registered block cut into slots, each holding an object's
bytes and, right after them, its liveness tag.

Over UCX's TCP path each descriptor of a READ costs a network round trip of its own (measured
here: 36 us for one 4 KiB descriptor, 72-82 us for the same 4 KiB plus the 8-byte tag), so an
object whose tensors and tag lie in different places pays two. A producer copies a small host
object (at most :data:`SLOT_NBYTES` with its tag, so smaller than values that travel inline by
default) into a slot of its block when it exports it: its bytes as they are then, as an inline
value's are. A consumer reads the slot in one descriptor into a slot of its own block, checks
the tag there, and copies the bytes out into its buffers. Each process makes its blocks on
first use (``SLOTS`` x ``SLOT_NBYTES``: 8 MiB each for objects and for landing), registered
once and kept; when a block is full, objects and fetches take the usual path.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["SLOTS", "SLOT_NBYTES", "Slab", "fits", "span"]

logger = logging.getLogger(__name__)

SLOT_NBYTES = 32 << 10
SLOTS = 256


def span(nbytes: int) -> int:
    """The bytes one READ of a slot moves: the object's, padding to 8, then the tag."""
    return -(-nbytes // 8) * 8 + 8


def fits(nbytes: int) -> bool:
    return nbytes > 0 and span(nbytes) <= SLOT_NBYTES


class Slab:
    """A block of :data:`SLOTS` slots of :data:`SLOT_NBYTES`, made and registered (through
    ``register``, kept for the process's life) on the first :meth:`take`."""

    def __init__(self, register: Callable[[Any], Any]) -> None:  # register(tensor) -> its registration
        self._register = register
        self._lock = threading.Lock()
        self._free: list[int] = []
        self.buffer: Any = None  # torch uint8 tensor, once made
        self.array: Any = None  # the same bytes as a numpy array (cheaper to slice)
        self.registration: Any = None  # what ``register`` returned for it
        self.base = 0
        self.failed = ""  # why the block could not be made (then every take is None)

    def take(self) -> int | None:
        """A free slot, or None when every slot is in use (or the block could not be made)."""
        with self._lock:
            if self.buffer is None and not self.failed:
                import torch

                buffer = torch.zeros(SLOTS * SLOT_NBYTES, dtype=torch.uint8)
                try:
                    self.registration = self._register(buffer)
                except Exception as e:  # noqa: BLE001 - NIXL raises its own classes: small objects go the usual way
                    self.failed = f"{type(e).__name__}: {e}"
                    logger.warning("nixl: no slab for small objects (%s); they are read where they lie", self.failed)
                    return None
                self.buffer, self.array, self.base = buffer, buffer.numpy(), buffer.data_ptr()
                self._free = list(range(SLOTS - 1, -1, -1))
            return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def address(self, slot: int) -> int:
        return self.base + slot * SLOT_NBYTES

    def word(self, address: int) -> Any:
        """The int64 at ``address`` (in the block) as a one-element array to read and write."""
        offset = address - self.base
        return self.array[offset : offset + 8].view("<i8")

    def fill(self, slot: int, tensors: Sequence[Any]) -> list[tuple[int, int]]:
        """Copy host ``tensors`` (contiguous) one after another into ``slot``: their (address, bytes)."""
        address, rows = self.address(slot), []
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                ctypes.memmove(address, tensor.data_ptr(), nbytes)
            rows.append((address, nbytes))
            address += nbytes
        return rows

    def empty_into(self, slot: int, tensors: Sequence[Any]) -> None:
        """Copy the bytes in ``slot`` out into host ``tensors`` (contiguous), one after another."""
        address = self.address(slot)
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                ctypes.memmove(tensor.data_ptr(), address, nbytes)
            address += nbytes
