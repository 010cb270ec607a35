"""A test-only transport found through an entry point: no process calls ``register_transport``.

``testep`` is one-sided and same-node, with a per-peer connection step: every process keeps
its exported objects in its own private directory and publishes that directory as its
connection info (``PeerInfo.transport_info``); a handle names only the file. A consumer loads
a producer's directory once (``load_peer``), on its first fetch from it, and reads files there.

:func:`install` writes a distribution ``tensorwire_testep-0.1.dist-info`` (METADATA and an
``entry_points.txt`` in the ``tensorwire.transports`` group) into a directory; any Python
process with that directory on ``sys.path`` (``PYTHONPATH``) finds the transport.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import tempfile
import threading
from collections.abc import Sequence

import torch

from tensorwire.errors import TransportUnavailableError
from tensorwire.transport import Capabilities, FetchRequest, PeerInfo, StoredObject, Transport
from tensorwire.transport.contract import CostModel
from tests.helpers.file_transport import read_object, write_object

NAME = "testep"
DIST = "tensorwire_testep"


class EntryPointTransport(Transport):
    name = NAME
    capabilities = Capabilities(
        one_sided=True, same_process=False, same_node=True, cross_node=False, needs_export=True, peer_setup=True
    )
    cost_model = CostModel.uniform(fixed_us=50_000, bandwidth_gbps=0.1)  # slow: never chosen unless forced

    def __init__(self, context) -> None:
        super().__init__(context)
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self._dir = os.path.join(root, f"tensorwire-testep-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}")
        self._peers: dict[str, str] = {}  # agent id -> its directory
        self._lock = threading.Lock()
        self.loads = 0

    def connection_info(self) -> str:
        """Any process: the directory this process exports into."""
        return self._dir

    def load_peer(self, peer: PeerInfo, info: str) -> None:
        """Consumer, once per producer: remember its directory (made on its first export)."""
        if not os.path.isabs(info) or not os.path.basename(info).startswith("tensorwire-testep-"):
            raise TransportUnavailableError(f"testep: agent {peer.agent_id} published {info!r}, not a testep directory")
        with self._lock:
            self._peers[peer.agent_id] = info
            self.loads += 1

    def export(self, obj: StoredObject) -> bytes | None:
        os.makedirs(self._dir, mode=0o700, exist_ok=True)  # consumers never make one
        name = secrets.token_hex(16)
        write_object(os.path.join(self._dir, name), obj)
        obj.transport_state[NAME] = name
        return name.encode()

    def release(self, obj: StoredObject) -> None:
        name = obj.transport_state.pop(NAME, None)
        if isinstance(name, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._dir, name))

    def fetch(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
        if request.handle is None:
            raise TransportUnavailableError("testep: no file handle")
        with self._lock:
            directory = self._peers.get(request.owner.agent_id)
        if directory is None:
            raise TransportUnavailableError(f"testep: agent {request.owner.agent_id} was never loaded")
        read_object(os.path.join(directory, request.handle.decode()), request, dst, self.context)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def install(directory: str | os.PathLike[str], *, name: str = NAME, dist: str = DIST) -> pathlib.Path:
    """Write the test distribution ``dist`` into ``directory``; returns the directory to put on
    ``sys.path``/``PYTHONPATH``. ``name`` is the entry point's name (the class's is ``testep``)."""
    site = pathlib.Path(directory)
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[tensorwire.transports]\n{name} = tests.helpers.entry_point_transport:EntryPointTransport\n"
    )
    return site
