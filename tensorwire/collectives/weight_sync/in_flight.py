"""``sync.push_async()``: a push that runs while the trainers train the next step.

::

    handle = sync.push_async()        # returns once every trainer copied its bytes of version k
    trainer_step()                    # step k+1 changes the trainers' tensors meanwhile
    report = handle.result()          # version k on every receiver (or the push's error)

When :meth:`..sync.WeightSync.push_async` returns, the trainers' bytes of the version are fixed:
each trainer copied the tensors it serves the sync from (:mod:`.members.snapshot`: one copy of
its synced tensors on their device, held until the push ends), so the optimizer may change
them at once. With ``snapshot=False`` nothing is copied and the caller promises that the
trainers' tensors stay as they are until the handle is done (a trainer that trains meanwhile
would send a mix of steps). The push itself runs on a thread of the driver, exactly as
``push()`` (tries, failover, all-or-none), except that the trainers serve it in their
``tensorwire`` concurrency group (:data:`tensorwire.runtime.ray.hooks.HOOK_GROUP`), beside the
calls of their own that train. One push per sync at a time: ``push``, ``push_async``,
``prepare``, ``add_receiver`` and ``remove_receiver`` refuse while one is in flight
(``RuntimeError``); ``close`` waits for it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tensorwire.collectives.weight_sync.members import snapshot
from tensorwire.collectives.weight_sync.planning.layout import ParamPiece
from tensorwire.collectives.weight_sync.report.summary import SyncReport
from tensorwire.errors import TensorwireError
from tensorwire.runtime.ray import calls
from tensorwire.runtime.ray.hooks import call_hook, call_hook_concurrently

__all__ = ["PushHandle", "start"]

logger = logging.getLogger(__name__)


class Overlapping(Protocol):
    """What an overlapped push reads and sets of its :class:`..sync.WeightSync`."""

    name: str
    sync_id: str
    source: str | None
    timeout_s: float
    trainers: tuple[Any, ...]
    trainer_layouts: list[tuple[ParamPiece, ...]]
    overlapped: bool

    @property
    def version(self) -> int: ...


class PushHandle:
    """A push in flight (:meth:`..sync.WeightSync.push_async`).

    Attributes:
        version: The version it pushes.
        snapshot_nbytes: Bytes the trainers copied to fix the version (0 with ``snapshot=False``).
        snapshot_s: Seconds ``push_async`` spent before returning (the trainers' copies).
    """

    def __init__(
        self, version: int, snapshot_nbytes: int, snapshot_s: float, future: concurrent.futures.Future[SyncReport]
    ) -> None:
        self.version = version
        self.snapshot_nbytes = snapshot_nbytes
        self.snapshot_s = snapshot_s
        self._future = future

    def done(self) -> bool:
        """Whether the push ended (committed or failed)."""
        return self._future.done()

    def result(self, timeout_s: float | None = None) -> SyncReport:
        """The push's report once it ended (what ``push()`` returns), or its error raised.

        Raises:
            TimeoutError: Not done within ``timeout_s`` (None: wait for the push's own deadlines).
            TrainerLost, TensorwireError: As ``push()`` raises them.
        """
        try:
            return self._future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"push v{self.version} is not done within {timeout_s} s") from None

    @property
    def report(self) -> SyncReport | None:
        """The report of a push that ended well; None while it runs or when it failed."""
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()

    def __repr__(self) -> str:
        state = "running" if not self.done() else "done" if self.report is not None else "failed"
        return f"PushHandle(v{self.version}, {state})"


def start(sync: Overlapping, push: Callable[[], SyncReport], *, snapshot: bool) -> PushHandle:
    """Fix the trainers' bytes of the next version (``snapshot``: each copies them), then run
    ``push`` (the sync's whole push) on a thread of its own, the trainers serving it beside
    their own calls; the handle of it.

    Raises:
        TensorwireError: A trainer could not copy its tensors (nothing was pushed).
    """
    version = sync.version + 1
    began = time.perf_counter()
    trainers = tuple(sync.trainers)  # (a failover may drop one: its copy is let go too)
    nbytes = _take(sync, trainers, version) if snapshot else 0
    future: concurrent.futures.Future[SyncReport] = concurrent.futures.Future()
    handle = PushHandle(version, nbytes, time.perf_counter() - began, future)

    def run() -> None:
        sync.overlapped = True
        try:
            report, error = push(), None
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the handle
            report, error = None, e
        sync.overlapped = False  # (before the handle is done: a next push may start then)
        if snapshot:
            try:
                _drop(sync, trainers, version)
            except Exception:  # noqa: BLE001 - a copy left behind is replaced by the next one
                logger.warning("weight sync %s: the trainers' copies of v%d were not dropped", sync.name, version)
        if error is None:
            future.set_result(report)
        else:
            future.set_exception(error)

    threading.Thread(target=run, name=f"tensorwire-push-{sync.name}-v{version}", daemon=True).start()
    return handle


def _take(sync: Overlapping, trainers: tuple[Any, ...], version: int) -> int:
    """Every trainer copies its synced tensors for ``version``, after the calls queued on it
    before (a training step started just before ``push_async`` ends first); the bytes copied.
    A trainer that died is passed over (the push leaves it out and fails over, or fails)."""
    refs = [
        call_hook(t, snapshot.take, sync.sync_id, version, sync.source, layout)
        for t, layout in zip(trainers, sync.trainer_layouts, strict=True)
    ]
    _done, late = calls.wait_all(refs, timeout_s=sync.timeout_s)  # one deadline for all
    total, failure = 0, ""
    for position, ref in enumerate(refs):
        if any(ref is call for call in late):
            failure = failure or f"trainer {position} did not copy its tensors within {sync.timeout_s:g} s"
            continue
        outcome = calls.settle(ref, timeout_s=1.0)
        if outcome.failure is calls.CallFailure.ACTOR_DIED:
            continue
        if not outcome.ok:
            failure = failure or f"trainer {position} could not copy its tensors: {outcome.reason}"
            continue
        total += outcome.value[0]
    if failure:
        _drop(sync, trainers, version)
        raise TensorwireError(f"weight sync {sync.name}, push v{version}: {failure}")
    return total


def _drop(sync: Overlapping, trainers: tuple[Any, ...], version: int) -> None:
    """The trainers let go of their copies (dead or late ones are passed over)."""
    refs = [call_hook_concurrently(t, snapshot.drop, sync.sync_id, version) for t in trainers]
    done, late = calls.wait_all(refs, timeout_s=min(sync.timeout_s, 30.0))
    for ref in done:
        calls.settle(ref, timeout_s=1.0)
    if late:
        logger.warning("weight sync %s: %d trainer(s) did not drop their copy of v%d", sync.name, len(late), version)
