"""Peer processes for the CLI's end-to-end checks (``doctor``, ``bench --calibrate``).

One peer runs on this node and one claims another node (``TENSORWIRE_NODE_ID``), so both
the same-node and the cross-node paths are exercised on one machine. Each peer runs a task
on every ``(ref, transport, device, *extra)`` it is sent and answers ``("ok", result)`` or
``("fail", "Error: message")``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "OTHER_NODE",
    "SAME_NODE",
    "Peer",
    "ask",
    "consumer_device",
    "digest_of_fetch",
    "median_fetch_seconds",
    "peers",
    "spawn",
]

SAME_NODE = "same node"
OTHER_NODE = "other node"


def consumer_device(caps: Any) -> tuple[str | None, str]:
    """Where a peer process receives what a transport with capabilities ``caps`` moves:
    ``(device, "")``, device None for the default; or ``(None, why)`` when this machine cannot
    run it. A transport that needs distinct GPUs (NCCL) receives on the second GPU."""
    if not caps.distinct_devices:
        return None, ""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return None, f"needs two GPUs (one per process); this machine has {gpus}"
    return "cuda:1", ""


def digest_of_fetch(ref: Any, transport: str, device: Any) -> str:
    """Fetch once; the SHA-256 of what arrived."""
    import tensorwire as tw

    value = tw.get(ref, transport=transport, device=device, timeout_s=30)
    return hashlib.sha256(value.cpu().numpy().tobytes()).hexdigest()


def median_fetch_seconds(ref: Any, transport: str, device: Any, repeats: int) -> float:
    """Fetch once to connect and map, then ``repeats`` times; the median seconds."""
    import tensorwire as tw

    tw.get(ref, transport=transport, device=device, timeout_s=60)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tw.get(ref, transport=transport, device=device, timeout_s=60)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _serve(conn: Any, env: dict[str, str], task: Callable[..., Any]) -> None:
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:  # imported with the main module: too late for OMP
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    while True:
        message = conn.recv()
        if message is None:
            return
        try:
            conn.send(("ok", task(*message)))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            conn.send(("fail", f"{type(e).__name__}: {e}"))


def ask(conn: Any, message: tuple[Any, ...], timeout_s: float) -> tuple[str, Any]:
    """Send ``message`` to a peer; its answer, ``("timeout", ...)`` if none came in time, or
    ``("died", ...)`` as soon as the peer process is gone (its end of the pipe closed)."""
    try:
        conn.send(message)
        if not conn.poll(timeout_s):
            return "timeout", f"no answer within {timeout_s:.0f} s"
        return conn.recv()
    except (EOFError, OSError) as e:
        return "died", f"the peer process exited before answering ({type(e).__name__})"


@contextlib.contextmanager
def spawn(task: Callable[..., Any], envs: dict[str, dict[str, str]]) -> Iterator[dict[str, Any]]:
    """One peer process per entry of ``envs`` (its extra environment), each running ``task``
    (a module-level function) on what it is sent: {name: connection}."""
    ctx = mp.get_context("spawn")
    started = {}
    try:
        for name, env in envs.items():
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(child, env, task), daemon=True)
            process.start()
            child.close()  # the peer holds the only other end: its exit reads as EOF here
            started[name] = (parent, process)
        yield {name: conn for name, (conn, _) in started.items()}
    finally:
        for conn, _process in started.values():
            with contextlib.suppress(OSError):
                conn.send(None)
        for _conn, process in started.values():
            process.join(10)
            if process.is_alive():
                process.kill()


@contextlib.contextmanager
def peers(task: Callable[..., Any], node_id: str, suffix: str) -> Iterator[dict[str, Any]]:
    """Two peer processes running ``task``, one on this node and one claiming another node."""
    with spawn(task, {SAME_NODE: {}, OTHER_NODE: {"TENSORWIRE_NODE_ID": f"{node_id}/{suffix}"}}) as connections:
        yield connections


def call_target(target: str, *args: Any) -> Any:
    """In a peer: call ``"module:function"`` with ``args``."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


class Peer:
    """One spawned process that runs ``"module:function"`` calls (the benchmarks' workers);
    ``env`` is added to its environment."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._stack = contextlib.ExitStack()
        self._conn = self._stack.enter_context(spawn(call_target, {"peer": dict(env or {})}))["peer"]

    def call(self, target: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """Run ``target(*args)`` there; its result. Raises ``RuntimeError`` if it failed or took longer."""
        status, result = ask(self._conn, (target, *args), timeout_s)
        if status != "ok":
            raise RuntimeError(f"peer: {target} failed: {result}")
        return result

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
