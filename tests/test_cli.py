"""``tensorwire topo`` and ``tensorwire doctor``: what they report follows this machine's
hardware (the suite's one probe, ``tests.conftest.hardware``), and ``topo --address`` reports
every node of a running Ray cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import hardware

BASE_USABLE = {"local", "inline", "shm", "host", "gloo", "ucx", "nixl"}  # ucxx and nixl-cu12 are in the test extra


def _gpu_usable() -> set[str]:
    """The GPU transports usable with this machine's GPUs (none without a GPU)."""
    return {"cuda_ipc", "nccl"} if hardware()["gpus"] else set()


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
    assert {k for k, v in report["transports"].items() if v == "usable"} == BASE_USABLE | _gpu_usable()
    if not hardware()["gpus"]:
        assert report["transports"]["cuda_ipc"] == "no CUDA device visible to this process"
    nvidia = report["accelerators"]["nvidia"]
    assert nvidia["resource"] == "GPU" and nvidia["visibility_env"] == ["CUDA_VISIBLE_DEVICES"]
    if hardware()["gpus"]:
        assert len(nvidia["devices"]) >= hardware()["gpus"]
    else:
        assert nvidia["reason"]  # no GPU here: the reason is recorded, nothing raised
    assert bool(report["rdma_nics"]) == hardware()["rdma"]
    assert report["transport_libraries"]["gloo"] == "available"
    nixl = report["transport_libraries"]["nixl"]  # the wheel and what it bundles, or how to install it
    assert nixl.startswith("not installed (pip install") or ("plugins" in nixl and "UCX modules" in nixl), nixl


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


def _doctor_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        check=False,
    )


def run_doctor(env: dict[str, str] | None = None) -> tuple[int, list[dict[str, str]]]:
    done = _doctor_process(env=env)
    return done.returncode, json.loads(done.stdout)


@pytest.fixture(scope="module")
def doctor_json() -> subprocess.CompletedProcess:
    """One ``doctor --json --progress`` run, shared by the tests that read it."""
    return _doctor_process("--progress")


def test_doctor_checks_every_transport_with_a_real_transfer(doctor_json):
    from tensorwire.transport import registry

    done = doctor_json
    code, results = done.returncode, json.loads(done.stdout)  # the progress bar kept out of the JSON
    assert code == 0, results
    count = len(registry.registered_transports())
    drawn = [int(n) for n in re.findall(rf"doctor: +\d+%\|[^|]*\| (\d+)/{count} \[", done.stderr)]
    assert drawn[0] == 0 and drawn[-1] == count and drawn == sorted(drawn), done.stderr[-600:]
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
    gpus = hardware()["gpus"]
    if not gpus:  # a warning with the reason, not a failure
        assert {r["status"] for r in gpu_only.values()} == {"warn"}
        assert gpu_only["transport nccl"]["detail"] == "no CUDA device visible to this process"
    else:
        assert "transport cuda_ipc" in ok
        if gpus == 1:
            assert gpu_only["transport nccl"]["detail"] == "needs two GPUs (one per process); this machine has 1"
    ucx = next(r for r in results if r["check"] == "UCX transports")  # which UCX transports are active
    assert ucx["status"] in ("ok", "warn") and ucx["detail"]
    if not hardware()["rdma"]:
        assert ucx["status"] == "warn" and "tcp" in ucx["detail"] and "no InfiniBand" in ucx["detail"]
    nvml = next(r for r in results if r["check"] == "NVML")
    assert nvml["status"] in ("ok", "warn") and nvml["detail"]
    if "nixl" in registry.registered_transports():  # installed (the test extra has nixl-cu12)
        assert "transport nixl" in ok and ("transport nixl", "other node, 1024 KiB") in details
        nixl = next(r for r in results if r["check"] == "NIXL")  # its wheel, plug-ins, UCX modules, RDMA
        assert "plugins" in nixl["detail"] and "UCX" in nixl["detail"] and "backends UCX;" in nixl["detail"]
        if not hardware()["rdma"]:
            assert nixl["status"] == "warn" and "no RDMA device" in nixl["detail"]
    from tensorwire.transport.backends.shm import cma

    direct = next(r for r in results if r["check"] == "shm direct reads")  # detected once, reported
    why_not = cma._probe()  # as a new process finds it (this one may have turned direct reads off)
    assert (direct["status"], direct["detail"]) == (
        ("ok", "process_vm_readv allowed: one copy per shm fetch") if why_not is None else ("warn", why_not)
    )


def test_doctor_reports_a_broken_transport_and_fails():
    code, results = run_doctor({"TENSORWIRE_INLINE_NBYTES": "100"})  # inline cannot carry 1 KiB now
    assert code == 1
    failed = [r for r in results if r["status"] == "fail"]
    assert failed and all(r["check"] == "transport inline" for r in failed)
    assert "TENSORWIRE_INLINE_NBYTES" in failed[0]["detail"]


def test_doctor_text_output_is_one_line_per_check(doctor_json):
    done = subprocess.run(
        [sys.executable, "-m", "tensorwire", "doctor"],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(doctor_json.stdout)  # the same checks as JSON: one aligned line each, in the same order
    assert done.stdout.splitlines() == [f"{r['status'].upper():5} {r['check']:20} {r['detail']}" for r in results]
    assert f"OK    {'transport shm':20} same node, 1024 KiB" in done.stdout.splitlines()


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    import tensorwire as tw
    from tests.helpers.ray_sessions import ray_session

    with ray_session():
        tw.init(address="local", num_cpus=1, include_dashboard=False)
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


def test_topo_address_reports_every_node_of_a_ray_cluster(ray_cluster):
    import ray

    reports = json.loads(run_cli("topo", "--json", "--address", ray_cluster))
    assert {r["node_id"] for r in reports} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert all(r["transports"]["host"] == "usable" and r["transports"]["shm"] == "usable" for r in reports)
    text = run_cli("topo", "--address", ray_cluster)
    assert text.count("\nnode ") + text.startswith("node ") == len(reports)
    assert f"node {reports[0]['node_id']}" in text and "transports: local (usable)" in text


def test_doctor_names_the_rdma_devices_nixls_verbs_library_lists(monkeypatch):
    from tensorwire.transport.backends.nixl import doctor
    from tensorwire.transport.contract import Diagnosis, Health

    monkeypatch.setattr(doctor, "new_agent", lambda name: type("Agent", (), {"backends": ["UCX", "LIBFABRIC"]})())
    monkeypatch.setattr(doctor, "library", lambda: "nixl-cu12 1.5.1")
    monkeypatch.setattr(doctor, "verbs_devices", lambda: ["mlx5_0", "mlx5_1"])
    assert doctor.diagnose() == [
        Diagnosis(
            "NIXL",
            Health.OK,
            "nixl-cu12 1.5.1; backends UCX, LIBFABRIC; its verbs library sees RDMA devices mlx5_0, mlx5_1",
        )
    ]
    monkeypatch.setattr(doctor, "verbs_devices", lambda: "nixl_cu12 bundles no libibverbs")
    (line,) = doctor.diagnose()
    assert line.health is Health.WARN and "no RDMA device (nixl_cu12 bundles no libibverbs)" in line.detail
