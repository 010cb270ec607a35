"""The producer's half of tensorwire as Ray's tensor transport, in one process: which tensors
it takes as they are, and what travels to readers (the state, with Ray's shapes and dtypes
made again from it)."""

from __future__ import annotations

import pickle

import pytest
import torch
from ray import cloudpickle
from ray.experimental.rdt.rdt_store import validate_tensor_buffers

from tensorwire.runtime import ray_transport
from tensorwire.runtime.ref_state import RefState


def _value() -> list[torch.Tensor]:
    return [
        torch.arange(12, dtype=torch.float32),
        torch.ones(2, 3, dtype=torch.bfloat16),
        torch.tensor(7, dtype=torch.int64),
        torch.zeros(4, 5, dtype=torch.bool).t(),  # not contiguous
    ]


@pytest.fixture
def published():
    transport, tensors = ray_transport.TensorwireTransport(), _value()
    metadata = transport.extract_tensor_transport_metadata("obj-shapes", tensors)
    yield metadata, tensors
    transport.garbage_collect("obj-shapes", metadata, tensors)
    assert transport.published_count() == 0


def test_the_metadata_travels_as_the_state_alone(published):
    metadata, tensors = published
    expected = [(t.shape, t.dtype) for t in tensors]
    assert list(metadata.tensor_meta) == expected
    sent = cloudpickle.dumps(metadata)
    assert len(sent) < len(metadata.state) + 200  # no list of sizes and dtypes beside the state
    read = pickle.loads(sent)
    assert isinstance(read, ray_transport.TensorwireMetadata) and read.state == metadata.state
    assert read.tensor_device == "cpu" and len(read.tensor_meta) == 4 and bool(read.tensor_meta)
    assert list(read.tensor_meta) == expected and read.tensor_meta == expected
    assert read.tensor_meta[1] == (torch.Size([2, 3]), torch.bfloat16) and read.tensor_meta[-1][0] == (5, 4)
    assert RefState.from_bytes(read.state).desc.metas == RefState.from_bytes(metadata.state).desc.metas


def test_rays_buffer_check_reads_the_shapes_made_again(published):
    metadata, tensors = published
    read = pickle.loads(cloudpickle.dumps(metadata))
    validate_tensor_buffers([torch.empty(t.shape, dtype=t.dtype) for t in tensors], read.tensor_meta)
    wrong = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    wrong[1] = torch.empty(2, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match="Dtype of tensor_buffer at index 1"):
        validate_tensor_buffers(wrong, read.tensor_meta)


def test_plain_contiguous_tensors_are_taken_as_they_are():
    plain = torch.arange(6.0)
    (taken,) = ray_transport._checked_tensors([plain])
    assert taken is plain


def test_tensors_needing_autograd_or_a_layout_change_are_detached_or_made_contiguous():
    weight = torch.nn.Parameter(torch.arange(4.0))
    frozen = torch.nn.Parameter(torch.arange(3.0), requires_grad=False)
    strided = torch.arange(8.0).reshape(2, 4).t()
    taken = ray_transport._checked_tensors([weight, frozen, strided])
    assert not taken[0].requires_grad and taken[0].data_ptr() == weight.data_ptr()
    assert type(taken[1]) is torch.Tensor and taken[1].data_ptr() == frozen.data_ptr()  # subclasses: detached
    assert taken[2].is_contiguous() and torch.equal(taken[2], strided)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (torch.ones(3).to_sparse(), TypeError, "to_dense"),
        (torch.ones(3, device="meta"), ValueError, r"\.to\('cpu'\)"),
        ([1.0, 2.0], TypeError, "Ray handed it a list"),
    ],
)
def test_what_it_cannot_move_is_named(value, error, match):
    with pytest.raises(error, match=match):
        ray_transport._checked_tensors([torch.ones(2), value])
