"""The weight-sync staging ring: packing and reading back, names checked, memory reserved."""

from __future__ import annotations

import os

import pytest
import torch

from tensorwire.collectives.staging import RingReader, StagingRing
from tensorwire.errors import TransportError
from tensorwire.transport import topology
from tensorwire.transport.base import PeerInfo
from tensorwire.transport.shm import SHM_DIR


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


def test_segments_are_private_reserved_and_removed(ring):
    for name in ring.names:
        info = os.stat(os.path.join(SHM_DIR, name))
        assert info.st_mode & 0o777 == 0o600
        assert info.st_blocks * 512 >= ring.slot_nbytes  # pages reserved: no SIGBUS later
    paths = [os.path.join(SHM_DIR, n) for n in ring.names]
    ring.close()
    assert not any(os.path.exists(p) for p in paths)


def test_misuse_is_refused(ring):
    with pytest.raises(ValueError, match="does not fit"):
        ring.write(0, [torch.zeros(1 << 20)])
    reader = RingReader()
    with pytest.raises(TransportError, match="invalid shared-memory segment name"):
        reader.read("../etc/passwd", 16, [torch.zeros(4)])
    with pytest.raises(FileNotFoundError):
        reader.read(ring.names[0][:-4] + "0000", 16, [torch.zeros(4)])
