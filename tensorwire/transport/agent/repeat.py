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

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tensorwire.errors import TensorwireError, TransferTimeoutError
from tensorwire.transport import registry
from tensorwire.transport.agent.metrics import TransferRecord

if TYPE_CHECKING:
    import torch

    from tensorwire.transport.contract import FetchRequest, Transport

__all__ = ["Repeat"]

logger = logging.getLogger(__name__)

_NOT_MADE = object()  # a repeat's transport repeater, before its first use


class Repeat:
    """A fetch that succeeded, ready to run again into the same buffers.

    Args:
        transport: The transport that moved it.
        request: The request it ran (its deadline is replaced each time).
        record: The first fetch's record (each repeat records a copy with its own duration).
        notify: Where records go (the agent's).
    """

    __slots__ = ("_first", "_notify", "_repeater", "_request", "_transport", "_version")

    def __init__(
        self,
        transport: Transport,
        request: FetchRequest,
        *,
        record: TransferRecord,
        notify: Callable[[TransferRecord], None],
    ) -> None:
        self._transport = transport
        self._request = request
        # each repeat's record: the first fetch's, with its own duration (made positionally: cheaper)
        self._first = (record.transport, record.reason, record.nbytes, record.src, record.dst)
        self._notify = notify
        self._repeater: Any = _NOT_MADE  # the transport's ``repeater``, made by the first repeat
        self._version = registry.version()

    def __call__(self, dst: Sequence[torch.Tensor], deadline: float) -> TransferRecord | None:
        """Fetch again into ``dst`` (the buffers of the first fetch, in the object's order) by
        ``deadline`` (``time.monotonic()``): the record, or None when an ordinary fetch must do it.

        Raises:
            TransferTimeoutError: The deadline passed (a READ may still be writing into ``dst``:
                no other fetch may start into them).
        """
        if registry.version() != self._version:
            return None
        start = time.perf_counter()
        if not self._repeated(dst, deadline):
            try:
                self._transport.fetch(self._request._replace(deadline=deadline), dst)
            except TransferTimeoutError:
                raise
            except TensorwireError:
                return None
        transport, reason, nbytes, src, where = self._first
        seconds = time.perf_counter() - start
        # zero_copy False, failed_attempts 0, placed_s 0.0, repeated True
        done = TransferRecord(transport, reason, nbytes, seconds, src, where, False, 0, 0.0, True)
        self._notify(done)
        return done

    def _repeated(self, dst: Sequence[torch.Tensor], deadline: float) -> bool:
        """Whether the transport's ``repeater`` did it, made on the first repeat (not on every
        fetch into buffers, most of which are never repeated). One that raises did not, unless
        the deadline passed, and is not used again: ``fetch`` tries and says what is wrong."""
        repeater = self._repeater
        try:
            if repeater is _NOT_MADE:
                repeater = self._repeater = self._transport.repeater(self._request, dst)
            return repeater is not None and repeater(deadline)
        except TransferTimeoutError:
            raise
        except Exception:  # any transport's, plug-ins included
            logger.debug("transport %s: its repeater failed; repeats use fetch()", self._transport.name, exc_info=True)
            self._repeater = None
            return False
