"""The holder outbox: holder operations sent to owners in order, batched, in the background.

One thread per process sends them. Operations that arrive together are grouped by owner and
sent as one numbered ``Holders`` call per owner, all owners at once. Per owner one batch is on
its way at a time, and what arrives meanwhile waits for its answer: order per owner is kept
(``PIN`` before the sender's own ``RELEASE``), which the holder protocol relies on. A batch
that gets no answer (deadline, connection lost or cancelled) is sent again under its number
after a growing pause, while other owners' batches go on; the owner applies each number once,
so a late first call and its retry count once. Any other error gives the batch up. A fetch
never waits for these messages.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from tensorwire.transport.agent.control import ControlClient
from tensorwire.transport.agent.wire import HolderOpKind, messages
from tensorwire.transport.contract import PeerInfo

__all__ = ["Outbox"]

logger = logging.getLogger(__name__)

_MAX_PAUSE_S = 2.0  # longest pause between two tries of one batch
_WARN_SILENT_S = 30.0  # a batch unanswered this long is warned about (once per batch)
_REFUSED_S = 5.0  # connections refused this long: nobody listens (a SIGKILLed agent leaves its socket)
_NO_ANSWER = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


@dataclass(frozen=True)
class _Queued:
    """An operation for ``owner`` (from :meth:`Outbox.send`)."""

    owner: PeerInfo
    op: Any


@dataclass(frozen=True)
class _Answer:
    """How the call of batch ``seq`` to owner ``agent_id`` ended (``error`` None: applied)."""

    agent_id: str
    seq: int
    error: BaseException | None


@dataclass
class _Lane:
    """What is on its way to one owner (only the sender thread touches it)."""

    owner: PeerInfo
    waiting: list[Any] = field(default_factory=list)  # operations not in a batch yet
    batch: list[Any] = field(default_factory=list)  # the numbered batch not yet answered
    seq: int = 0  # the number of the last batch made
    in_flight: bool = False
    tries: int = 0
    retry_at: float = 0.0
    first_sent: float = 0.0  # when this batch was first sent
    warned: bool = False

    def due(self, now: float) -> bool:
        if self.in_flight:
            return False
        return (bool(self.batch) and now >= self.retry_at) or (not self.batch and bool(self.waiting))

    def count(self) -> int:
        return len(self.batch) + len(self.waiting)


class Outbox:
    """Queue and sender of holder operations (used by the agent; thread-safe).

    Args:
        client: The agent's control client.
        sender: Called for the ``Peer`` message of this process (encoded once per batch).
        address: The address to reach an owner at.
        may_be_alive: Whether an owner may still run (exited owners need no messages).
        retry_for_s: How long to keep trying an owner that may be alive but does not answer.
        rpc_timeout_s: Upper bound of one ``Holders`` call.
    """

    def __init__(
        self,
        client: ControlClient,
        *,
        sender: Callable[[], Any],
        address: Callable[[PeerInfo], str],
        may_be_alive: Callable[[PeerInfo], bool],
        retry_for_s: Callable[[PeerInfo], float],
        rpc_timeout_s: float,
    ) -> None:
        self._client = client
        self._sender = sender
        self._address = address
        self._may_be_alive = may_be_alive
        self._retry_for_s = retry_for_s
        self._rpc_timeout_s = rpc_timeout_s
        # SimpleQueue: its put() is re-entrant, and finalizers of references send from any thread
        self._queue: queue.SimpleQueue[_Queued | _Answer | None] = queue.SimpleQueue()
        self._lanes: dict[str, _Lane] = {}  # owner agent id -> its lane
        self._pending = 0
        self._closed = False
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="tensorwire-holders", daemon=True)
        self._thread.start()

    def send(self, owner: PeerInfo, kind: HolderOpKind, object_id: bytes, token: bytes, pin_id: bytes = b"") -> None:
        """Queue one operation for ``owner``; returns at once (dropped once closed)."""
        op = messages["HolderOp"](kind=int(kind), object_id=object_id, token=token, pin_id=pin_id)
        with self._idle:
            if self._closed:
                return
            self._pending += 1
            self._queue.put(_Queued(owner, op))

    def flush(self, *, timeout_s: float = 10.0) -> bool:
        """Wait until every queued operation was delivered (or given up); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Stop the sender thread; what is not delivered then is given up (callers flush first)."""
        with self._idle:
            self._closed = True
            self._queue.put(None)

    # ------------------------------------------------------------------ the sender thread

    def _loop(self) -> None:
        while True:
            stopping = False
            for item in self._next_items():
                if item is None:
                    stopping = True
                elif isinstance(item, _Queued):
                    lane = self._lanes.setdefault(item.owner.agent_id, _Lane(item.owner))
                    lane.waiting.append(item.op)
                else:
                    self._guarded(item.agent_id, functools.partial(self._answered, item))
            if stopping:
                self._give_up_all()
                return
            now = time.monotonic()
            for lane in [lane for lane in self._lanes.values() if lane.due(now)]:
                self._guarded(lane.owner.agent_id, functools.partial(self._start, lane))

    def _guarded(self, agent_id: str, step: Callable[[], None]) -> None:
        """Run one step for an owner; a bug in it gives up that owner's messages, never the thread."""
        try:
            step()
        except Exception:  # the thread must live on: every owner depends on it
            logger.warning("holder messages to agent %s failed; giving them up", agent_id, exc_info=True)
            lane = self._lanes.get(agent_id)
            if lane is not None:
                lane.in_flight = False
                self._drop(lane)

    def _next_items(self) -> list[_Queued | _Answer | None]:
        """Block until something arrives or a retry is due, then take the burst that came with it."""
        now = time.monotonic()
        retries = [lane.retry_at for lane in self._lanes.values() if lane.batch and not lane.in_flight]
        try:
            first = self._queue.get(timeout=max(0.0, min(retries) - now) if retries else None)
        except queue.Empty:
            return []
        items = [first]
        time.sleep(0.001)  # let a burst of references collect into one message
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _start(self, lane: _Lane) -> None:
        if not lane.batch:
            lane.seq += 1
            lane.batch, lane.waiting = lane.waiting, []
            lane.tries, lane.first_sent, lane.warned = 0, time.monotonic(), False
        seq = lane.seq
        lane.in_flight = True
        agent_id = lane.owner.agent_id
        timeout_s = min(self._rpc_timeout_s, 2.0 * (lane.tries + 1))
        message = messages["HolderBatch"](sender=self._sender(), ops=lane.batch, seq=seq)
        try:
            call = self._client.call_async(
                self._address(lane.owner), "Holders", message, "HolderReply", timeout_s=timeout_s
            )
        except (grpc.RpcError, ValueError) as e:  # could not even start: answered like a failed call
            self._queue.put(_Answer(agent_id, seq, e))
            return
        call.add_done_callback(lambda done: self._queue.put(_Answer(agent_id, seq, _error_of(done))))

    def _answered(self, answer: _Answer) -> None:
        lane = self._lanes.get(answer.agent_id)
        if lane is None or answer.seq != lane.seq or not lane.in_flight:
            return
        lane.in_flight = False
        if answer.error is None:
            delivered, lane.batch = len(lane.batch), []
            self._done(delivered)
            return
        now = time.monotonic()
        error = answer.error
        code = _code_of(error)
        silent_s = now - lane.first_sent
        if not self._may_be_alive(lane.owner):
            logger.debug("dropping holder messages for exited agent %s", answer.agent_id)  # its objects are gone
            self._drop(lane)
            del self._lanes[answer.agent_id]
        elif (
            code not in _NO_ANSWER
            or silent_s >= self._retry_for_s(lane.owner)
            or (code == grpc.StatusCode.UNAVAILABLE and silent_s >= _REFUSED_S)
        ):
            reason = f"no answer for {silent_s:.0f} s" if code in _NO_ANSWER else "it refused them"
            logger.warning(
                "could not deliver %d holder messages to agent %s: %s (%s)",
                lane.count(),
                answer.agent_id,
                reason,
                code.name if code else repr(error),
            )
            self._drop(lane)
        else:
            if silent_s >= _WARN_SILENT_S and not lane.warned:
                lane.warned = True
                logger.warning(
                    "holder messages to agent %s unanswered for %.0f s; still trying while it may be alive",
                    answer.agent_id,
                    silent_s,
                )
            lane.tries += 1
            lane.retry_at = now + min(_MAX_PAUSE_S, 0.05 * 2 ** min(lane.tries, 6))

    def _drop(self, lane: _Lane) -> None:
        """Give up what is on its way to this owner; its next batch gets a new number."""
        given_up, lane.batch, lane.waiting = lane.count(), [], []
        self._done(given_up)

    def _give_up_all(self) -> None:
        left = sum(lane.count() for lane in self._lanes.values())
        if left:
            logger.debug("closing with %d holder messages not delivered", left)
        for lane in self._lanes.values():
            self._drop(lane)

    def _done(self, count: int) -> None:
        with self._idle:
            self._pending -= count
            self._idle.notify_all()


def _code_of(error: BaseException) -> grpc.StatusCode | None:
    if isinstance(error, grpc.FutureCancelledError):  # the client closed the channel
        return grpc.StatusCode.CANCELLED
    return error.code() if isinstance(error, grpc.RpcError) else None


def _error_of(call: Any) -> BaseException | None:
    """The error a finished call ended with (a cancelled one raises on asking)."""
    try:
        return call.exception()
    except grpc.FutureCancelledError as e:
        return e
