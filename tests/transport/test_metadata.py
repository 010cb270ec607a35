"""Descriptors in pickled references: metadata as plain rows, the same layout decoded once,
facts about the tensors worked out once, every memo bounded, malformed rows refused."""

from __future__ import annotations

import pickle

import pytest
import torch

from tensorwire.transport import metadata
from tensorwire.transport.contract import MemoryKind, ObjectDescriptor, PeerInfo, TensorKind, TensorMeta

OWNER = PeerInfo(agent_id="owner", node_id="n", machine_id="m", hostname="h", pid=2, start_time=1)


def _metas(count: int, nbytes: int = 64, device: str = "cpu") -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta((nbytes // 4,), "float32", device, nbytes, i * nbytes) for i in range(count))


def _descriptor(metas: tuple[TensorMeta, ...], object_id: bytes = b"o" * 16) -> ObjectDescriptor:
    return ObjectDescriptor(object_id, b"t" * 16, OWNER, metas, sum(m.nbytes for m in metas))


def test_a_descriptor_round_trips_and_a_layout_seen_before_decodes_to_the_same_metadata():
    metas = (*_metas(3), TensorMeta((2, 3), "bfloat16", "cuda:1", 12, 192, TensorKind.CUPY, "GPU-x"))
    desc = _descriptor(metas)
    again = pickle.loads(pickle.dumps(desc))
    assert again == desc and again.owner == OWNER and again.nbytes == 3 * 64 + 12
    other_object = pickle.loads(pickle.dumps(_descriptor(tuple(m._replace() for m in metas), b"p" * 16)))
    assert other_object.object_id == b"p" * 16 and other_object.metas is again.metas  # decoded once
    assert metadata.rows(desc.metas) is metadata.rows(desc.metas)  # encoded once per tuple


def test_facts_name_bytes_memory_and_gpus():
    host = _metas(4)
    assert metadata.facts(host) == (256, frozenset({MemoryKind.HOST}), frozenset(), False, True)
    mixed = (
        *host,
        TensorMeta((4,), "uint8", "cuda:0", 4, 256, TensorKind.DLPACK, "GPU-a"),
        TensorMeta((4,), "uint8", "cuda:1", 4, 260, TensorKind.TORCH, "GPU-b"),
    )
    facts = metadata.facts(mixed)
    assert facts.nbytes == 264 and facts.memory == {MemoryKind.HOST, MemoryKind.CUDA}
    assert facts.src_devices == {"GPU-a", "GPU-b"} and facts.foreign_memory and not facts.cpu_only
    assert metadata.facts(()) == (0, frozenset({MemoryKind.HOST}), frozenset(), False, True)
    other_device = (*host, TensorMeta((4,), "uint8", "xpu:0", 4, 256))  # host memory to the selector, not the cpu's
    assert metadata.facts(other_device).memory == {MemoryKind.HOST} and not metadata.facts(other_device).cpu_only


def test_memos_stay_bounded_in_entries_and_in_tensors_and_answer_right_after_being_cleared():
    layouts = [_metas(2, nbytes=8 * (i + 1)) for i in range(3 * metadata.MEMO_SIZE)]
    layouts += [_metas(metadata.MEMO_TENSORS // 3, nbytes=4 * (i + 1)) for i in range(4)]  # large state dicts
    for metas in layouts:
        decoded = pickle.loads(pickle.dumps(_descriptor(metas)))
        assert decoded.metas == metas and metadata.facts(decoded.metas).nbytes == sum(m.nbytes for m in metas)
    for memo in (metadata._rows_of, metadata._metas_of, metadata._facts_of):
        assert 0 < len(memo.entries) <= metadata.MEMO_SIZE
        assert (
            sum(len(key) if isinstance(key, tuple) else len(value[0]) for key, value in memo.entries.items())
            <= metadata.MEMO_TENSORS
        )


@pytest.mark.parametrize(
    "rows",
    [
        (((4,), "float32", "cpu", 16, 0, "no-such-kind", ""),),  # an unknown tensor kind
        (((4,), "float32", "cpu"),),  # a row too short
        ([[4], "float32", "cpu", 16, 0, "torch", ""],),  # unhashable parts
        (((4,), "float32", "cpu", 16.0, 0, "torch", ""),),  # a float that equals a good row's int
        (((True,), "float32", "cpu", 16, 0, "torch", ""),),  # a bool for a dimension
        (("4", "float32", "cpu", 16, 0, "torch", ""),),  # a string for the shape
        [((4,), "float32", "cpu", 16, 0, "torch", "")],  # a list of rows
    ],
)
def test_malformed_rows_in_a_reference_are_a_value_error(rows):
    with pytest.raises(ValueError, match="malformed tensor metadata"):
        metadata.descriptor_from_rows(metadata.FORMAT, b"o" * 16, b"t" * 16, OWNER, rows, 16)


def test_a_loose_row_never_stands_for_a_good_one():
    good = (((4,), "float32", "cpu", 16, 0, "torch", ""),)
    loose = (((4,), "float32", "cpu", 16.0, 0, "torch", ""),)  # equal, and hashes alike
    with pytest.raises(ValueError):
        metadata.descriptor_from_rows(metadata.FORMAT, b"o" * 16, b"t" * 16, OWNER, loose, 16)
    (meta,) = metadata.descriptor_from_rows(metadata.FORMAT, b"o" * 16, b"t" * 16, OWNER, good, 16).metas
    assert type(meta.nbytes) is int and meta.kind is TensorKind.TORCH


def test_a_reference_from_another_format_is_refused_by_name():
    reduced = _descriptor(_metas(1)).__reduce__()
    assert reduced[1][0] == metadata.FORMAT
    with pytest.raises(ValueError, match="another tensorwire version: its descriptor format is 99"):
        reduced[0](99, *reduced[1][1:])


def test_dtype_and_device_names_are_made_once():
    assert metadata.dtype_name(torch.bfloat16) == "bfloat16" and metadata.dtype_name(torch.uint8) == "uint8"
    assert metadata.device("cpu") is metadata.device("cpu") and metadata.device("cuda:3") == torch.device("cuda:3")


def test_a_fetch_request_is_immutable_and_never_shows_its_token():
    from tensorwire.transport.contract import FetchRequest

    request = FetchRequest(b"o" * 16, b"t" * 16, OWNER, _metas(2), 128, None, 123.5)
    with pytest.raises(AttributeError):
        request.handle = b"handle"  # type: ignore[misc]
    assert request._replace(handle=b"h").handle == b"h" and request.handle is None
    assert "tttt" not in repr(request) and request.object_id.hex() in repr(request)
