"""Logic of the GPU transports that runs without a GPU: handle encoding, device identity by
UUID, and selector decisions on fake topologies (2 nodes x 8 GPUs, no P2P, no-GPU consumer).

The transfers themselves are in ``tests/gpu`` (marked ``gpu`` / ``multi_gpu``).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tensorwire.errors import TransportError
from tensorwire.transport import selector
from tensorwire.transport.agent.destinations import prepare
from tensorwire.transport.backends.cuda_ipc import CudaIpcTransport, IpcRecord, decode_records, encode_records
from tensorwire.transport.backends.gloo import GlooTransport
from tensorwire.transport.backends.host import HostTransport
from tensorwire.transport.backends.inline import InlineTransport
from tensorwire.transport.backends.local import LocalTransport
from tensorwire.transport.backends.nccl import NcclTransport
from tensorwire.transport.backends.shm.transport import ShmTransport
from tensorwire.transport.backends.ucx import UcxTransport
from tensorwire.transport.contract import Capabilities, DeviceInfo, MemoryKind, PeerInfo, TensorMeta
from tensorwire.transport.hw import topology
from tensorwire.transport.selector import ObjectSummary

CLASSES = (LocalTransport, InlineTransport, ShmTransport, HostTransport, GlooTransport, UcxTransport)
CAPS = {t.name: t.capabilities for t in (*CLASSES, CudaIpcTransport, NcclTransport)}
select = functools.partial(
    selector.select, cost_models={t.name: t.cost_model for t in (*CLASSES, CudaIpcTransport, NcclTransport)}
)
ALL = frozenset(CAPS)
CUDA = frozenset({MemoryKind.CUDA})


def gpus(node: str, count: int = 8, visible: list[int] | None = None) -> tuple[DeviceInfo, ...]:
    """A process's devices: physical GPUs ``visible`` (default all) of ``node``, re-indexed
    from 0 as ``CUDA_VISIBLE_DEVICES`` does."""
    chosen = visible if visible is not None else list(range(count))
    cuda = [DeviceInfo("cuda", i, uuid=f"GPU-{node}-{p}") for i, p in enumerate(chosen)]
    return (DeviceInfo("cpu", 0), *cuda)


def peer(agent: str, node: str, devices: tuple[DeviceInfo, ...]) -> PeerInfo:
    return PeerInfo(
        agent_id=agent,
        node_id=node,
        machine_id=node,
        hostname=node,
        pid=1,
        start_time=1,
        transports=tuple(CAPS),
        devices=devices,
    )


def cuda_object(src: str, dst: str | None, nbytes: int = 64 << 20) -> ObjectSummary:
    return ObjectSummary(
        nbytes=nbytes,
        memory=CUDA,
        exported=frozenset(),  # cuda_ipc handles are asked for per consumer, never carried
        src_devices=frozenset({src}),
        dst_devices=frozenset({dst}) if dst else frozenset(),
    )


def test_ipc_records_round_trip_and_reject_malformed_handles():
    records = [
        IpcRecord("GPU-a-1", b"\x01" * 64, 1 << 20, 512, b"/torch_123", 7, b"\x02" * 64, True, 256),
        IpcRecord("GPU-a-1", b"", 0, 0, b"", 0, b"", False, 0),  # an empty tensor
    ]
    data = encode_records(records)
    assert decode_records(data) == records
    for broken in (data[:-1], data + b"x", b"\x09" + data[1:], b""):
        with pytest.raises(TransportError):
            decode_records(broken)


def test_devices_are_matched_by_uuid_not_index():
    producer = gpus("n1", visible=[5, 3])  # CUDA_VISIBLE_DEVICES=5,3: physical 5 is index 0
    consumer = gpus("n1", visible=[3, 5])
    uuid = producer[1].uuid  # the producer's cuda:0
    assert uuid == "GPU-n1-5"
    assert topology.local_cuda_index(uuid, consumer) == 1
    assert topology.local_cuda_index("GPU-n1-7", consumer) is None
    assert topology.normalize_uuid("3f2a-11") == "GPU-3f2a-11"
    assert topology.normalize_uuid("GPU-3f2a-11") == topology.normalize_uuid(" GPU-3f2a-11 ")


def test_same_gpu_same_node_picks_cuda_ipc_and_rules_out_nccl():
    a = peer("a", "n1", gpus("n1"))
    b = peer("b", "n1", gpus("n1"))
    sel = select(a, b, cuda_object("GPU-n1-3", "GPU-n1-3"), CAPS, usable_here=ALL)
    assert sel.best == "cuda_ipc"
    assert "GPU-n1-3 -> GPU-n1-3" in sel.reason
    assert "NCCL refuses two ranks on one GPU" in dict(sel.rejected)["nccl"]
    assert "no handle" in dict(sel.rejected)["shm"]  # shm exports host memory only


def test_other_gpu_same_node_picks_cuda_ipc_when_visible():
    a = peer("a", "n1", gpus("n1"))
    b = peer("b", "n1", gpus("n1"))
    sel = select(a, b, cuda_object("GPU-n1-3", "GPU-n1-5"), CAPS, usable_here=ALL)
    assert [c.transport for c in sel.choices][:2] == ["cuda_ipc", "nccl"]


def test_consumer_that_cannot_see_the_gpu_gets_a_staged_path():
    a = peer("a", "n1", gpus("n1", visible=[0]))
    b = peer("b", "n1", gpus("n1", visible=[1]))  # another GPU, the producer's is not visible
    sel = select(a, b, cuda_object("GPU-n1-0", "GPU-n1-1"), CAPS, usable_here=ALL)
    assert "cannot see the producer's GPU GPU-n1-0" in dict(sel.rejected)["cuda_ipc"]
    assert sel.best == "nccl"  # different GPUs: NCCL can still move it
    no_nccl = select(a, b, cuda_object("GPU-n1-0", "GPU-n1-1"), CAPS, usable_here=ALL - {"nccl"})
    assert no_nccl.best in ("ucx", "host")


def test_consumer_without_gpu_lands_on_host():
    a = peer("a", "n1", gpus("n1"))
    cpu_only = peer("c", "n1", (DeviceInfo("cpu", 0),))
    sel = select(a, cpu_only, cuda_object("GPU-n1-2", None), CAPS, usable_here=ALL)
    rejected = dict(sel.rejected)
    assert "cannot see the producer's GPU" in rejected["cuda_ipc"]
    assert rejected["nccl"] == "the consumer receives into host memory"
    assert sel.best == "ucx" and "GPU-n1-2 -> host" in sel.reason
    assert "host" in [c.transport for c in sel.choices]


def test_two_nodes_of_eight_gpus_cross_node_picks_nccl():
    a = peer("a", "n1", gpus("n1"))
    b = peer("b", "n2", gpus("n2"))
    for src, dst in [(0, 0), (3, 7), (7, 1)]:
        sel = select(a, b, cuda_object(f"GPU-n1-{src}", f"GPU-n2-{dst}"), CAPS, usable_here=ALL)
        assert sel.best == "nccl", sel.reason
        assert "different node" in dict(sel.rejected)["cuda_ipc"]
        assert sel.reason.startswith("cross node (n1 -> n2)")


def test_mixed_vendor_consumer_cannot_open_nvidia_handles():
    a = peer("a", "n1", gpus("n1"))
    amd = peer("m", "n1", (DeviceInfo("cpu", 0), DeviceInfo("rocm", 0, uuid="AMD-0")))
    sel = select(a, amd, cuda_object("GPU-n1-0", None), CAPS, usable_here=ALL)
    assert "cuda_ipc" not in [c.transport for c in sel.choices]
    assert sel.best in ("ucx", "host")


def test_destinations_follow_what_the_transport_can_write():
    metas = (TensorMeta((4,), "float32", "cuda:0", 16, 0), TensorMeta((2,), "int64", "cuda:0", 16, 64))
    host_only = Capabilities(one_sided=False, same_process=False, same_node=True, cross_node=True)
    given = torch.zeros(4)
    out, lease = prepare(metas, 128, [given, None], [torch.device("cpu"), torch.device("cpu")], host_only)
    assert lease is None
    assert out[0] is given and out[1].device.type == "cpu" and out[1].dtype == torch.int64
    # A CUDA target with a host-only transport lands on the host (the caller moves it).
    fake_cuda_target = [torch.device("cuda", 0)] * 2
    out, _ = prepare(metas, 128, None, fake_cuda_target, host_only)
    assert [t.device.type for t in out] == ["cpu", "cpu"]


def test_gpu_transports_say_why_they_cannot_run_here():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; tests/gpu covers the transports")
    context = SimpleNamespace(config=None)
    assert CudaIpcTransport(context).unavailable_reason() == "no CUDA device visible to this process"
    assert NcclTransport(context).unavailable_reason() == "no CUDA device visible to this process"


def test_nccl_refuses_one_gpu_and_hostdestinations():
    transport = NcclTransport(SimpleNamespace(config=None))
    meta = TensorMeta((4,), "float32", "cuda:0", 16, 0, device_uuid="GPU-x")
    request = SimpleNamespace(metas=(meta,))
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    original = topology.cuda_uuid
    try:
        topology.cuda_uuid = lambda index: "GPU-x"  # this process's cuda:0 is the producer's GPU
        with pytest.raises(TransportError, match="two ranks on one GPU"):
            transport.connection_scope(request, [on_gpu])
        topology.cuda_uuid = lambda index: "GPU-y"
        assert transport.connection_scope(request, [on_gpu]) == "GPU-x->GPU-y"
        with pytest.raises(TransportError, match="one GPU of the consumer"):
            transport.connection_scope(request, [SimpleNamespace(device=torch.device("cpu"))])
    finally:
        topology.cuda_uuid = original


def test_cupy_memory_is_not_offered_to_cuda_ipc():
    a, b = peer("a", "n1", gpus("n1")), peer("b", "n1", gpus("n1"))
    value = replace(cuda_object("GPU-n1-0", "GPU-n1-0"), foreign_memory=True)
    sel = select(a, b, value, CAPS, usable_here=ALL)
    assert "allocated by cupy or another DLPack producer" in dict(sel.rejected)["cuda_ipc"]
    assert sel.best == "ucx"


def test_cuda_ipc_checks_a_cached_objects_owner_at_most_once_a_second(monkeypatch):
    """The hot path of a repeated fetch makes no liveness syscall (GPU fixed cost); the owner
    is still asked when an object is first opened and again after LIVENESS_CHECK_S."""
    from tensorwire.errors import OwnerDiedError
    from tensorwire.transport.backends import cuda_ipc
    from tensorwire.transport.contract import FetchRequest

    alive, asked = [True], []

    def check_owner(request):
        raise OwnerDiedError("owner died")

    context = SimpleNamespace(peer_may_be_alive=lambda peer: asked.append(peer) or alive[0], check_owner=check_owner)
    transport = CudaIpcTransport(context)
    clock = [100.0]
    monkeypatch.setattr(cuda_ipc.time, "monotonic", lambda: clock[0])
    mapped = [torch.zeros(3)]
    transport._opened[b"o" * 16] = mapped
    owner = SimpleNamespace(pid=4242, start_time=7)
    request = FetchRequest(b"o" * 16, b"t" * 16, owner, (), 0, b"", clock[0] + 60)
    assert transport._open(request) is mapped and len(asked) == 1  # first use of this owner: asked
    for _ in range(5):
        clock[0] += 0.1
        assert transport._open(request) is mapped
    assert len(asked) == 1  # within LIVENESS_CHECK_S: no syscall per fetch
    clock[0] += cuda_ipc.LIVENESS_CHECK_S
    assert transport._open(request) is mapped and len(asked) == 2
    alive[0] = False
    clock[0] += cuda_ipc.LIVENESS_CHECK_S
    with pytest.raises(OwnerDiedError):
        transport._open(request)
    assert b"o" * 16 not in transport._opened  # the dead owner's mapping is let go
