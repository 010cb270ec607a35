"""``null``: a test-only transport that moves bytes by plain copy inside the test process.

It lets the layers above the transports (runtime, collectives) be tested with no real
transport underneath, the way a fake device lets a framework's upper layers be tested without
hardware: register it in a test (``register_transport("null", NullTransport)``) and force it,
or unregister the others. It is not a built-in, so no user process ranks it.

It declares every capability a transport inside one process can have: one-sided, host and
CUDA memory, an export per object (its handle names an entry of this process's table, opened
only with the object's token), a zero-copy view, abort (a copy in progress stops at its
deadline), a per-peer connection step (which refuses every other process), and the bytes its
exports hold. Serving other processes is the one thing it cannot do (``same_node`` and
``cross_node`` are off): its table lives in this process's memory.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections.abc import Sequence

import torch

from tensorwire.errors import ObjectFreedError, PermissionDeniedError, TransferTimeoutError, TransportUnavailableError
from tensorwire.transport.contract import (
    Capabilities,
    FetchRequest,
    MemoryKind,
    PeerInfo,
    StoredObject,
    Transport,
)

__all__ = ["NullTransport"]

_table: dict[bytes, tuple[bytes, list[torch.Tensor]]] = {}  # object id -> (token, tensors): this process's exports
_lock = threading.Lock()


class NullTransport(Transport):
    """Copies between tensors of one process through a table of exported objects."""

    name = "null"
    capabilities = Capabilities(
        one_sided=True,
        same_process=True,
        same_node=False,
        cross_node=False,
        memory=frozenset({MemoryKind.HOST, MemoryKind.CUDA}),
        needs_export=True,
        zero_copy_view=True,
        can_abort=True,
        peer_setup=True,
    )
    cost_model = None  # ranked last: used when forced, or when nothing else is registered

    def export(self, obj: StoredObject) -> bytes:
        """Producer: enter the object in this process's table; the handle is its id."""
        with _lock:
            _table[obj.object_id] = (obj.token, list(obj.tensors))
        return obj.object_id

    def export_nbytes(self, obj: StoredObject) -> int:
        return 0  # the table holds the producer's tensors themselves

    def release(self, obj: StoredObject) -> None:
        with _lock:
            _table.pop(obj.object_id, None)

    def connection_info(self) -> str:
        return str(os.getpid())

    def load_peer(self, peer: PeerInfo, info: str) -> None:
        if info != str(os.getpid()):
            raise TransportUnavailableError(f"null moves bytes inside one process; agent {peer.agent_id} is another")

    def _exported(self, request: FetchRequest) -> list[torch.Tensor]:
        with _lock:
            entry = _table.get(request.handle or b"")
        if entry is None:
            raise ObjectFreedError(f"null: object {request.object_id.hex()} is not exported here (freed?)")
        token, tensors = entry
        if not hmac.compare_digest(token, request.token):
            raise PermissionDeniedError("null: wrong capability token for this object")
        return tensors

    def fetch(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
        """Consumer (the producer's own process): copy each exported tensor into ``dst``,
        checking the deadline between tensors."""
        for src, out in zip(self._exported(request), dst, strict=True):
            if time.monotonic() >= request.deadline:
                raise TransferTimeoutError(f"null copy of {request!r}: not complete before the deadline")
            out.copy_(src)

    def view(self, request: FetchRequest) -> list[torch.Tensor]:
        """Consumer: the exported tensors themselves (no copy)."""
        return list(self._exported(request))
