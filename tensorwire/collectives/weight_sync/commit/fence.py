"""A receiver's fence held across a whole in-place push (``aside="none"``), by a thread of its own.

An all-or-none push without shadows writes a version straight into the receiver's tensors, so
readers must not see them from the receiver's vote until it publishes the version, across a
failover's tries (separate calls, perhaps on other threads). One thread per hold enters the fence
(any lock or context manager, an ``RLock`` too: it is entered and left on that thread) and
leaves it when told, or by itself once the hold outlives its limit: the time left to the call
that writes, or ``timeout_s`` between a failover's tries (the driver gone). The caller then sees
``expired``: the tensors may be torn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from tensorwire.errors import TensorwireError

__all__ = ["FenceHold"]

logger = logging.getLogger(__name__)

_TICK_S = 0.5  # how often the holder looks at its limit (the limit may be moved meanwhile)


class FenceHold:
    """The fence ``enter()`` gives, held by a thread from :meth:`take` until :meth:`let_go`
    (``on_expire`` runs, inside the fence, if the hold outlived its limit)."""

    def __init__(
        self, enter: Callable[[], AbstractContextManager[object]], what: str, on_expire: Callable[[], None]
    ) -> None:
        self.what = what
        self._on_expire = on_expire
        self.expired = False
        self._enter = enter
        self._until = time.monotonic()
        self._entered = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hold, name="tw-fence-hold", daemon=True)

    def take(self, *, timeout_s: float, limit_s: float) -> None:
        """Hold the fence (waiting at most ``timeout_s`` for readers to leave it) for at most ``limit_s``.

        Raises:
            TensorwireError: The fence was not free in time, or entering it failed.
        """
        self._until = time.monotonic() + timeout_s + limit_s
        self._thread.start()
        if not self._entered.wait(timeout_s):
            self._done.set()  # leaves at once if it gets in later
            raise TensorwireError(f"{self.what}: the fence was not free within {timeout_s:g} s")
        if self._error is not None:
            raise TensorwireError(f"{self.what}: taking the fence failed: {self._error}") from self._error

    def extend(self, limit_s: float) -> None:
        """Hold it at most ``limit_s`` from now (instead of the limit set before)."""
        self._until = time.monotonic() + limit_s

    def let_go(self, *, timeout_s: float = 5.0) -> None:
        """Leave the fence (returns once it was left, or after ``timeout_s``)."""
        self._done.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def held(self) -> bool:
        """Whether the fence is held now (entered, not let go, not expired)."""
        return self._entered.is_set() and self._error is None and not self._done.is_set() and not self.expired

    def _hold(self) -> None:
        try:
            with self._enter():
                self._entered.set()
                while not self._done.wait(max(0.0, min(_TICK_S, self._until - time.monotonic()))):
                    if time.monotonic() >= self._until:
                        self.expired = True
                        self._on_expire()  # before readers get in
                        logger.warning("%s: the fence was held past its limit: let go (tensors may be torn)", self.what)
                        return
        except BaseException as e:  # noqa: BLE001 - reported to take()
            self._error = e
            self._entered.set()
