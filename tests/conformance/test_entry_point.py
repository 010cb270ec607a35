"""A transport installed only as an entry point of a temporary distribution passes the whole
conformance suite: in the test process, in spawned consumer processes and inside Ray actors,
with no ``register_transport`` call anywhere (``tests/helpers/entry_point_transport.py``).

The suite runs in a child pytest whose ``PYTHONPATH`` holds the distribution, so every process
of that run (pytest, its spawned workers, the Ray workers) finds the entry point by itself.
The same run proves that a run-time registration (``testfile``, registered by the suite's
module in the driver only) reaches the Ray actors started after it.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from tests.helpers import entry_point_transport

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUITE = "tests/conformance/test_transports.py"
CASES = [
    "test_dtypes",
    "test_nested_structure",
    "test_out_buffers",
    "test_out_buffers_again",
    "test_placements",
    "test_same_process",
    "test_sidedness",
    "test_zero_copy_view",
    "test_zero_dim_empty_and_noncontiguous",
]
# testep everywhere; testfile (registered at run time in the driver only) once in a Ray actor
SELECTED = f"{entry_point_transport.NAME} or (ray and testfile and dtypes)"
EXPECTED = sorted([*CASES, *["test_sizes"] * 5])  # every case of the suite that has consumers


def test_entry_point_transport_passes_the_suite_in_processes_and_ray_actors(tmp_path):
    site = entry_point_transport.install(tmp_path / "site")
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "TENSORWIRE_HOST": "127.0.0.1",
        "TENSORWIRE_CONFORMANCE_RAY": "1",
    }
    for key in ("TENSORWIRE_NODE_ID", "TENSORWIRE_CLUSTER_TOKEN", "RAY_ADDRESS", "TENSORWIRE_TRANSPORTS"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    args = [sys.executable, "-m", "pytest", SUITE, "-q", "-rA", "-p", "no:cacheprovider", "-k", SELECTED]
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    passed = re.findall(r"^PASSED \S+::(\w+)\[([\w-]+)\]", done.stdout, re.MULTILINE)
    for kind in ("process", "ray"):
        cases = sorted(case for case, ident in passed if ident.startswith(f"{kind}-{entry_point_transport.NAME}"))
        assert cases == EXPECTED, (kind, cases)
    assert ("test_dtypes", "ray-testfile") in passed, passed
