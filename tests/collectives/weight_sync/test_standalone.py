"""Collectives and weight sync between plain processes (no Ray), on the host and, marked
``gpu``, on a GPU (the CUDA paths: cuda_ipc for same-node members)."""

from __future__ import annotations

import pytest

from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import plan_sync
from tensorwire.collectives.weight_sync.protocol.assign import assign_roles
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tests.helpers.procs import Worker, start_method_for

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def workers(request: pytest.FixtureRequest):
    env = {"TENSORWIRE_HOST": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    started = [Worker(env=env, start_method=start_method_for(request.node)) for _ in range(3)]
    yield started
    for worker in started:
        worker.close()


@pytest.mark.parametrize("device", DEVICES)
def test_tensorwire_broadcast_between_processes(workers, device):
    descriptions = [w.call("tests.collectives.standalone:describe") for w in workers]
    for rank, worker in enumerate(workers):
        worker.send("tests.collectives.standalone:broadcast", "g", rank, descriptions, device, 1)
    digests = [w.result(timeout_s=120) for w in workers]
    assert digests == [workers[0].call("tests.collectives.standalone:expected_broadcast", 1)] * 3


@pytest.mark.parametrize("aside", ["none", "host"])
@pytest.mark.parametrize("device", DEVICES)
def test_weight_sync_hooks_between_processes(workers, device, aside):
    """In place, or (``aside="host"``) assembled in host memory, pinned for a GPU receiver, and
    published into its tensors."""
    tensors = 40
    layout = tuple(ParamPiece(f"w{i}", (1 << 16,), "float32", Box.full((1 << 16,))) for i in range(tensors))
    plan = plan_sync([layout], [layout, layout])
    descriptions = [w.call("tests.collectives.standalone:describe") for w in workers]
    roles, buckets = assign_roles(
        plan,
        [0, 1],
        trainer_layouts=[layout],
        receiver_layouts=[layout, layout],
        descriptions=descriptions,
        bucket_bytes=1 << 20,
    )
    assert buckets == 10  # 4 tensors of 256 KiB per bucket

    def spec(rank: int) -> PushSpec:
        return PushSpec(
            sync_id="standalone",
            name="weights",
            version=1,
            channel="tw-sync-standalone-1",
            members=tuple(descriptions),
            rank=rank,
            where="weights",
            layout=layout,
            roles=roles[rank],
            verify=True,
            transport="",
            timeout_s=60.0,
            shadow=aside == "host" and rank > 0,
            shadow_on_host=aside == "host" and rank > 0,
        )

    workers[0].send("tests.collectives.standalone:sync_send", spec(0), tensors, device)
    workers[1].send("tests.collectives.standalone:sync_receive", spec(1), tensors, device)
    workers[2].send("tests.collectives.standalone:sync_receive", spec(2), tensors, device)
    sent, *received = [w.result(timeout_s=120) for w in workers]
    assert sent["failed"] == {} and sent["sent_nbytes"] == plan.nbytes
    for result in received:
        assert result["digest"] == sent["digest"] and result["in_place"] and result["version"] == 1
        expected = {"shm": 10} if device == "cpu" else {"cuda_ipc": 10}
        assert result["transports"] == expected and result["nbytes"] == tensors << 18
        if aside == "host":  # not beside the receiver's tensors: host memory, pinned for a GPU
            assert result["aside_nbytes"] == tensors << 18
            assert set(result["shadows"]) == {("cpu", device == "cuda")}
    workers[0].call("tests.collectives.standalone:release", "standalone")


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_weight_sync_hooks_between_processes(workers, device):
    """Two trainer processes (rows of w, all of b) into one receiver (columns of w, as bf16)."""
    from tensorwire.collectives.weight_sync.planning.layout import Shard, placement_box

    trainers = [
        (
            ParamPiece(
                "w", (64, 32), "float32", placement_box((64, 32), [Shard(0)], (2,), (r,)), (Shard(0),), (2,), (r,)
            ),
            ParamPiece("b", (32,), "float32", Box.full((32,))),
        )
        for r in range(2)
    ]
    receiver = (
        ParamPiece("w", (64, 32), "bfloat16", Box((0, 16), (64, 16)), (Shard(1),), (2,), (1,)),
        ParamPiece("b", (32,), "float32", Box.full((32,))),
    )
    plan = plan_sync(trainers, [receiver])
    descriptions = [w.call("tests.collectives.standalone:describe") for w in workers]
    roles, _buckets = assign_roles(
        plan, [0], trainer_layouts=trainers, receiver_layouts=[receiver], descriptions=descriptions, bucket_bytes=1024
    )

    def spec(rank: int, layout: tuple) -> PushSpec:
        return PushSpec(
            sync_id="sharded",
            name="weights",
            version=1,
            channel="tw-sync-sharded-1",
            members=tuple(descriptions),
            rank=rank,
            where="weights",
            layout=layout,
            roles=roles[rank],
            verify=True,
            transport="",
            timeout_s=60.0,
        )

    for rank in range(2):
        workers[rank].send("tests.collectives.standalone:sharded_send", spec(rank, trainers[rank]), rank, device)
    workers[2].send("tests.collectives.standalone:sharded_receive", spec(2, receiver), device)
    sent = [w.result(timeout_s=120) for w in workers[:2]]
    received = workers[2].result(timeout_s=120)
    assert all(s["failed"] == {} for s in sent)
    assert received["exact"] and received["version"] == 1
    assert received["nbytes"] == plan.nbytes == 64 * 16 * 2 + 32 * 4  # bf16 on the wire: converted by the trainers
    for rank in range(2):
        workers[rank].call("tests.collectives.standalone:release", "sharded")
