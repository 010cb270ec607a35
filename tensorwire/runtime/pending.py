"""Pending results of Ray calls, and how their lifetime joins the holder protocol.

A ``@tw.method`` call returns at once; its result is a Ray ``ObjectRef`` of the
:class:`~tensorwire.runtime.ref.RefState` the method will return. The producer pins the new
object under the state's pin. In each process that holds a pending reference, one
:class:`Pending` stands for all of that process's ``Ref`` objects of the call:

* When the call finishes, a background thread resolves the state and registers this process
  as a holder, consuming the state's pin (the caller) or the transit pin the reference
  travelled under (any other process). The hold is released when the last ``Ref`` object of
  the call in this process is gone.
* Pickling a still-pending reference creates a new transit pin; it is announced to the owner
  when this process resolves the call, before this process's own release, so a receiver is
  covered even if the sender drops its reference at once.

Task results (*staged*) need none of this: their value sits in Ray's object store.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import weakref
from typing import Any

from tensorwire.errors import OwnerDiedError, TransferTimeoutError
from tensorwire.runtime.ray_env import agent as runtime_agent

__all__ = ["Pending"]

logger = logging.getLogger(__name__)

_completions: queue.Queue[tuple[int, Any]] = queue.Queue()
_resolver_lock = threading.Lock()
_resolver_started = False
# Pendings whose call has not finished, by id: kept alive here rather than by the future's
# callback, which would close a reference cycle through Ray's ObjectRef that the garbage
# collector cannot break (and the hold would never be released).
_in_flight: dict[int, Pending] = {}


def _resolver_loop() -> None:
    while True:
        key, future = _completions.get()
        with _resolver_lock:
            pending = _in_flight.pop(key, None)
        try:
            if pending is not None:
                pending._complete(future)
        except Exception:
            logger.warning("resolving a call's result failed", exc_info=True)
        del pending, future  # do not keep the last call's hold alive until the next one


def _start_resolver() -> None:
    global _resolver_started
    with _resolver_lock:
        if not _resolver_started:
            threading.Thread(target=_resolver_loop, name="tensorwire-resolver", daemon=True).start()
            _resolver_started = True


def _map_ray_error(error: BaseException) -> BaseException:
    import ray

    if isinstance(error, ray.exceptions.RayActorError):
        return OwnerDiedError(f"the actor that was producing this value died before returning it: {error}")
    return error


class Pending:
    """One process's view of a pending ``@tw.method`` call (or a staged task result)."""

    def __init__(self, object_ref: Any, *, staged: bool = False, pin_id: bytes = b"", transport: str = "") -> None:
        self.object_ref = object_ref
        self.staged = staged
        self.transport = transport
        self._pin_id = pin_id  # consumed by this process's registration; b"": the state's own pin
        self._queued_pins: list[bytes] = []
        self._state: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        if not staged:
            _start_resolver()
            key = id(self)
            with _resolver_lock:
                _in_flight[key] = self
            object_ref.future().add_done_callback(lambda future: _completions.put((key, future)))

    def done(self) -> bool:
        if self.staged:
            import ray

            ready, _ = ray.wait([self.object_ref], timeout=0)
            return bool(ready)
        return self._done.is_set()

    def _complete(self, future: Any) -> None:
        """Resolver thread: take the call's state and register this process as a holder."""
        try:
            state = future.result()
        except BaseException as e:  # noqa: BLE001 - kept and raised to whoever fetches
            self._error = _map_ray_error(e)
            self._done.set()
            return
        agent = runtime_agent()
        with self._lock:
            for pin_id in self._queued_pins:
                agent.announce_pin(state.desc, pin_id)
            self._queued_pins.clear()
            agent.ref_attached(state.desc, self._pin_id or state.pin_id)
            finalizer = weakref.finalize(self, agent.ref_detached, state.desc)
            finalizer.atexit = False
            self._state = state._replace(pin_id=b"", transport=self.transport or state.transport)
            self._done.set()

    def wait(self, timeout_s: float | None) -> Any:
        """The resolved state; raises the call's error, or ``TransferTimeoutError``."""
        if not self._done.wait(timeout_s):
            raise TransferTimeoutError(f"the producing call has not finished within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._state

    def get_staged(self, timeout_s: float | None) -> Any:
        """Staged results: the value from Ray's object store."""
        import ray

        try:
            return ray.get(self.object_ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TransferTimeoutError(f"the task has not finished within {timeout_s} s") from None
        except ray.exceptions.RayError as e:
            raise _map_ray_error(e) from e

    def reduce(self) -> tuple[Any, tuple[Any, ...]] | None:
        """How a reference of this call pickles while pending; None once resolved."""
        if self.staged:
            return (_rebuild, (self.object_ref, True, b"", self.transport))
        with self._lock:
            if self._done.is_set() and self._error is None:
                return None
            pin_id = secrets.token_bytes(12)
            if not self._done.is_set():
                self._queued_pins.append(pin_id)
            return (_rebuild, (self.object_ref, False, pin_id, self.transport))


def _rebuild(object_ref: Any, staged: bool, pin_id: bytes, transport: str) -> Any:
    from tensorwire.runtime.ref import Ref

    return Ref(pending=Pending(object_ref, staged=staged, pin_id=pin_id, transport=transport))
