"""Property-based tests (hypothesis): the value walker, the wire messages, the control service.

The default suite runs a bounded number of examples; ``-m slow`` fuzzes the control service
for longer (``TENSORWIRE_FUZZ_EXAMPLES``, default 3,000).
"""

from __future__ import annotations

import os

import grpc
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings

from tensorwire.runtime.refs.values import flatten, unflatten
from tensorwire.transport.agent.control import cluster_token
from tensorwire.transport.agent.wire import messages
from tensorwire.transport.contract import TensorKind
from tensorwire.transport.packing import ByteSink, iter_stream_chunks
from tests.helpers.tasks import digest
from tests.transport.agent.test_control import METHODS, _code_and_details, _raw_call

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    if draw(st.booleans()) and shape:
        shape[draw(st.integers(0, len(shape) - 1))] = 0  # an empty dimension
    if draw(st.integers(0, 9)) == 0:
        shape = [0, 2**31]  # a huge dimension with no elements
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    base = torch.randn(shape, generator=gen) * 50 if shape != [0, 2**31] else torch.empty(shape)
    tensor = (base > 0) if dtype == torch.bool else base.to(dtype)
    if tensor.dim() >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(0, 1)  # non-contiguous strides
    if tensor.dim() >= 1 and tensor.shape[0] > 1 and draw(st.booleans()):
        tensor = tensor[::2]
    if draw(st.integers(0, 4)) == 0 and dtype not in (torch.bfloat16,) and tensor.numel() < 1000:
        return tensor.numpy()
    return tensor


leaves = st.one_of(tensors(), st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False))
values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(st.text(min_size=1, max_size=4), children, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=values, chunk_nbytes=st.sampled_from([1, 7, 64, 4096, 1 << 20]))
def test_walker_and_stream_round_trip(value, chunk_nbytes):
    """flatten -> stream chunks -> sink -> unflatten gives back the same value, byte for byte."""
    skeleton, parts, kinds = flatten(value)
    received = [torch.empty_like(t) for t in parts]
    sink = ByteSink(received)
    for chunk in iter_stream_chunks(parts, chunk_nbytes):
        sink.write(chunk)
    sink.finish()
    leaves_back = [r.numpy() if k is TensorKind.NUMPY else r for r, k in zip(received, kinds, strict=True)]
    assert digest(unflatten(skeleton, leaves_back)) == digest(value)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=256), name=st.sampled_from(sorted(messages)))
def test_wire_messages_parse_or_raise_decode_error(data, name):
    try:
        message = messages[name].FromString(data)
    except DecodeError:
        return
    assert messages[name].FromString(message.SerializeToString()) == message


@settings(max_examples=100, deadline=None)
@given(
    object_id=st.binary(max_size=32),
    token=st.binary(max_size=32),
    pin=st.binary(max_size=16),
    kind=st.integers(-5, 10),
    cut=st.integers(0, 200),
)
def test_truncated_holder_batches_never_crash_the_parser(object_id, token, pin, kind, cut):
    """A cut batch either fails to parse with ``DecodeError`` or parses to at most the two ops
    it held, each one of them intact or a prefix of the original's fields (never garbage)."""
    op = messages["HolderOp"](kind=kind, object_id=object_id, token=token, pin_id=pin)
    data = messages["HolderBatch"](ops=[op, op]).SerializeToString()
    try:
        batch = messages["HolderBatch"].FromString(data[:cut])
    except DecodeError:
        assert cut < len(data)  # the whole batch always parses
        return
    assert len(batch.ops) <= 2
    if cut >= len(data):
        assert list(batch.ops) == [op, op]
    for parsed in batch.ops:  # a field is either absent (cut before it) or exactly as sent
        for field in ("kind", "object_id", "token", "pin_id"):
            assert getattr(parsed, field) in (getattr(op, field), type(getattr(op, field))())


# Each rejection the service makes, by name. UNKNOWN is what gRPC answers when a handler raised
# an exception it did not map: a crash, so it fails the test.
ALLOWED = {
    grpc.StatusCode.OK,  # random bytes can be a valid request (an empty Ping, a Free of nothing)
    grpc.StatusCode.INTERNAL,  # only as "the request did not parse" (checked below)
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def fuzz_control_service(agent, payloads: list[bytes]) -> None:
    token = cluster_token()
    for payload in payloads:
        for method in METHODS:
            code, details = _code_and_details(agent, method, payload)
            assert code in ALLOWED, (method, payload, code, details)
            if code == grpc.StatusCode.INTERNAL:
                assert details == "Exception deserializing request!", (method, payload, details)
    reply = messages["PingReply"].FromString(
        _raw_call(agent.peer.unix_address, "Ping", messages["PingRequest"]().SerializeToString(), token)
    )
    assert reply.peer.agent_id == agent.peer.agent_id


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=200))
def test_control_service_survives_arbitrary_requests(agent, payload):
    fuzz_control_service(agent, [payload])


@pytest.mark.slow
def test_control_service_fuzz_long(agent):
    examples = int(os.environ.get("TENSORWIRE_FUZZ_EXAMPLES", "3000"))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=st.binary(max_size=2048))
    def run(payload):
        fuzz_control_service(agent, [payload])

    run()


def test_numpy_dtypes_round_trip():
    dtypes = (np.int8, np.uint16, np.float16, np.complex128, np.bool_)
    value = [(np.arange(6) % 3).astype(d).reshape(2, 3) for d in dtypes]
    value.append(np.array(2.5))  # 0-d stays 0-d
    skeleton, parts, kinds = flatten(value)
    assert all(k is TensorKind.NUMPY for k in kinds)
    assert digest(unflatten(skeleton, [p.numpy() for p in parts])) == digest(value)
