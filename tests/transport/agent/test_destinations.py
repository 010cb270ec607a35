"""Where a fetched object's bytes land (``transport/agent/destinations.py``): the caller's
buffers, pooled memory, new tensors on the target; and after the transfer, in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorwire.transport.agent.destinations import finish, prepare
from tensorwire.transport.contract import Capabilities, MemoryKind, TensorMeta
from tensorwire.transport.host_pool import HostPool

HOST = Capabilities(one_sided=False, same_process=False, same_node=True, cross_node=True)
CUDA_TOO = Capabilities(
    one_sided=False,
    same_process=False,
    same_node=True,
    cross_node=True,
    memory=frozenset({MemoryKind.HOST, MemoryKind.CUDA}),
)
CPU = torch.device("cpu")
METAS = (TensorMeta((4,), "float32", "cpu", 16, 0), TensorMeta((2, 2), "int64", "cpu", 32, 64))


def test_a_contiguous_host_buffer_is_filled_in_place_and_others_get_new_tensors():
    given = torch.zeros(4)
    out, lease = prepare(METAS, 128, [given, None], [CPU, CPU], HOST)
    assert lease is None and out[0] is given
    assert out[1].shape == (2, 2) and out[1].dtype == torch.int64 and out[1].device == CPU


def test_a_buffer_the_transport_cannot_write_is_copied_into_at_the_end():
    strided = torch.zeros(4, 2)[:, 0]  # not contiguous
    out, _ = prepare(METAS, 128, [strided, None], [CPU, CPU], HOST)
    assert out[0] is not strided and out[0].is_contiguous()
    out[0].copy_(torch.arange(4.0))
    out[1].fill_(7)
    placed = finish(out, [strided, None], [CPU, CPU])
    assert placed[0] is strided and torch.equal(strided, torch.arange(4.0))
    assert torch.equal(placed[1], torch.full((2, 2), 7))


def test_a_cuda_target_lands_on_the_host_for_a_host_only_transport():
    cuda_targets = [torch.device("cuda", 0)] * 2
    out, _ = prepare(METAS, 128, None, cuda_targets, HOST)
    assert [t.device.type for t in out] == ["cpu", "cpu"]  # finish() then moves them (needs a GPU)


def test_pooled_destinations_share_one_buffer_in_the_packed_layout():
    pool = HostPool(max_idle_nbytes=8 << 20, min_nbytes=64)
    metas = (TensorMeta((256,), "float32", "cpu", 1024, 0), TensorMeta((16,), "uint8", "cpu", 16, 1024))
    out, lease = prepare(metas, 1088, [None, None], [CPU, CPU], HOST, pool=pool, pooled=True)
    assert lease is not None
    base = np.frombuffer(lease.array, dtype=np.uint8).ctypes.data
    assert out[0].data_ptr() == base and out[1].data_ptr() == base + 1024
    given = torch.zeros(16, dtype=torch.uint8)
    out, lease = prepare(metas, 1088, [None, given], [CPU, CPU], HOST, pool=pool, pooled=True)
    assert out[1] is given and lease is not None  # the caller's buffer wins over the pool


def test_pooled_tensors_of_every_dtype_and_shape_are_views_at_their_offsets():
    pool = HostPool(max_idle_nbytes=8 << 20, min_nbytes=64)
    metas = (
        TensorMeta((2, 3), "bfloat16", "cpu", 12, 0),
        TensorMeta((), "int64", "cpu", 8, 64),
        TensorMeta((5,), "float32", "cpu", 20, 128),
        TensorMeta((3,), "bool", "cpu", 3, 192),
        TensorMeta((2, 1), "complex128", "cpu", 32, 256),
        TensorMeta((4,), "bfloat16", "cpu", 8, 320),
    )
    out, lease = prepare(metas, 384, None, None, HOST, pool=pool, pooled=True)
    base = np.frombuffer(lease.array, dtype=np.uint8).ctypes.data
    assert [t.data_ptr() - base for t in out] == [m.offset for m in metas]
    assert [tuple(t.shape) for t in out] == [m.shape for m in metas]
    assert [str(t.dtype) for t in out] == [f"torch.{m.dtype}" for m in metas]
    assert all(t.is_contiguous() and t.nbytes == m.nbytes for t, m in zip(out, metas, strict=True))
    for index, tensor in enumerate(out):  # each writes its own bytes only
        tensor.reshape(-1).view(torch.uint8).fill_(index + 1)
    bytes_ = np.frombuffer(lease.array, dtype=np.uint8)
    for index, meta in enumerate(metas):
        assert (bytes_[meta.offset : meta.offset + meta.nbytes] == index + 1).all()


@pytest.mark.parametrize(
    "bad",
    [
        TensorMeta((2,), "float32", "cpu", 8, 2),  # not on a whole item
        TensorMeta((2,), "float32", "cpu", 6, 64),  # bytes that are no whole items
        TensorMeta((3,), "float32", "cpu", 8, 64),  # a shape the bytes do not hold
        TensorMeta((2,), "float32", "cpu", 8, 124),  # past the packed object
        TensorMeta((2, 2), "float32", "cpu", 8, 64),
    ],
)
def test_pooled_views_refuse_metadata_that_is_not_the_packed_layout(bad):
    pool = HostPool(max_idle_nbytes=8 << 20, min_nbytes=64)
    with pytest.raises(RuntimeError):
        prepare((TensorMeta((4,), "float32", "cpu", 16, 0), bad), 128, None, None, HOST, pool=pool, pooled=True)


def test_pooled_when_asked_or_when_a_transport_registers_buffers_from_another_node():
    pool = HostPool(max_idle_nbytes=8 << 20, min_nbytes=64)
    registers = Capabilities(
        one_sided=True, same_process=False, same_node=True, cross_node=True, registers_buffers=True
    )
    assert prepare(METAS, 128, None, [CPU, CPU], HOST, pool=pool)[1] is None  # neither
    assert prepare(METAS, 128, None, [CPU, CPU], registers, pool=pool)[1] is None  # same node
    assert prepare(METAS, 128, None, [CPU, CPU], registers, pool=pool, other_node=True)[1] is not None
    assert prepare(METAS, 128, None, [CPU, CPU], HOST, pool=pool, other_node=True)[1] is None
    assert (
        prepare(METAS, 128, None, [CPU, CPU], HOST, pool=None, pooled=True)[1] is None
    )  # no pool: a view was asked for


def test_nothing_is_pooled_for_tensors_that_have_their_buffer():
    pool = HostPool(max_idle_nbytes=8 << 20, min_nbytes=64)
    given = [torch.zeros(4), torch.zeros(2, 2, dtype=torch.int64)]
    assert prepare(METAS, 128, given, [CPU, CPU], HOST, pool=pool, pooled=True)[1] is None


@pytest.mark.parametrize("given", [None, "buffer"])
def test_finish_leaves_tensors_in_place_when_they_already_are(given):
    tensor = torch.arange(4.0)
    dst = [tensor] if given else None
    assert finish([tensor], dst, [CPU])[0] is tensor
