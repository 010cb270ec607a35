"""``tensorwire topo`` on this machine (no GPU, no NVML, no RDMA NIC)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_cli(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tensorwire", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_topo_json_describes_this_node():
    (report,) = json.loads(run_cli("topo", "--json", env={"TENSORWIRE_NODE_ID": "cli-node"}))
    assert report["node_id"] == "cli-node" and report["machine_id"] != "cli-node"
    assert report["cpus"] == os.cpu_count()
    assert report["shared_memory"]["total_nbytes"] > 0
    assert report["transports"] == {"local": "usable", "inline": "usable", "shm": "usable", "host": "usable"}
    nvidia = report["accelerators"]["nvidia"]
    assert nvidia["resource"] == "GPU" and nvidia["visibility_env"] == ["CUDA_VISIBLE_DEVICES"]
    if not nvidia["devices"]:
        assert nvidia["reason"]  # no GPU here: the reason is recorded, nothing raised
    assert report["transport_libraries"]["gloo"] == "available"


def test_topo_text_names_vendors_and_visibility():
    out = run_cli("topo", env={"HABANA_VISIBLE_MODULES": "2,3", "CUDA_VISIBLE_DEVICES": ""})
    assert "intel_gaudi (Ray resource HPU, HABANA_VISIBLE_MODULES=2,3)" in out
    assert "CUDA_VISIBLE_DEVICES=none" in out
    assert "transports: local (usable)" in out
