"""``ucx``: host and CUDA memory between any two processes over UCX (``ucxx``), two-sided.

One UCX worker per process, made on first use, with a progress thread in blocking mode that
wakes at least every millisecond (``epoll_timeout``), so it never hangs and does not spin a
core. Endpoints are made from worker addresses exchanged over the control service's
``Connect`` call, one per peer and direction, and are cached; endpoint error handling is off,
because with it on UCX excludes its shared-memory transports (and falls to TCP, about 5x
slower here). Peer failure is therefore not left to UCX: the shared two-sided protocol
bounds every wait by the request's deadline and checks the peer's process, drops the
endpoint and reconnects on the next transfer.

Tags are sent with ``tag_send``/``tag_recv`` straight from and into the tensors (no copy on
receive); small tensors of one value are packed into few messages. Which UCX transports are
active (``UCX_TLS`` selects them) is in the process's ``PeerInfo.transport_info`` once the worker
started, and in ``tensorwire doctor``. On a machine with RDMA NICs and a system ``libucp``,
the system UCX (which may have InfiniBand; the pip one has none) is preferred
(``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` unless the user set it).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import logging
import os
import re
import threading
import time
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

from tensorwire.errors import TransportError
from tensorwire.transport.config import UCX_ENVIRONMENT_LOCK
from tensorwire.transport.contract import Capabilities, CostModel, Diagnosis, Health, MemoryKind, PeerInfo
from tensorwire.transport.hw import topology
from tensorwire.transport.shutdown import CLOSE_TIMEOUT_S
from tensorwire.transport.two_sided import Connection, PostedOps, TwoSidedTransport

__all__ = ["UcxTransport", "active_transports", "prefer_system_ucx", "ucx_config"]

logger = logging.getLogger(__name__)

_EPOLL_TIMEOUT_MS = 1


def prefer_system_ucx(
    env: MutableMapping[str, str], rdma_nics: list[str] | None = None, system_ucp: str | None = ""
) -> bool:
    """Use a system UCX (which may have InfiniBand) over the pip one (which has none) when this
    machine has RDMA NICs and a system ``libucp``; a user's own setting is kept. Must run
    before ``ucxx`` is imported. Returns whether it set the preference."""
    if "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY" in env:
        return False
    nics = rdma_nics if rdma_nics is not None else topology.rdma_nic_names()
    library = ctypes.util.find_library("ucp") if system_ucp == "" else system_ucp
    if nics and library:
        env["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] = "true"
        logger.info("ucx: RDMA NICs %s and a system UCX (%s) found: preferring it", ", ".join(nics), library)
        return True
    return False


def ucx_config(env: MutableMapping[str, str]) -> dict[str, str]:
    """UCX settings tensorwire asks for; a user's ``UCX_TLS`` is kept.

    ``cma`` (the consumer reads the producer's memory with ``process_vm_readv``) is left out:
    with endpoint error handling off, a producer that dies while ``cma`` reads its memory makes
    UCX abort the *consumer* process (seen in the failure tests), and a failed transfer must
    never kill the processes involved. UCX's shared-memory transports (``posix``, ``sysv``)
    still serve one node; across nodes nothing changes."""
    return {} if "UCX_TLS" in env else {"TLS": "^cma"}


def active_transports(context_info: str) -> list[str]:
    """UCX transport names in a UCP context's info text (e.g. ``["cma", "posix", "tcp"]``)."""
    lines = re.findall(r"^#.*resource.*md.*dev.*flags.*$", context_info, re.MULTILINE)
    return sorted({line.split()[-1].split("/")[0] for line in lines})


class _Worker:
    """The process's UCX context, worker and progress thread.

    The progress thread is tensorwire's own Python thread calling ``progress_worker_event``
    (which releases the GIL while it waits on the worker's epoll descriptor, at most
    ``_EPOLL_TIMEOUT_MS``), not ucxx's ``start_progress_thread``. ucxx stops its own thread by
    queueing a callback that signals a condition variable on the stopping thread's stack and
    waiting for it a bounded time (3 s); when the progress thread runs that callback only
    after the wait gave up (a loaded machine), it signals a condition variable that no longer
    exists and never returns, and the stop's ``join`` hangs for ever (seen in the suite:
    ``WorkerProgressThread::stop`` in ``join``, the progress thread in ``pthread_cond_signal``).
    Our thread stops by a flag it reads after every wait, so stopping it queues nothing.
    """

    def __init__(self) -> None:
        # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer reads and warns about on stdout
        # (breaking machine-readable output); a user's own setting is kept.
        # UCX logs to stdout by default (e.g. "Connection reset by remote peer" when an
        # endpoint of a peer that exited is closed): keep stdout for the program's own output.
        # Under the lock: a NIXL agent made meanwhile hides ucxx's settings from the environment.
        with UCX_ENVIRONMENT_LOCK:
            os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
            os.environ.setdefault("UCX_LOG_FILE", "stderr")
            from ucxx._lib import libucxx as ucx_api
            from ucxx._lib.arr import Array

            self.context = ucx_api.UCXContext(
                config_dict=ucx_config(os.environ), feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
            )
        self.api = ucx_api
        self.array = Array
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._stop = threading.Event()
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._thread = threading.Thread(
            target=self._progress, args=(device,), name="tensorwire-ucx-progress", daemon=True
        )
        self._thread.start()
        self.address = bytes(self.worker.address)
        self.transports = active_transports(self.context.info)
        logger.debug("ucx worker started; active UCX transports: %s", ", ".join(self.transports))

    def _progress(self, device: int | None) -> None:
        if device is not None:  # the progress thread needs a current CUDA context for device memory
            torch.cuda.set_device(device)
        while not self._stop.is_set():
            self.worker.progress_worker_event(_EPOLL_TIMEOUT_MS)

    def endpoint(self, address: bytes) -> Any:
        remote = self.api.UCXAddress.create_from_buffer(address)
        return self.api.UCXEndpoint.create_from_worker_address(self.worker, remote, False)

    def buffer(self, tensor: torch.Tensor) -> Any:
        return self.array(tensor.numpy() if tensor.device.type == "cpu" else tensor)

    def close(self, *, timeout_s: float) -> bool:
        """Stop the progress thread (endpoints are closed first, by the transport); returns
        whether it stopped within ``timeout_s``. A thread that did not stop keeps this worker
        (it is referenced by the thread), so its memory is never freed under it."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _synchronize(buffers: Sequence[torch.Tensor]) -> None:
    for device in {b.device for b in buffers if b.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


class _Requests(PostedOps):
    def __init__(self, requests: list[Any], buffers: Sequence[torch.Tensor]) -> None:
        self._requests = requests
        self._buffers = buffers  # alive until the requests completed

    def poll(self) -> bool:
        for request in self._requests:
            if not request.completed:
                return False
        for request in self._requests:
            try:
                request.check_error()
            except Exception as e:  # noqa: BLE001 - ucxx raises its own hierarchy
                raise TransportError(f"ucx operation failed: {type(e).__name__}: {e}") from None
        return True

    def abort(self) -> None:
        """Requests are cancelled when the transport closes the endpoint (next step)."""


class UcxTransport(TwoSidedTransport):
    """UCX tag send/receive between any two processes; host and CUDA memory."""

    name = "ucx"
    capabilities = Capabilities(
        one_sided=False,
        same_process=False,
        same_node=True,
        cross_node=True,
        memory=frozenset({MemoryKind.HOST, MemoryKind.CUDA}),
        can_abort=True,
    )
    cost_model = CostModel.uniform(fixed_us=1500, bandwidth_gbps=4.0)  # measured on the 2-core build VM

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._worker: _Worker | None = None
        self._worker_lock = threading.Lock()

    @classmethod
    def library_status(cls) -> str:
        if importlib.util.find_spec("ucxx") is None:
            return "not installed (pip install 'tensorwire[ucx]')"
        return "importable"

    def diagnose(self) -> list[Diagnosis]:
        """Which UCX transports this process's worker has, and what is missing for fast
        cross-node paths."""
        try:
            active = self.worker().transports
        except TransportError as e:
            return [Diagnosis("UCX transports", Health.FAIL, str(e))]
        line = ", ".join(active)
        if not set(active) & {"rc", "rc_mlx5", "rc_verbs", "ud", "ud_mlx5", "ud_verbs", "dc", "dc_mlx5"}:
            return [
                Diagnosis(
                    "UCX transports",
                    Health.WARN,
                    f"{line}; no InfiniBand/RoCE: across nodes UCX uses TCP "
                    "(a system UCX built with verbs is used with RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true)",
                )
            ]
        return [Diagnosis("UCX transports", Health.OK, line)]

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("ucxx") is None:
            return "ucxx is not installed (pip install 'tensorwire[ucx]')"
        return None

    def worker(self) -> _Worker:
        """The process's UCX worker, started on first use."""
        with self._worker_lock:
            if self._worker is None:
                prefer_system_ucx(os.environ)
                try:
                    self._worker = _Worker()
                except Exception as e:  # noqa: BLE001 - any failure of the native library
                    raise TransportError(f"ucx: could not start a UCX worker: {type(e).__name__}: {e}") from None
                self.context.publish_transport_info(self.name, ",".join(self._worker.transports))
            return self._worker

    def open_connection(self, peer: PeerInfo, key: bytes, deadline: float, scope: str) -> Any:
        worker = self.worker()
        answer = self.context.connect(
            peer, self.name, key + worker.address, timeout_s=deadline - time.monotonic(), concurrently=lambda: None
        )
        return worker.endpoint(answer)

    def accept_connection(self, peer: PeerInfo, payload: bytes) -> tuple[Any, bytes]:
        worker = self.worker()
        try:
            endpoint = worker.endpoint(payload)
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"ucx: could not reach agent {peer.agent_id}: {type(e).__name__}: {e}") from None
        return endpoint, worker.address

    def post_sends(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        worker, endpoint = self.worker(), connection.state
        requests = [
            endpoint.tag_send(worker.buffer(b), worker.api.UCXXTag(t)) for t, b in zip(tags, buffers, strict=True)
        ]
        return _Requests(requests, buffers)

    def post_recvs(self, connection: Connection, tags: Sequence[int], buffers: Sequence[torch.Tensor]) -> PostedOps:
        worker, endpoint = self.worker(), connection.state
        requests = [
            endpoint.tag_recv(worker.buffer(b), worker.api.UCXXTag(t)) for t, b in zip(tags, buffers, strict=True)
        ]
        return _Requests(requests, buffers)

    def close_connection(self, connection: Connection) -> None:
        try:
            connection.state.close()
        except Exception:
            logger.debug("ucx endpoint close failed", exc_info=True)

    def peer_died_mid_transfer(self, connection: Connection) -> None:
        """Retire this process's UCX worker: the next transfer starts a fresh one.

        UCX's shared-memory transports (posix, sysv) pass messages through a queue in the
        receiver's memory that senders fill in place. A peer killed in the middle of filling
        a slot leaves it unfinished for ever, and every later message to this worker, from any
        peer, waits behind it (seen: a consumer whose producer was killed mid-transfer then
        received from no one). So every connection is dropped (transfers waiting on one
        reconnect; peers find the connection unknown and reconnect) and the old worker's
        progress thread is stopped before those transfers retry.
        """
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is None:
            return
        connections = self._take_connections()
        for other in connections:
            self.close_connection(other)
        stopped = worker.close(timeout_s=CLOSE_TIMEOUT_S)
        for other in connections:
            other.closed = True
        logger.warning(
            "ucx: agent %s died during a transfer; started over with a new UCX worker "
            "(%d other connection(s) dropped%s)",
            connection.peer.agent_id,
            len(connections),
            "" if stopped else "; the old progress thread did not stop and is left behind",
        )

    def prepare_send(self, buffers: Sequence[torch.Tensor]) -> None:
        _synchronize(buffers)  # UCX reads device memory outside any stream

    def prepare_recv(self, buffers: Sequence[torch.Tensor]) -> None:
        _synchronize(buffers)  # and writes it outside any stream

    def close(self) -> None:
        """Close endpoints (cancelling their requests), then stop the progress thread; bounded."""
        super().close()
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None and not worker.close(timeout_s=CLOSE_TIMEOUT_S):
            logger.warning("ucx: the progress thread did not stop within %.1f s; leaving it behind", CLOSE_TIMEOUT_S)
