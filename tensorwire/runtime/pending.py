"""Pending results of Ray calls, and how their lifetime joins the holder protocol.

A ``@tw.method`` call returns at once; its result is a Ray ``ObjectRef`` of the
:class:`~tensorwire.runtime.ref.RefState` the method will return. The producer pins the new
object under the state's pin. In each process that holds a pending reference, one
:class:`Pending` stands for all of that process's ``Ref`` objects of the call:

* When someone in this process needs the value, the state is taken from Ray and this process
  registers as a holder, consuming the state's pin (the caller) or the transit pin the
  reference travelled under (any other process). The hold is released when the last ``Ref``
  object of the call in this process is gone.
* Pickling a still-pending reference creates a new transit pin, announced to the owner when
  this process settles the call, before its own release: a receiver is covered even if the
  sender drops its reference at once.
* A ``Pending`` dropped before anyone needed its value is settled in the background: its
  queued transit pins are announced and its own pin is consumed, so nothing stays pinned.

Values that travel inline need none of this (their bytes are in the state), and neither do
*staged* task results, whose value sits in Ray's object store.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import secrets
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from tensorwire.errors import OwnerDiedError, TransferTimeoutError
from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.runtime.ray_env import ray_result

__all__ = ["Pending", "pending_ref", "raw_value"]

logger = logging.getLogger(__name__)

# Steps of dropped calls' settlement, run in order by one tensorwire thread: (function, args).
# Finalizers and Ray's thread only put here: SimpleQueue.put takes no lock a finalizer could
# already hold on its thread (a thread pool's submit takes plain locks, and a collection run
# inside any pool's submit, with the finalizer submitting again, blocked that thread for ever).
_settlement: queue.SimpleQueue[tuple[Any, tuple[Any, ...]]] = queue.SimpleQueue()
_settler: threading.Thread | None = None
_settler_lock = threading.Lock()
_kept_past_shutdown: list[Any] = []  # dropped calls' ObjectRefs that Ray was shut down under


def _forget_settlements_in_child() -> None:
    """After ``fork``, in the child: the parent's queued settlements are the parent's (they would
    release its pins a second time), and its settler thread and lock (maybe held at the fork)
    do not exist here. (The parent's ``Pending`` objects that the child drops later settle
    nothing either: :func:`_settle_orphan`.)"""
    global _settlement, _settler, _settler_lock
    _settlement, _settler, _settler_lock = queue.SimpleQueue(), None, threading.Lock()


os.register_at_fork(after_in_child=_forget_settlements_in_child)


def _map_ray_error(error: BaseException) -> BaseException:
    import ray

    if isinstance(error, ray.exceptions.RayActorError):
        return OwnerDiedError(f"the actor that was producing this value died before returning it: {error}")
    return error


def _state_of(value: Any) -> Any:
    from tensorwire.runtime.raycompat import state_of

    return state_of(value)


def raw_value(object_ref: Any, timeout_s: float | None) -> Any:
    """``object_ref``'s value as tensorwire reads it: the reference state, not the fetched value.

    Raises:
        TimeoutError: Not ready within ``timeout_s``. Ray's errors of the call.
    """
    from tensorwire.runtime.raycompat import raw_states

    runtime_agent()  # started here, never while Ray unpickles
    with raw_states():
        return ray_result(object_ref, timeout_s)


@dataclass
class _Unsettled:
    """What a dropped, unsettled ``Pending`` leaves for its background settlement."""

    object_ref: Any
    pin_id: bytes
    queued_pins: list[bytes] = field(default_factory=list)
    settled: bool = False
    pid: int = field(default_factory=os.getpid)  # a forked child's copy is the parent's to settle


def _announce(state: Any, box: _Unsettled) -> None:
    agent = runtime_agent()
    for pin_id in box.queued_pins:
        agent.announce_pin(state.desc, pin_id)
    box.queued_pins.clear()


def _start_settler() -> None:
    """Start the settlement thread (in a forked child, a new one) from ordinary code: never
    from a finalizer, as starting a thread takes plain locks."""
    global _settler
    with _settler_lock:
        if _settler is None or not _settler.is_alive():
            _settler = threading.Thread(target=_settle_forever, name="tensorwire-orphans", daemon=True)
            _settler.start()


def _settle_forever() -> None:
    while True:
        function, args = _settlement.get()
        try:
            function(*args)
        except Exception:  # the thread must live on: later dropped calls depend on it
            logger.warning("settling a dropped call failed", exc_info=True)


def _settle_orphan(box: _Unsettled) -> None:
    """Finalizer of a ``Pending``: settle it in the background if nobody did (in the process
    that made it: a forked child's copy of its parent's ``Pending`` releases nothing)."""
    if not box.settled and box.pid == os.getpid():
        _settlement.put((_watch_orphan, (box,)))


def _watch_orphan(box: _Unsettled) -> None:
    """Have Ray report the end of a dropped call instead of waiting for it inside Ray: a
    thread that is inside Ray when ``ray.shutdown()`` runs makes Ray end the whole process
    (seen in the suite's load run: pytest exited with status 1 and no report). The one call
    into Ray here returns at once. A call that never ends keeps what it pinned until its
    producer exits."""
    import ray

    object_ref, box.object_ref = box.object_ref, None
    if not ray.is_initialized():
        _kept_past_shutdown.append(object_ref)  # freeing it while Ray shuts down would end the process
        return  # Ray is gone, and with it the call and anything it pinned through Ray
    try:
        ended = object_ref.future()  # holds the reference until Ray reports the end
    except Exception:  # noqa: BLE001 - Ray shut down since the check (its core worker is gone)
        _kept_past_shutdown.append(object_ref)
        return
    del object_ref
    ended.add_done_callback(functools.partial(_report_end, box))


def _report_end(box: _Unsettled, ended: Any) -> None:
    """On Ray's thread: hand the outcome, not the future (it holds the ``ObjectRef``), to a
    tensorwire thread, so that the reference is freed on Ray's thread."""
    failed = ended.cancelled() or ended.exception() is not None
    _settlement.put((_release_orphan, (box, None if failed else ended.result())))


def _release_orphan(box: _Unsettled, value: Any) -> None:
    """Release what a dropped call's result pinned (``value``: its state; None: the call
    failed, and pinned nothing)."""
    if value is None:
        return
    try:
        state = _state_of(value)
        if not state.travels_inline:
            _announce(state, box)
            runtime_agent().consume_pin(state.desc, box.pin_id or state.pin_id)
    except Exception:
        logger.warning("releasing an unused call result failed", exc_info=True)


class Pending:
    """One process's view of a pending ``@tw.method`` call (or a staged task result)."""

    def __init__(self, object_ref: Any, *, staged: bool = False, pin_id: bytes = b"", transport: str = "") -> None:
        self.object_ref = object_ref
        self.staged = staged
        self.transport = transport
        self._box = _Unsettled(object_ref, pin_id)
        self._state: Any = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        if not staged:
            _start_settler()
            weakref.finalize(self, _settle_orphan, self._box).atexit = False

    def done(self) -> bool:
        """Whether the call has finished (its value can be fetched without waiting for it)."""
        if self._box.settled:
            return True
        import ray

        ready, _ = ray.wait([self.object_ref], timeout=0)
        return bool(ready)

    def _settle(self, state: Any, error: BaseException | None) -> None:
        """Record the call's state (once) and register this process as a holder of its object."""
        with self._lock:
            box = self._box
            if box.settled:
                return
            if error is not None:
                self._error = _map_ray_error(error)
            elif not state.travels_inline:
                _announce(state, box)
                agent = runtime_agent()
                agent.ref_attached(state.desc, box.pin_id or state.pin_id)
                weakref.finalize(self, agent.ref_detached, state.desc).atexit = False
            if state is not None:
                self._state = state._replace(pin_id=b"", transport=self.transport or state.transport)
            box.queued_pins.clear()
            box.settled = True

    def wait(self, timeout_s: float | None) -> Any:
        """The resolved state; raises the call's error, or ``TransferTimeoutError``."""
        if not self._box.settled:
            try:
                state = _state_of(raw_value(self.object_ref, timeout_s))
            except TimeoutError:
                raise TransferTimeoutError(f"the producing call has not finished within {timeout_s} s") from None
            except Exception as e:  # noqa: BLE001 - recorded, then raised below
                self._settle(None, e)
            else:
                self._settle(state, None)
        if self._error is not None:
            raise self._error
        return self._state

    def get_staged(self, timeout_s: float | None) -> Any:
        """Staged results: the value from Ray's object store."""
        import ray

        try:
            return raw_value(self.object_ref, timeout_s)
        except TimeoutError:
            raise TransferTimeoutError(f"the task has not finished within {timeout_s} s") from None
        except ray.exceptions.RayError as e:
            raise _map_ray_error(e) from e

    def reduce(self) -> tuple[Any, tuple[Any, ...]] | None:
        """How a reference of this call pickles while pending; None once settled successfully."""
        if self.staged:
            return (_rebuild, (self.object_ref, True, b"", self.transport))
        with self._lock:
            if self._box.settled and self._error is None:
                return None
            pin_id = secrets.token_bytes(12)
            if not self._box.settled:
                self._box.queued_pins.append(pin_id)
            return (_rebuild, (self.object_ref, False, pin_id, self.transport))


def pending_ref(object_ref: Any, *, staged: bool = False, pin_id: bytes = b"", transport: str = "") -> Any:
    """A pending (or staged) ``tw.Ref`` of a Ray call's ``object_ref`` (also a ``ray.ObjectRef``)."""
    from tensorwire.runtime.raycompat import ray_ref

    return ray_ref(object_ref, Pending(object_ref, staged=staged, pin_id=pin_id, transport=transport))


def _rebuild(object_ref: Any, staged: bool, pin_id: bytes, transport: str) -> Any:
    return pending_ref(object_ref, staged=staged, pin_id=pin_id, transport=transport)
