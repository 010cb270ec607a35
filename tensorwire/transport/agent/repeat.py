"""A fetch made again: the same object, through the transport that moved it, into the same
caller's buffers.

A consumer that reuses its receive buffers fetches one object into them again and again (a
rollout buffer refilled, a small control tensor polled). The first fetch works out the route
(selection, fallback order), the request and where the bytes land; :class:`Repeat` keeps what
it found and, called again with the same buffers, only runs the transport's fetch (or its
``repeater``, cheaper still: a same-node read with its iovecs made once) and records it.
Whatever it cannot vouch for it leaves to an ordinary fetch: it answers None (the registry
changed, or the transport failed: the ordinary fetch then says why, or falls back).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tensorwire.errors import TensorwireError, TransferTimeoutError
from tensorwire.transport import registry
from tensorwire.transport.agent.metrics import TransferRecord
from tensorwire.transport.contract import FetchRequest

if TYPE_CHECKING:
    import torch

    from tensorwire.transport.contract import Transport

__all__ = ["Repeat"]


class Repeat:
    """A fetch that succeeded, ready to run again into the same buffers.

    Args:
        transport: The transport that moved it.
        request: The request it ran (its deadline is replaced each time).
        dst: The buffers it filled (a transport's ``repeater`` may keep their addresses).
        record: The first fetch's record (each repeat records a copy with its own duration).
        notify: Where records go (the agent's).
        timeout_s: The default deadline of one repeat.
    """

    __slots__ = ("_asked", "_notify", "_reason", "_record", "_repeater", "_timeout_s", "_transport", "_version")

    def __init__(
        self,
        transport: Transport,
        request: FetchRequest,
        *,
        dst: Sequence[torch.Tensor],
        record: TransferRecord,
        notify: Callable[[TransferRecord], None],
        timeout_s: float,
    ) -> None:
        self._transport, self._notify, self._timeout_s = transport, notify, timeout_s
        self._asked = tuple(request)[:-1]  # all but the deadline (a new request costs less than ``_replace``)
        self._repeater = transport.repeater(request, dst)
        self._record, self._reason = record, f"{record.reason} (repeated)"
        self._version = registry.version()

    def __call__(self, dst: Sequence[torch.Tensor], timeout_s: float | None) -> TransferRecord | None:
        """Fetch again into ``dst`` (the buffers of the first fetch, in the object's order):
        the record, or None when an ordinary fetch must do it.

        Raises:
            TransferTimeoutError: The deadline passed (a READ may still be writing into ``dst``:
                no other fetch may start into them).
        """
        if registry.version() != self._version:
            return None
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        start = time.perf_counter()
        if self._repeater is None or not self._repeater(deadline):
            try:
                self._transport.fetch(FetchRequest(*self._asked, deadline), dst)
            except TransferTimeoutError:
                raise
            except TensorwireError:
                return None
        first = self._record
        done = TransferRecord(
            first.transport, self._reason, first.nbytes, time.perf_counter() - start, first.src, first.dst, False
        )
        self._notify(done)
        return done
