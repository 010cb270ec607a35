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
    usable = {"local", "inline", "shm", "host", "gloo", "ucx"}  # ucxx is in the test extra
    assert {k for k, v in report["transports"].items() if v == "usable"} == usable
    assert report["transports"]["cuda_ipc"] == "no CUDA device visible to this process"
    nvidia = report["accelerators"]["nvidia"]
    assert nvidia["resource"] == "GPU" and nvidia["visibility_env"] == ["CUDA_VISIBLE_DEVICES"]
    if not nvidia["devices"]:
        assert nvidia["reason"]  # no GPU here: the reason is recorded, nothing raised
    assert report["transport_libraries"]["gloo"] == "available"


def test_topo_text_names_vendors_and_visibility():
    out = run_cli("topo", env={"HABANA_VISIBLE_MODULES": "2,3", "CUDA_VISIBLE_DEVICES": ""})
    assert "intel_gaudi (Ray resource HPU, HABANA_VISIBLE_MODULES=2,3; fractional resources: no" in out
    assert "CUDA_VISIBLE_DEVICES=none" in out
    assert "transports: local (usable)" in out


def test_topo_shows_vendor_facts():
    env = {
        "ONEAPI_DEVICE_SELECTOR": "level_zero:0,1",
        "FURIOSA_DEVICES": "npu:0,npu:1:0-3",
        "QBRUNTIME_VISIBLE_DEVICES": "0",
    }
    (report,) = json.loads(run_cli("topo", "--json", env=env))
    accelerators = report["accelerators"]
    intel = accelerators["intel_gpu"]
    assert intel["visible_from"] == "ONEAPI_DEVICE_SELECTOR" and intel["visible"] == ["0", "1"]
    assert intel["fractional"] is True and intel["resource"] == "GPU"
    furiosa = accelerators["furiosa"]
    assert furiosa["fractional"] is False and "npu:X:Y" in furiosa["id_form"]
    assert furiosa["partitions"] == [{"device": 0, "pes": []}, {"device": 1, "pes": [0, 1, 2, 3]}]
    assert accelerators["mobilint"]["resource"] == "MBLT" and accelerators["mobilint"]["fractional"] is False
    assert accelerators["nvidia"]["fractional"] is True
    out = run_cli("topo", env=env)
    assert "intel_gpu (Ray resource GPU, ONEAPI_DEVICE_SELECTOR=0,1; fractional resources: yes)" in out
    furiosa = "furiosa (Ray resource FURIOSA, FURIOSA_DEVICES=0,1:0-3; fractional resources: no, whole devices only)"
    assert furiosa in out
    assert "npu 0: whole device" in out and "npu 1: PEs 0,1,2,3" in out
    assert "mobilint (Ray resource MBLT, QBRUNTIME_VISIBLE_DEVICES=0; fractional resources: no" in out


def test_topo_reports_a_selector_it_cannot_read():
    (report,) = json.loads(run_cli("topo", "--json", env={"ONEAPI_DEVICE_SELECTOR": "!level_zero:1"}))
    assert "does not interpret discard filters" in report["accelerators"]["intel_gpu"]["error"]


def test_version_comes_from_package_metadata():
    from importlib import metadata

    assert run_cli("--version") == f"tensorwire {metadata.version('tensorwire')}\n"


def run_doctor(env: dict[str, str] | None = None) -> tuple[int, list[dict[str, str]]]:
    done = subprocess.run(
        [sys.executable, "-m", "tensorwire", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        check=False,
    )
    return done.returncode, json.loads(done.stdout)


def test_doctor_checks_every_transport_with_a_real_transfer():
    code, results = run_doctor()
    assert code == 0, results
    ok = {r["check"] for r in results if r["status"] == "ok"}
    assert {
        "transport local",
        "transport inline",
        "transport shm",
        "transport host",
        "transport gloo",
        "transport ucx",
    } <= ok
    details = {(r["check"], r["detail"]) for r in results}
    for name in ("host", "gloo", "ucx"):  # the cross-node paths were exercised
        assert (f"transport {name}", "other node, 1024 KiB") in details
    gpu_only = {r["check"]: r for r in results if r["check"] in ("transport cuda_ipc", "transport nccl")}
    assert {r["status"] for r in gpu_only.values()} == {"warn"}  # no GPU here: a warning with the reason
    assert gpu_only["transport nccl"]["detail"] == "no CUDA device visible to this process"
    ucx = next(r for r in results if r["check"] == "UCX transports")  # which UCX transports are active
    assert ucx["status"] == "warn" and "tcp" in ucx["detail"] and "no InfiniBand" in ucx["detail"]
    nvml = next(r for r in results if r["check"] == "NVML")
    assert nvml["status"] in ("ok", "warn") and nvml["detail"]


def test_doctor_reports_a_broken_transport_and_fails():
    code, results = run_doctor({"TENSORWIRE_INLINE_NBYTES": "100"})  # inline cannot carry 1 KiB now
    assert code == 1
    failed = [r for r in results if r["status"] == "fail"]
    assert failed and all(r["check"] == "transport inline" for r in failed)
    assert "TENSORWIRE_INLINE_NBYTES" in failed[0]["detail"]
