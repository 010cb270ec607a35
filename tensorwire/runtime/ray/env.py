"""How a process inside a Ray cluster configures its agent (Ray's public API only).

Before the agent of a Ray driver or worker starts, three settings come from Ray unless the
user set them:

* ``TENSORWIRE_NODE_ID``: Ray's node id, so "same node" means the same Ray node.
* ``TENSORWIRE_HOST``: the Ray node's IP address, where the TCP control service binds.
* ``TENSORWIRE_CLUSTER_TOKEN``: one random secret per Ray cluster, kept by a small named
  actor (``tensorwire_cluster_token`` in namespace ``tensorwire``, zero CPUs) that the first
  process to need it creates.

Outside Ray (Ray not imported or not initialized) nothing happens.
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import sys
import threading
from typing import Any

from tensorwire.transport.agent import add_startup_hook
from tensorwire.transport.agent.metrics import TransferRecord, add_observer

__all__ = [
    "TOKEN_ACTOR_NAME",
    "TOKEN_NAMESPACE",
    "RayMetrics",
    "configure_process",
    "configured",
    "in_ray",
    "mark_async_actor",
    "ray_result",
]

TOKEN_ACTOR_NAME = "tensorwire_cluster_token"
TOKEN_NAMESPACE = "tensorwire"

_lock = threading.Lock()
_configured_pid = 0


def in_ray() -> bool:
    """Whether this process is a Ray driver or worker with Ray initialized (no import of Ray)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class _TokenKeeper:
    """Holds the cluster token (one per Ray cluster)."""

    def __init__(self) -> None:
        self._token = secrets.token_hex(32)

    def token(self) -> str:
        return self._token


_async_actor = False


def mark_async_actor() -> None:
    """This process runs an async actor (one with ``async def`` methods): no ``ray.get`` here."""
    global _async_actor
    _async_actor = True


def ray_result(object_ref: Any, timeout_s: float | None) -> Any:
    """``object_ref``'s value. ``ray.get``, except in an async actor, where tensorwire waits on
    ``ObjectRef.future()`` instead (a ``ray.get`` there blocks the event loop's process and Ray
    warns about it). Not the future everywhere: an actor's future completes on the thread that
    runs its calls, which may be the one waiting (while Ray unpickles a call's arguments).

    Raises:
        TimeoutError: Not ready within ``timeout_s``. Ray's errors of the call.
    """
    import ray

    if not _async_actor:
        try:
            return ray.get(object_ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"not ready within {timeout_s} s") from None
    future = object_ref.future()
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"not ready within {timeout_s} s") from None


def _cluster_token(*, timeout_s: float = 180.0) -> str:
    """The cluster's shared secret, from its detached keeper actor (started by the first
    process that asks). Bounded: Ray starts the actor's worker at nice 15, which took over a
    minute on the 2-core build VM with every core busy."""
    import ray

    keeper_class = ray.remote(num_cpus=0, max_restarts=-1)(_TokenKeeper)
    keeper = keeper_class.options(
        name=TOKEN_ACTOR_NAME, namespace=TOKEN_NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote()
    try:
        return ray_result(keeper.token.remote(), timeout_s)
    except TimeoutError as e:
        raise TimeoutError(
            f"tensorwire's token actor ({TOKEN_NAMESPACE}/{TOKEN_ACTOR_NAME}) did not answer within {timeout_s} s: "
            "Ray could not start its worker in time (is the machine overloaded? Ray runs workers at nice 15 unless "
            "RAY_worker_niceness says otherwise)"
        ) from e


class RayMetrics:
    """Transfer metrics through ``ray.util.metrics`` (shown on the Ray dashboard)."""

    _instance: RayMetrics | None = None

    def __init__(self) -> None:
        from ray.util import metrics

        tags = ("transport",)
        self._transfers = metrics.Counter("tensorwire_transfers", "Completed tensorwire fetches", tag_keys=tags)
        self._nbytes = metrics.Counter("tensorwire_transfer_bytes", "Bytes moved by tensorwire fetches", tag_keys=tags)
        self._seconds = metrics.Histogram(
            "tensorwire_transfer_seconds",
            "Duration of tensorwire fetches",
            boundaries=[1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0],
            tag_keys=tags,
        )
        self.recorded = 0

    @classmethod
    def instance(cls) -> RayMetrics:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __call__(self, record: TransferRecord) -> None:
        tags = {"transport": record.transport}
        self._transfers.inc(1, tags=tags)
        self._nbytes.inc(record.nbytes, tags=tags)
        self._seconds.observe(record.duration_s, tags=tags)
        self.recorded += 1


def configured() -> bool:
    """Whether :func:`configure_process` has run in this process."""
    return _configured_pid == os.getpid()


def configure_process() -> None:
    """Set the agent's Ray-derived settings in this process's environment (once per process)."""
    global _configured_pid
    if _configured_pid == os.getpid() or not in_ray():
        return
    with _lock:
        if _configured_pid == os.getpid():
            return
        import ray

        context = ray.get_runtime_context()
        os.environ.setdefault("TENSORWIRE_NODE_ID", context.get_node_id())
        os.environ.setdefault("TENSORWIRE_HOST", ray.util.get_node_ip_address())
        if not os.environ.get("TENSORWIRE_CLUSTER_TOKEN"):
            os.environ["TENSORWIRE_CLUSTER_TOKEN"] = _cluster_token()
        add_observer(RayMetrics.instance())
        _configured_pid = os.getpid()


add_startup_hook(configure_process)
