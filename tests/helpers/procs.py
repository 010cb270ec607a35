"""Worker processes for multi-process tests.

A :class:`Worker` runs functions from importable modules in a fresh process and returns their
results; an exception in the child is re-raised in the parent with the child's traceback.
Every call has a timeout.

Workers fork from a ``forkserver``: a fresh, single-threaded interpreter (started like a
``spawn`` child, so nothing of the test process, its threads or its gRPC state, is copied) that
imported torch, numpy and grpc once. A fresh interpreter spends seconds importing them on the
2-core VM, and the suite starts a worker or more in most of its multi-process tests. Each
worker still gets the parent's environment as it is when the worker starts. It ends as an
interpreter's exit begins:
non-daemon threads joined, then the ``atexit`` handlers (the agent closes); a forked child skips
the rest of finalization (C++ static destructors, the final garbage collection). Tests of how a
real interpreter exits, and the GPU tests, use ``start_method="spawn"``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import sys
import threading
import time
import traceback
from typing import Any, Literal

StartMethod = Literal["forkserver", "spawn"]


class ChildError(Exception):
    """An exception raised in a worker; ``exc_type`` names its class, the message holds the traceback."""

    def __init__(self, exc_type: str, text: str) -> None:
        super().__init__(f"{exc_type} in child:\n{text}")
        self.exc_type = exc_type


class WorkerDied(EOFError):
    """A worker's process ended while a call waited for it (the exit code is in the message)."""


PRELOADED = ["torch", "numpy", "grpc"]  # imported once by the forkserver (none starts a server at
# import; the one thread, numpy's OpenBLAS pool, OpenBLAS itself remakes after a fork)


def _serve(conn: Any, env: dict[str, str], forked: bool) -> None:
    os.environ.clear()  # the forkserver's environment is the parent's of long ago
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if forked and threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))  # OpenMP read the forkserver's at import
    try:
        _answer_calls(conn)
    finally:
        if forked:  # a forked child ends with os._exit: begin an interpreter's exit first
            threading._shutdown()  # type: ignore[attr-defined]  # (CPython's own step: joins non-daemon threads)
            atexit._run_exitfuncs()  # (private too; runs and clears them, as Py_Finalize would)


def _answer_calls(conn: Any) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        target, payload = message
        try:
            conn.send(("ok", _run(target, payload)))
        except BaseException as e:
            conn.send(("error", (type(e).__name__, traceback.format_exc())))
            del e  # nothing of a call (its references above all) outlives it in this loop


def _run(target: str, payload: bytes) -> bytes:
    """One call, pickled result; its arguments and result die when it returns."""
    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    args, kwargs = pickle.loads(payload)
    return pickle.dumps(fn(*args, **kwargs))


def start_method_for(node: Any) -> StartMethod:
    """The start method for the workers of pytest item ``node``: ``spawn`` for a ``gpu`` test
    (a fresh interpreter, as verified on the H200), else ``forkserver``."""
    return "spawn" if node.get_closest_marker("gpu") else "forkserver"


def _context(start_method: StartMethod) -> Any:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOADED)  # (read when the server starts: the first worker)
    return ctx


class Worker:
    """One process that runs ``module:function`` calls sent to it; ``env`` is added to this
    process's environment for it."""

    def __init__(self, env: dict[str, str] | None = None, *, start_method: StartMethod = "forkserver") -> None:
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {start_method!r}")
        ctx = _context(start_method)
        self._conn, child = ctx.Pipe()
        args = (child, {**os.environ, **(env or {})}, start_method == "forkserver")
        self.process = ctx.Process(target=_serve, args=args, daemon=True)
        self.process.start()
        child.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, target: str, *args: Any, **kwargs: Any) -> None:
        """Start a call without waiting for its result (collect it with :meth:`result`)."""
        self._conn.send((target, pickle.dumps((args, kwargs))))

    def result(self, timeout_s: float = 60.0) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.pid} gave no answer within {timeout_s} s")
        try:
            status, payload = self._conn.recv()
        except EOFError:
            self.process.join(10)
            raise WorkerDied(f"worker {self.pid} died, exit code {self.process.exitcode}") from None
        if status == "error":
            raise ChildError(*payload)
        return pickle.loads(payload)

    def ready(self) -> bool:
        """Whether a result (or the process's end) is waiting to be collected."""
        return self._conn.poll(0)

    def call(self, target: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        self.send(target, *args, **kwargs)
        return self.result(timeout_s)

    def exit(self, timeout_s: float = 20.0) -> tuple[float, int | None]:
        """Ask the worker to return, so that its interpreter exits (atexit handlers: the
        agent closes); the seconds until the process was gone and its exit code. A worker
        still alive after ``timeout_s`` is killed and reported (exit code None)."""
        start = time.monotonic()
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self.process.join(timeout_s)
        elapsed = time.monotonic() - start
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
            return elapsed, None
        self._conn.close()
        return elapsed, self.process.exitcode

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self._conn.closed:
            return
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
        self._conn.close()
