"""put/get/free in one process and across processes: semantics and bad input."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import tensorwire as tw
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest


def test_same_process_get_returns_the_producer_tensors():
    value = {"w": torch.randn(10), "a": np.arange(4)}
    got = tw.get(tw.put(value))
    assert got["w"] is value["w"] or got["w"].data_ptr() == value["w"].data_ptr()
    assert isinstance(got["a"], np.ndarray) and np.shares_memory(got["a"], value["a"])


def test_ref_metadata_without_fetch():
    ref = tw.put(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert (ref.shape, ref.dtype, ref.device, ref.nbytes, ref.num_tensors) == ((3, 4), torch.bfloat16, "cpu", 24, 1)
    multi = tw.put({"a": torch.ones(2), "b": torch.ones(3, dtype=torch.int64)})
    assert multi.nbytes == 8 + 24 and [m.shape for m in multi.metas] == [(2,), (3,)]
    with pytest.raises(AttributeError, match="single tensor"):
        _ = multi.shape
    assert "tensors=2" in repr(multi) and multi.object_id not in repr(ref)


def test_ref_survives_pickle_and_cloudpickle():
    import cloudpickle

    value = {"x": torch.randn(5)}
    ref = tw.put(value)
    for dumps in (pickle.dumps, cloudpickle.dumps):
        copy = pickle.loads(dumps(ref))
        assert digest(tw.get(copy)) == digest(value)


def test_out_receives_in_place_across_processes(worker):
    value = {"w": torch.randn(64, 64), "b": torch.arange(10)}
    got_digest, same = worker.call("tests.helpers.tasks:get_into_out", tw.put(value["w"]))
    assert same and got_digest == digest(value["w"])


def test_out_mismatch_is_a_clear_value_error(worker):
    ref = tw.put({"w": torch.randn(4, 4)})
    with pytest.raises(ValueError, match=r"shape \(4, 5\) and dtype float32, the value has shape \(4, 4\)"):
        tw.get(ref, out={"w": torch.empty(4, 5)})
    with pytest.raises(ValueError, match="dtype float64"):
        tw.get(ref, out={"w": torch.empty(4, 4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="missing key 'w'"):
        tw.get(ref, out={"v": torch.empty(4, 4)})


def test_noncontiguous_out_is_filled():
    value = torch.randn(3, 4)
    out = torch.empty(4, 3).t()
    got = tw.get(tw.put(value), out=out)
    assert got is out and torch.equal(out, value)


def test_bad_arguments():
    with pytest.raises(TypeError, match="expects a Ref"):
        tw.get("not a ref")
    with pytest.raises(TypeError, match="expects a Ref"):
        tw.free(3)
    with pytest.raises(ValueError, match="did you mean 'host'"):
        tw.get(tw.put(torch.ones(1)), transport="hots")


def test_forced_by_environment(worker):
    """``TENSORWIRE_TRANSPORT`` in a consumer's environment forces its every fetch; the same
    fetch without it chooses shm on this node."""
    value = torch.arange(1 << 18, dtype=torch.int32)
    ref = tw.put(value)
    assert worker.call("tests.helpers.tasks:get_transport", ref) == (digest(value), "shm")
    forced = Worker(env={"TENSORWIRE_TRANSPORT": "host"})
    try:
        assert forced.call("tests.helpers.tasks:get_transport", ref) == (digest(value), "host")
    finally:
        forced.close()


def test_many_refs_fetched_together(worker):
    values = [torch.full((100_000,), i, dtype=torch.int32) for i in range(6)]
    refs = [tw.put(v) for v in values]
    digests = worker.call("tests.helpers.tasks:get_many_digests", refs)
    assert digests == [digest(v) for v in values]


def test_thousand_tensor_state_dict_is_one_transfer(worker):
    state = {f"layer{i}.weight": torch.randn(16) for i in range(1000)}
    ref = tw.put(state)
    got_digest, transfers = worker.call("tests.helpers.tasks:get_counting_transfers", ref, "host")
    assert got_digest == digest(state)
    assert transfers == 1


def test_shm_view_is_zero_copy_and_private(worker):
    value = torch.arange(1 << 20, dtype=torch.int32)
    ref = tw.put(value)
    result = worker.call("tests.helpers.tasks:view_and_write", ref)
    assert result == {"zero_copy": True, "first": 0, "after_write": -1, "again": 0}
    assert int(value[0]) == 0  # the producer never sees the consumer's write


def test_device_argument_places_on_cpu(worker):
    """``device="cpu"`` for a value of another process: its bytes, in fresh CPU memory."""
    ref, expected = worker.call("tests.helpers.tasks:put_and_return", 300_000, seed=8)
    got = tw.get(ref, device="cpu")
    assert digest(got) == expected and got.device == torch.device("cpu")
    again = tw.get(ref, device=torch.device("cpu"))
    assert digest(again) == expected and again.data_ptr() != got.data_ptr()


def test_dlpack_producer_arrives_as_a_torch_tensor_in_another_process(worker):
    ref, expected = worker.call("tests.helpers.tasks:put_dlpack", 100_000)
    value = tw.get(ref)
    assert isinstance(value["a"], torch.Tensor) and digest(value) == expected
