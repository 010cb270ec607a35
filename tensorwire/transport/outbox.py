"""The holder outbox: holder operations sent to owners in order, batched, in the background.

One thread per process drains the queue: operations that arrive together are grouped by owner
and sent as one ``Holders`` call per owner, all owners at once. Order per owner is kept
(``PIN`` before the sender's own ``RELEASE``), which the holder protocol relies on. A fetch
never waits for these messages.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from tensorwire.transport.base import PeerInfo
from tensorwire.transport.control import ControlClient
from tensorwire.transport.wire import HolderOpKind, messages

__all__ = ["Outbox"]

logger = logging.getLogger(__name__)


class Outbox:
    """Queue and sender of holder operations (used by the agent; thread-safe).

    Args:
        client: The agent's control client.
        sender: Called for the ``Peer`` message of this process (encoded once per batch).
        address: The address to reach an owner at.
        may_be_alive: Whether an owner may still run (exited owners need no messages).
        rpc_timeout_s: Upper bound of one ``Holders`` call.
    """

    def __init__(
        self,
        client: ControlClient,
        *,
        sender: Callable[[], Any],
        address: Callable[[PeerInfo], str],
        may_be_alive: Callable[[PeerInfo], bool],
        rpc_timeout_s: float,
    ) -> None:
        self._client = client
        self._sender = sender
        self._address = address
        self._may_be_alive = may_be_alive
        self._rpc_timeout_s = rpc_timeout_s
        self._queue: queue.Queue[tuple[PeerInfo, Any] | None] = queue.Queue()
        self._pending = 0
        self._seq: dict[str, int] = {}  # owner agent id -> number of its last batch (only the sender thread)
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="tensorwire-holders", daemon=True)
        self._thread.start()

    def send(self, owner: PeerInfo, kind: HolderOpKind, object_id: bytes, token: bytes, pin_id: bytes = b"") -> None:
        """Queue one operation for ``owner``; returns at once."""
        op = messages["HolderOp"](kind=int(kind), object_id=object_id, token=token, pin_id=pin_id)
        with self._idle:
            self._pending += 1
        self._queue.put((owner, op))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued operation was sent (or given up); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Stop the sender thread after what is queued now."""
        self._queue.put(None)

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            time.sleep(0.001)  # let a burst of references collect into one message
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                batch.append(more)
            by_owner: dict[str, tuple[PeerInfo, list[Any]]] = {}
            for owner, op in batch:
                by_owner.setdefault(owner.agent_id, (owner, []))[1].append(op)
            try:
                self._deliver(list(by_owner.values()))
            except Exception:
                logger.warning("sending %d holder messages failed", len(batch), exc_info=True)
            finally:
                with self._idle:
                    self._pending -= len(batch)
                    self._idle.notify_all()

    def _deliver(self, batches: list[tuple[PeerInfo, list[Any]]]) -> None:
        """Send each owner its operations, all owners at once; retry owners that may be alive.

        An owner that has exited needs no message (its objects are gone); one that stays
        unreachable is given up after three tries, and its holds expire by the owner's own
        holder check.
        """
        sender = self._sender()
        numbered = []
        for owner, ops in batches:  # a retry keeps its number: the owner applies each number once, in order
            self._seq[owner.agent_id] = self._seq.get(owner.agent_id, 0) + 1
            numbered.append((owner, ops, self._seq[owner.agent_id]))
        for attempt in range(3):
            timeout_s = min(self._rpc_timeout_s, 2.0 * (attempt + 1))
            calls = [
                (owner, ops, seq, self._client.call_async(
                    self._address(owner), "Holders", messages["HolderBatch"](sender=sender, ops=ops, seq=seq),
                    "HolderReply", timeout_s=timeout_s,
                ))
                for owner, ops, seq in numbered
            ]  # fmt: skip
            retry = []
            for owner, ops, seq, call in calls:
                try:
                    call.result()
                except grpc.RpcError as e:
                    if self._may_be_alive(owner) and e.code() != grpc.StatusCode.UNAUTHENTICATED:
                        retry.append((owner, ops, seq))
                    else:
                        logger.debug("dropping %d holder messages for %s: %s", len(ops), owner.agent_id, e.code())
            if not retry:
                return
            numbered = retry
            time.sleep(0.05 * (attempt + 1))
        for owner, ops, _ in numbered:
            logger.warning("could not deliver %d holder messages to agent %s", len(ops), owner.agent_id)
