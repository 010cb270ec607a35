"""A transport that moves the bytes but writes none of them into the consumer's buffers
(``tests/helpers/broken_transport.py``) makes every check that claims to look at what arrived
fail: ``tensorwire bench --check``, the benchmark scripts, and the failure tests."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers.broken_transport import environment

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(args: list[str], broken: str = "", *, after: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TENSORWIRE_HOST": "127.0.0.1"}
    for key in ("TENSORWIRE_NODE_ID", "TENSORWIRE_CLUSTER_TOKEN", "RAY_ADDRESS"):
        env.pop(key, None)
    if broken:
        env.update(environment(broken, after=after))
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )


def test_the_broken_transport_is_installed_in_every_process_it_reaches():
    code = "from tensorwire.transport import registry; print(registry.get_transport_class('shm').__name__)"
    assert run(["-c", code], "shm").stdout.strip() == "WritesNothingShmTransport"
    assert run(["-c", code]).stdout.strip() == "ShmTransport"


def test_bench_check_counts_every_round_it_wrote_nothing(tmp_path):
    """Each process's first fetch is intact (it makes the buffers; the actors' is the warm-up);
    every timed round after it must be counted wrong, in the process and the Ray scenarios."""
    out = tmp_path / "bench.json"
    args = [
        "-m",
        "tensorwire",
        "bench",
        "--scenarios",
        "p2p-processes,p2p-actors",
        "-b",
        "64K",
        "-e",
        "64K",
        "-n",
        "3",
        "-w",
        "1",
        "--check",
        "--transports",
        "shm",
        "--json",
        str(out),
    ]
    done = run(args, "shm", after=1)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "transfer(s) delivered wrong data" in done.stdout
    wrong = {(r["scenario"], r["method"]): r["wrong"] for r in json.loads(out.read_text())["rows"]}
    assert wrong[("p2p-processes", "tensorwire shm (same node)")] == 3
    assert wrong[("p2p-processes", "tensorwire auto (same node)")] == 3  # the automatic choice is shm
    assert wrong[("p2p-actors", "tensorwire (@tw.method ref)")] == 3
    intact = [k for k in wrong if "tensorwire" not in k[1] or "other node" in k[1]]  # baselines; ucx
    assert intact and all(wrong[k] == 0 for k in intact), wrong


def test_regression_benchmarks_fail_on_it():
    done = run(["-m", "pytest", "benchmarks/test_regression.py", "-q", "-p", "no:cacheprovider"], "shm")
    assert done.returncode == 1, done.stdout
    assert "2 failed" in done.stdout and "delivered wrong data" in done.stdout
    assert "FAILED benchmarks/test_regression.py::test_fetch[shm-65536]" in done.stdout


def test_foundation_benchmark_fails_on_it_and_passes_without():
    args = ["-m", "benchmarks.foundation", "--mib", "4", "--repeats", "2", "--small-repeats", "3"]
    good = run(args)
    assert good.returncode == 0 and "#wrong 0" in good.stdout and "cores" in good.stdout, good.stdout + good.stderr
    bad = run(args, "shm,inline")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert (
        "FAILED: wrong data delivered" in bad.stdout and "'shm_out': 2" in bad.stdout and "'small get': 3" in bad.stdout
    )


@pytest.mark.slow
def test_two_sided_benchmark_fails_on_it_and_passes_without():
    good = run(["-m", "benchmarks.two_sided", "--quick"])
    assert good.returncode == 0 and "FAILED" not in good.stdout, good.stdout + good.stderr
    bad = run(["-m", "benchmarks.two_sided", "--quick"], "ucx,gloo,host,shm")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    failed = bad.stdout.split("FAILED: wrong data delivered by ")[1]
    for method in (
        "tensorwire ucx (tcp)",
        "tensorwire ucx (sm)",
        "tensorwire gloo",
        "tensorwire host",
        "tensorwire shm",
    ):
        assert method in failed
    assert "bare" not in failed  # the bare baselines do not use tensorwire's transports


@pytest.mark.slow
def test_ray_compare_benchmark_fails_on_it_and_passes_without():
    good = run(["-m", "benchmarks.ray_compare", "--quick"])
    assert good.returncode == 0 and "WRONG" not in good.stdout, good.stdout + good.stderr
    bad = run(["-m", "benchmarks.ray_compare", "--quick"], "shm")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "tensor 1 MiB WRONG DATA (rounds per method): {'tensorwire': 3, 'ray rdt gloo': 0, 'object store': 0}" in (
        bad.stdout
    )


def test_failure_tests_fail_on_it():
    """The in-flight fault tests need bytes to arrive: with host writing nothing after each
    process's first (warm-up) fetch they cannot pass by accepting an error the fault did not
    cause."""
    tests = [
        "tests/transport/test_failures.py::test_owner_killed_during_transfer",
        "tests/transport/test_failures.py::test_ref_freed_mid_transfer_is_complete_or_freed_never_partial",
    ]
    done = run(["-m", "pytest", *tests, "-q", "-p", "no:cacheprovider"], "host", after=1)
    assert done.returncode == 1, done.stdout
    assert "2 failed" in done.stdout and done.stdout.count("was never seen in flight") >= 2, done.stdout
