"""Collectives and weight sync between plain processes (no Ray), on the host and, marked
``gpu``, on a GPU (the CUDA paths: cuda_ipc for same-node members)."""

from __future__ import annotations

import pytest

from tensorwire.collectives.weight_sync import _layout, bucket_plan
from tensorwire.transport.packing import packed_layout
from tests.helpers.procs import Worker

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def workers():
    started = [Worker(env={"TENSORWIRE_HOST": "127.0.0.1", "OMP_NUM_THREADS": "1"}) for _ in range(3)]
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


@pytest.mark.parametrize("device", DEVICES)
def test_weight_sync_hooks_between_processes(workers, device):
    import torch

    tensors = 40
    layout = _layout([f"w{i}" for i in range(tensors)], [torch.zeros(1 << 16)] * tensors)
    buckets = bucket_plan([entry[3] for entry in layout], 1 << 20)
    assert buckets == [list(range(i, i + 4)) for i in range(0, tensors, 4)]  # 256 KiB tensors, 1 MiB buckets
    spec = {
        "name": "weights", "sync_id": "standalone", "version": 1, "channel": "tw-sync-standalone-1",
        "members": [w.call("tests.collectives.standalone:describe") for w in workers],
        "parents": {1: 0, 2: 0}, "buckets": buckets, "layout": layout, "source": "weights", "target": "weights",
        "verify": True, "transport": "", "timeout_s": 60.0, "driver": b"", "tensors": tensors,
        "slot_nbytes": max(packed_layout(layout[i][3] for i in b)[1] for b in buckets),
    }  # fmt: skip
    workers[0].send("tests.collectives.standalone:sync_send", spec, device)
    workers[1].send("tests.collectives.standalone:sync_receive", spec, 1, device)
    workers[2].send("tests.collectives.standalone:sync_receive", spec, 2, device)
    sent, *received = [w.result(timeout_s=120) for w in workers]
    assert sent["failed"] == {}
    for result in received:
        assert result["digest"] == sent["digest"] and result["in_place"] and result["version"] == 1
        expected = {"shm": 10} if device == "cpu" else {"cuda_ipc": 10}  # one fetch per bucket
        assert result["transports"] == expected
    workers[0].call("tests.collectives.standalone:release", "standalone")
