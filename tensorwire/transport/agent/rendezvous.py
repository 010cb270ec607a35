"""The rendezvous mailbox: small keyed values that agents leave for one another.

Transports use it to exchange connection details (both sides of a connection publish and
read keys of one *group*); collectives use it as a message channel and as the store of
their process groups. Values arrive here from this process (``put``) or from a peer's
``Rendezvous`` control call; readers wait for a key with a deadline.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from tensorwire.errors import TransferTimeoutError

__all__ = ["MAX_GROUPS", "MAX_VALUE_NBYTES", "Mailbox"]

MAX_GROUPS = 256  # groups being connected at once; older ones are dropped
MAX_VALUE_NBYTES = 1024 * 1024  # an announcement of a bucket of many tensors


class Mailbox:
    """Keys by group, at most :data:`MAX_GROUPS` groups (the oldest are dropped); thread-safe."""

    def __init__(self) -> None:
        self._groups: collections.OrderedDict[str, dict[str, bytes]] = collections.OrderedDict()
        self._changed = threading.Condition(threading.Lock())

    def put(self, group: str, key: str, value: bytes) -> None:
        """Set ``key`` of ``group`` and wake its readers."""
        with self._changed:
            self._groups.setdefault(group, {})[key] = value
            self._groups.move_to_end(group)
            while len(self._groups) > MAX_GROUPS:
                self._groups.popitem(last=False)
            self._changed.notify_all()

    def wait(self, group: str, key: str, *, timeout_s: float, take: bool = False) -> bytes:
        """The value of ``key`` of ``group`` once set (removed with ``take``).

        Raises:
            TransferTimeoutError: Not set within ``timeout_s``.
        """
        return self._first(group, [key], timeout_s=timeout_s, take=take, what=f"key {key!r} not set")[1]

    def take_any(self, group: str, keys: Sequence[str], *, timeout_s: float) -> tuple[int, bytes]:
        """The first of ``keys`` of ``group`` that is set (the earliest in ``keys`` among those
        set), removed: its index and value.

        Raises:
            TransferTimeoutError: None set within ``timeout_s``.
        """
        return self._first(group, keys, timeout_s=timeout_s, take=True, what=f"none of {len(keys)} key(s) set")

    def _first(self, group: str, keys: Sequence[str], *, timeout_s: float, take: bool, what: str) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                table = self._groups.get(group, {})
                for index, key in enumerate(keys):
                    value = table.pop(key, None) if take else table.get(key)
                    if value is not None:
                        return index, value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(f"rendezvous {group}: {what} before the deadline")
                self._changed.wait(left)

    def forget(self, group: str) -> None:
        """Drop every key of ``group``."""
        with self._changed:
            self._groups.pop(group, None)
