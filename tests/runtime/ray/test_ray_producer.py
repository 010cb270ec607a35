"""The producer's half of tensorwire as Ray's tensor transport, in one process: which tensors
it takes as they are, and what travels to readers (the state, with Ray's shapes and dtypes
made again from it)."""

from __future__ import annotations

import pickle

import pytest
import torch
from ray import cloudpickle
from ray.experimental.rdt.rdt_store import validate_tensor_buffers

from tensorwire.runtime.ray import transport as ray_transport
from tensorwire.runtime.refs.ref_state import RefState


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


def test_a_value_without_tensors_reads_as_an_empty_list_after_the_trip():
    metadata = ray_transport.TensorwireMetadata(tensor_meta=[], tensor_device=None)
    read = pickle.loads(cloudpickle.dumps(metadata))
    assert read.tensor_meta == [] and list(read.tensor_meta) == [] and not read.tensor_meta
    assert "tensor_meta=[]" in repr(read)


def test_tensors_are_registered_as_twins_on_their_memory_detached_and_contiguous():
    plain = torch.arange(6.0)
    weight = torch.nn.Parameter(torch.arange(4.0))
    frozen = torch.nn.Parameter(torch.arange(3.0), requires_grad=False)
    grad = torch.arange(5.0, requires_grad=True)
    strided = torch.arange(8.0).reshape(2, 4).t()
    taken = ray_transport._checked_tensors([plain, weight, frozen, grad, strided])
    for given, twin in zip([plain, weight, frozen, grad], taken, strict=False):
        assert twin is not given and twin.data_ptr() == given.data_ptr()
        assert type(twin) is torch.Tensor and not twin.requires_grad
    assert taken[4].is_contiguous() and torch.equal(taken[4], strided)
    plain.set_(torch.zeros(6))  # the caller points its tensor elsewhere: the twin keeps the memory it had
    assert torch.equal(taken[0], torch.arange(6.0))


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
