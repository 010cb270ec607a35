"""Start, transfer, exit: processes never hang on the way out, over every transport that runs here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.procs import Worker
from tests.helpers.tasks import digest

EXIT_WITHIN_S = 20.0
SAME_NODE = ("shm", "host", "gloo", "ucx")
CROSS_NODE = ("host", "gloo", "ucx")


def _usable(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names``, and nixl where it is installed (it is in the test extra)."""
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed (pip install 'tensorwire[ucx]'); the ucx cycles need it")
    nixl = any(importlib.util.find_spec(package) for package in ("nixl", "nixl_cu12", "nixl_cu13"))
    return (*names, "nixl") if nixl else names


@pytest.mark.parametrize("cycles", [pytest.param(30, marks=pytest.mark.slow), 2])
def test_start_transfer_exit_cycles_each_exit_promptly(cycles):
    """30 cycles (``-m slow``; about 4 minutes here, nixl included) or 2, one of each kind (the default
    suite). Even cycles: two processes of one node, every same-node transport; odd cycles: two
    claimed nodes, every cross-node transport. Each process must exit by itself (exit code 0)
    within the bound after its transfers, whatever native library it used."""
    import torch

    value = torch.arange(300_000, dtype=torch.int32)  # 1.2 MB: beyond inline, several messages
    expected = digest(value)
    exits: list[float] = []
    for cycle in range(cycles):
        cross = cycle % 2 == 1
        transports = _usable(CROSS_NODE if cross else SAME_NODE)
        env = {"TENSORWIRE_NODE_ID": f"exit-b-{cycle}"} if cross else {}
        producer = Worker({"TENSORWIRE_NODE_ID": f"exit-a-{cycle}"} if cross else {}, start_method="spawn")
        consumer = Worker(env, start_method="spawn")  # a real interpreter exit, not a forked child's
        try:
            ref = producer.call("tests.helpers.tasks:put_value", value)
            for transport in transports:
                got, used = consumer.call("tests.helpers.tasks:get_transport", ref, transport=transport)
                assert (got, used) == (expected, transport), f"cycle {cycle}: {transport}"
            del ref
            for name, worker in (("consumer", consumer), ("producer", producer)):
                elapsed, code = worker.exit(EXIT_WITHIN_S)
                assert code == 0, f"cycle {cycle}: the {name} did not exit by itself within {EXIT_WITHIN_S} s"
                exits.append(elapsed)
        finally:
            producer.close()
            consumer.close()
    assert len(exits) == 2 * cycles


def test_a_test_stuck_where_signals_cannot_reach_is_reported_by_name(tmp_path):
    """The suite's per-test timeout (pytest-timeout, thread method) ends a test that no signal
    can interrupt and names it, instead of letting the run hang."""
    test_file = tmp_path / "test_stuck.py"
    test_file.write_text(
        textwrap.dedent(
            """
            import signal, time

            def test_stuck_in_native_wait():
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the signal method cannot fire
                time.sleep(600)
            """
        )
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    start = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(test_file),
            "-c",
            os.path.join(root, "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-o",
            "timeout=3",
            "-p",
            "no:cacheprovider",
            "-q",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Timeout" in output and "test_stuck_in_native_wait" in output, output[-2000:]
    assert elapsed < 100, f"the stuck test was only ended after {elapsed:.0f} s"


_SHUTDOWN_WHILE_PENDING = """
import gc, os, time
import ray, torch
import tensorwire as tw

@tw.remote(num_cpus=0)
class Slow:
    def pid(self):
        return os.getpid()

    @tw.method
    def slow(self, seconds, nbytes):
        time.sleep(seconds)
        return torch.ones(nbytes, dtype=torch.uint8)

tw.init(address="local", num_cpus=2, include_dashboard=False)
actor = Slow.remote()
ray.get(actor.pid.remote())
ref = actor.slow.remote(60, 1 << 20)  # beyond inline: its result pins an object
del ref
gc.collect()  # the dropped call is now settled in the background
time.sleep(2)
ray.shutdown()
print("shut down", flush=True)
time.sleep(3)  # a thread left waiting inside Ray would end the process about now
print("still running", flush=True)
"""


def test_ray_shutdown_while_a_dropped_call_is_pending_leaves_the_process_running(tmp_path):
    """A ``@tw.method`` result dropped while its call runs, then Ray shut down: the process goes
    on (Ray ends a process whose thread is inside Ray at shutdown, "the core worker has already
    been shutdown ... the process will exit"; tensorwire's own settlement thread once was)."""
    script = tmp_path / "shutdown_while_pending.py"
    script.write_text(_SHUTDOWN_WHILE_PENDING)
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "shut down\nstill running\n" in done.stdout, output[-3000:]
