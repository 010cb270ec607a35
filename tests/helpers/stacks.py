"""Every thread's stack in the tests' Ray actor processes, written out shortly before a test
times out: pytest-timeout shows the driver's stacks only, and a hang is often in an actor.

The driver's conftest names a directory (``TENSORWIRE_TEST_STACKS_DIR``, inherited by the Ray
processes it starts); each Ray worker started with :data:`STACKS_ON_SIGNAL` as its runtime
environment registers a SIGUSR1 handler writing its stacks to ``<dir>/<pid>.txt``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

STACKS_ENV = "TENSORWIRE_TEST_STACKS_DIR"


def _setup_hook():
    """A worker setup hook registering the SIGUSR1 handler: a closure, which Ray's cloudpickle
    sends by value (a Ray worker may not be able to import this package)."""
    kept: list = []  # the open file the handler writes to

    def dump_on_signal() -> None:
        folder = os.environ.get(STACKS_ENV)
        if not folder or kept:
            return
        os.makedirs(folder, mode=0o700, exist_ok=True)
        kept.append(open(os.path.join(folder, f"{os.getpid()}.txt"), "w"))  # noqa: SIM115 - kept for the handler
        faulthandler.register(signal.SIGUSR1, file=kept[0], all_threads=True)

    return dump_on_signal


STACKS_ON_SIGNAL = {"worker_process_setup_hook": _setup_hook()}  # a Ray runtime_env


def _is_ray_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False


def dump_ray_workers(test: str) -> None:
    """Driver: signal every registered actor process still running, then print what each wrote."""
    folder = os.environ.get(STACKS_ENV, "")
    pids = [int(n[:-4]) for n in os.listdir(folder) if n.endswith(".txt")] if os.path.isdir(folder) else []
    pids = [pid for pid in pids if pid != os.getpid() and _is_ray_worker(pid)]
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(2)
    out = sys.__stderr__
    print(f"\n==== {test} is about to time out: stacks of {len(pids)} Ray actor processes ====", file=out)
    for pid in pids:
        with open(os.path.join(folder, f"{pid}.txt")) as f:
            print(f"---- pid {pid} ({_command(pid)})\n{f.read()[-20000:]}", file=out)
    out.flush()


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "exited"
