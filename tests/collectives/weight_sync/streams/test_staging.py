"""The weight-sync staging ring: packing and reading back, names checked, memory reserved."""

from __future__ import annotations

import os

import pytest
import torch

import tensorwire as tw
from tensorwire.errors import TransportError
from tensorwire.transport.backends.shm.staging import RingReader, StagingRing
from tensorwire.transport.contract import PeerInfo
from tensorwire.transport.hw import topology
from tests.helpers.observe import memfd_segments, segment_names, wait_until


@pytest.fixture
def ring():
    me = PeerInfo("a", "n", "m", "h", os.getpid(), topology.process_start_time(os.getpid()))
    ring = StagingRing(me, 1 << 20)
    yield ring
    ring.close()


def test_buckets_read_back_bit_exact_into_contiguous_and_strided_targets(ring):
    tensors = [torch.randn(1000), torch.arange(7, dtype=torch.uint8), torch.randn(30, 20).to(torch.bfloat16)]
    ring.write(1, tensors)
    reader = RingReader()
    try:
        outs = [torch.zeros(1000), torch.zeros(7, dtype=torch.uint8), torch.zeros(20, 30, dtype=torch.bfloat16).t()]
        assert not outs[2].is_contiguous()
        reader.read(ring.names[1], ring.slot_nbytes, outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, tensors, strict=True))
        ring.write(1, [t + 1 for t in tensors[:1]] + tensors[1:])  # the reader keeps its mapping
        reader.read(ring.names[1], ring.slot_nbytes, outs)
        assert torch.equal(outs[0], tensors[0] + 1)
    finally:
        reader.close()


def test_slots_are_anonymous_reserved_and_released():
    me = PeerInfo("a", "n", "m", "h", os.getpid(), topology.process_start_time(os.getpid()))
    before = memfd_segments({os.getpid()})
    ring = StagingRing(me, 1 << 20)
    held = memfd_segments({os.getpid()}) - before
    assert len(held) == 2 and not segment_names()  # nothing named in /dev/shm
    for mapping in ring._maps:
        assert len(mapping) == ring.slot_nbytes
    reader = RingReader()
    try:
        reader.read(ring.names[0], ring.slot_nbytes, [torch.zeros(4)])
        ring.close()
        assert memfd_segments({os.getpid()}) <= held  # the reader's mapping alone keeps its slot
    finally:
        reader.close()
    # the fd server's thread closes its duplicate after the send returns: possibly after the read
    assert wait_until(lambda: not held & memfd_segments({os.getpid()})), memfd_segments({os.getpid()})


def test_misuse_is_refused(ring):
    with pytest.raises(ValueError, match="does not fit"):
        ring.write(0, [torch.zeros(1 << 20)])
    reader = RingReader()
    path, key, token = ring.names[0].split("|")
    with pytest.raises(TransportError, match="invalid descriptor server address"):
        reader.read(f"/etc/passwd|{key}|{token}", 16, [torch.zeros(4)])
    with pytest.raises(tw.PermissionDeniedError):
        reader.read(f"{path}|{key}|{'00' * 16}", 16, [torch.zeros(4)])
    with pytest.raises(TransportError, match="no such segment"):
        reader.read(f"{path}|{'00' * 16}|{token}", 16, [torch.zeros(4)])


def test_in_place_staging_publishes_contiguous_pieces_as_they_are_and_pools_the_rest():
    from tensorwire.collectives.weight_sync.planning.buckets import IN_FLIGHT
    from tensorwire.collectives.weight_sync.streams.staging import stage

    weight = torch.randn(64, 32)
    bias = torch.randn(32)
    pieces = [
        (weight[8:16], torch.float32),  # rows: contiguous, same dtype -> the trainer's own memory
        (weight[:, :16], torch.float32),  # columns: strided -> gathered into the pool
        (bias, torch.bfloat16),  # converted on the way into the pool
    ]
    pool = [torch.empty(0, dtype=torch.uint8) for _ in range(IN_FLIGHT)]
    out = stage(pieces, pool, 1)
    assert out[0].data_ptr() == weight[8:16].data_ptr() and pool[0].numel() == 0
    assert torch.equal(out[1], weight[:, :16]) and out[1].is_contiguous()
    assert out[2].dtype == torch.bfloat16 and torch.equal(out[2], bias.to(torch.bfloat16))
    pooled = pool[1].data_ptr()
    assert {out[1].data_ptr(), out[2].data_ptr()} <= set(range(pooled, pooled + pool[1].numel()))
    weight.add_(1)  # the next bucket in the same slot reuses the buffer
    again = stage(pieces, pool, 1)
    assert pool[1].data_ptr() == pooled and torch.equal(again[1], weight[:, :16])
    assert stage([(weight[:, :16], torch.float32)], pool, 1)[0].data_ptr() == pooled
    stage([(torch.randn(128, 64).t(), torch.float32)], pool, 1)  # a larger need grows the buffer
    assert pool[1].numel() >= 128 * 64 * 4
