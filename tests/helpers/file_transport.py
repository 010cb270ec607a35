"""A test-only plug-in transport: proves a transport is one module plus one registration.

``testfile`` is one-sided and same-node: the producer writes the packed object into a file in
a private directory; the consumer reads it into its buffers.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from tensorwire.errors import TransportUnavailableError
from tensorwire.transport import (
    Capabilities,
    FetchRequest,
    StoredObject,
    Transport,
    register_transport,
    registered_transports,
)
from tensorwire.transport.packing import byte_view

NAME = "testfile"
_DIR = os.path.join(tempfile.gettempdir(), f"tensorwire-testfile-{os.getuid()}")


def write_object(path: str, obj: StoredObject) -> None:
    """Write ``obj``'s tensors into the file ``path``, each at its packed offset."""
    with open(path, "wb") as f:
        for tensor, meta in zip(obj.tensors, obj.metas, strict=True):
            f.seek(meta.offset)
            f.write(memoryview(byte_view(tensor).numpy()))


def read_object(path: str, request: FetchRequest, dst: Sequence[torch.Tensor], context: Any) -> None:
    """Fill ``dst`` from the file ``path``; a missing file is the owner's state (freed, died)."""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        context.check_owner(request)
        raise
    with f:
        for meta, out in zip(request.metas, dst, strict=True):
            f.seek(meta.offset)
            f.readinto(memoryview(byte_view(out).numpy()))


class FileTransport(Transport):
    name = NAME
    capabilities = Capabilities(one_sided=True, same_process=False, same_node=True, cross_node=False, needs_export=True)

    def export(self, obj: StoredObject) -> bytes | None:
        os.makedirs(_DIR, mode=0o700, exist_ok=True)
        path = os.path.join(_DIR, secrets.token_hex(16))
        write_object(path, obj)
        obj.transport_state[NAME] = path
        return path.encode()

    def release(self, obj: StoredObject) -> None:
        path = obj.transport_state.pop(NAME, None)
        if isinstance(path, str) and os.path.exists(path):
            os.unlink(path)

    def fetch(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
        if request.handle is None:
            raise TransportUnavailableError("no file handle")
        read_object(request.handle.decode(), request, dst, self.context)


def register() -> list[str]:
    """Register ``testfile`` and the package's test-only ``null`` in this process (idempotent);
    returns the registered names."""
    if NAME not in registered_transports():
        register_transport(NAME, "tests.helpers.file_transport:FileTransport")
    if "null" not in registered_transports():
        register_transport("null", "tensorwire.transport.backends.null:NullTransport")
    return registered_transports()
