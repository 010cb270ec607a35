"""Selection by cost: calibrated tables, GPU link facts, and `tensorwire bench --calibrate`."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tensorwire.transport import selector
from tensorwire.transport.agent.wire import decode_peer, encode_peer
from tensorwire.transport.backends.cuda_ipc import CudaIpcTransport
from tensorwire.transport.backends.host import HostTransport
from tensorwire.transport.backends.nccl import NcclTransport
from tensorwire.transport.backends.shm.transport import ShmTransport
from tensorwire.transport.contract import DeviceInfo, MemoryKind, PeerInfo
from tensorwire.transport.hw import calibration, topology
from tensorwire.transport.selector import CostEstimate, ObjectSummary
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest

CLASSES = (ShmTransport, HostTransport, CudaIpcTransport, NcclTransport)
CAPS = {t.name: t.capabilities for t in CLASSES}
select = functools.partial(selector.select, cost_models={t.name: t.cost_model for t in CLASSES})
ALL = frozenset(CAPS)
HOST = frozenset({MemoryKind.HOST})
CUDA = frozenset({MemoryKind.CUDA})


def node_peer(agent: str, links: tuple[tuple[str, str, str], ...] = ()) -> PeerInfo:
    gpus = tuple(DeviceInfo("cuda", i, uuid=f"GPU-n1-{i}") for i in range(8))
    return PeerInfo(
        agent_id=agent,
        node_id="n1",
        machine_id="m1",
        hostname="h",
        pid=1,
        start_time=1,
        transports=tuple(CAPS),
        devices=(DeviceInfo("cpu", 0), *gpus),
        gpu_links=links,
    )


def gpu_value(src: int, dst: int) -> ObjectSummary:
    return ObjectSummary(
        nbytes=64 << 20,
        memory=CUDA,
        exported=frozenset(),
        src_devices=frozenset({f"GPU-n1-{src}"}),
        dst_devices=frozenset({f"GPU-n1-{dst}"}),
    )


def test_table_round_trip_and_rejections(tmp_path):
    path = str(tmp_path / "costs.json")
    costs = {"shm": CostEstimate(40.0, 9.5), "host": CostEstimate(900.0, 1.2)}
    assert calibration.save_costs(costs, path) == path
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert calibration.load_costs(path) == costs
    with open(path) as f:
        document = json.load(f)
    document["machine_id"] = "another-machine"
    with open(path, "w") as f:
        json.dump(document, f)
    assert calibration.load_costs(path) == {}  # measured elsewhere: ignored
    with open(path, "w") as f:
        f.write("{not json")
    assert calibration.load_costs(path) == {}
    assert calibration.load_costs(str(tmp_path / "missing.json")) == {}


def test_calibrated_costs_change_the_ranking():
    a, b = node_peer("a"), node_peer("b")
    value = ObjectSummary(64 << 20, HOST, frozenset({"shm"}))
    assert select(a, b, value, CAPS, usable_here=ALL).best == "shm"
    slow_shm = {"shm": CostEstimate(5000, 0.1), "host": CostEstimate(10, 50)}
    sel = select(a, b, value, CAPS, usable_here=ALL, costs=slow_shm)
    assert sel.best == "host" and "next: shm" in sel.reason


def test_nvlink_pcie_and_no_p2p_decide_gpu_transports():
    links = (("GPU-n1-0", "GPU-n1-1", "nvlink"), ("GPU-n1-0", "GPU-n1-2", "pcie"), ("GPU-n1-0", "GPU-n1-3", "none"))
    a, b = node_peer("a", links), node_peer("b", links)
    nvlink = select(a, b, gpu_value(0, 1), CAPS, usable_here=ALL)
    pcie = select(a, b, gpu_value(0, 2), CAPS, usable_here=ALL)
    assert nvlink.best == pcie.best == "cuda_ipc"
    assert "GPU-n1-0 -> GPU-n1-1 NVLink P2P" in nvlink.reason and "PCIe P2P" in pcie.reason
    assert pcie.choices[0].estimate_s > 5 * nvlink.choices[0].estimate_s
    none = select(a, b, gpu_value(0, 3), CAPS, usable_here=ALL)
    assert dict(none.rejected)["cuda_ipc"] == "no P2P between GPU-n1-0 and GPU-n1-3"
    assert none.best == "nccl"
    same = select(a, b, gpu_value(4, 4), CAPS, usable_here=ALL)
    assert same.best == "cuda_ipc" and "same GPU" in same.reason


def test_gpu_links_travel_in_peer_info():
    peer = node_peer("a", (("GPU-n1-0", "GPU-n1-1", "nvlink"),))
    assert decode_peer(encode_peer(peer)) == peer
    assert peer.gpu_link("GPU-n1-1", "GPU-n1-0") == "nvlink" and peer.gpu_link("GPU-n1-0", "GPU-n1-5") == ""
    import importlib.util

    from tests.conftest import hardware

    links = topology.gpu_links()
    gpus = hardware()["gpus"]
    if gpus < 2 or importlib.util.find_spec("pynvml") is None:
        assert links == ()  # no pair of GPUs, or no NVML to ask: no link facts
    else:  # one entry per pair of GPUs, each naming its kind of link
        assert len(links) == gpus * (gpus - 1) // 2
        assert all(a != b and kind in ("nvlink", "pcie", "none") for a, b, kind in links)


def test_bench_calibrate_writes_a_table_that_agents_use(tmp_path):
    path = str(tmp_path / "costs.json")
    env = {**os.environ, "TENSORWIRE_COSTS_FILE": path, "TENSORWIRE_HOST": "127.0.0.1"}
    run = subprocess.run(
        [sys.executable, "-m", "tensorwire", "bench", "--calibrate", "-e", str(1 << 20), "-n", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert f"wrote {path}" in run.stdout  # where the environment says: this machine's table
    costs = calibration.load_costs(path)
    assert {"shm", "host", "gloo", "ucx"} <= set(costs)
    if importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl_cu13"):
        assert "nixl" in costs  # nixl competes on measured cost
    assert all(c.fixed_us > 0 and c.bandwidth_gbps > 0 for c in costs.values())
    assert "skipped cuda_ipc: not usable here" in run.stdout
    # A table that makes host the cheapest: a new agent's automatic choice follows it.
    calibration.save_costs({**costs, "host": CostEstimate(1, 1000), "ucx": CostEstimate(9e6, 0.01)}, path)
    consumer = Worker(env={"TENSORWIRE_COSTS_FILE": path})
    try:
        import torch

        import tensorwire as tw

        value = torch.arange(1 << 18, dtype=torch.int32)
        got_digest, used = consumer.call("tests.helpers.tasks:get_transport", tw.put(value))
        assert (got_digest, used) == (digest(value), "host")
    finally:
        consumer.close()


@pytest.mark.parametrize("args", [["-e", "10"], ["-n", "0"]])
def test_bench_rejects_bad_sizes(args):
    run = subprocess.run(
        [sys.executable, "-m", "tensorwire", "bench", "--calibrate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2 and "--max-bytes must be at least 1 MiB" in run.stderr


def test_gpu_to_nic_affinity_by_numa_node():
    gpus = [
        {"uuid": "GPU-a", "numa_node": "0"},
        {"uuid": "GPU-b", "numa_node": "1"},
        {"uuid": "GPU-c", "numa_node": "-1"},
    ]
    nics = [
        {"name": "mlx5_0", "numa_node": "0"},
        {"name": "mlx5_1", "numa_node": "1"},
        {"name": "mlx5_2", "numa_node": "1"},
    ]
    assert topology.gpu_nic_affinity(gpus, nics) == {"GPU-a": ["mlx5_0"], "GPU-b": ["mlx5_1", "mlx5_2"], "GPU-c": []}
    assert topology.sysfs_pci_address("00000000:3B:00.0") == "0000:3b:00.0"
