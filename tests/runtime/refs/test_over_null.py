"""The runtime with no real transport under it: every fetch forced through the test-only
``null`` transport (``over_null``), so what is checked here is the runtime's own work: values
and their structure, ``out=`` buffers, devices, views, freeing and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorwire as tw
from tests.helpers.tasks import digest


def test_nested_values_of_every_kind_arrive_whole(over_null):
    value = {
        "w": torch.randn(64, 32, generator=torch.Generator().manual_seed(1)),
        "ids": np.arange(12, dtype=np.int32).reshape(3, 4)[:, 1:],  # numpy, not contiguous
        "nested": [torch.tensor(2.5), (torch.empty(0, 3), "text", 7)],
        "half": torch.arange(10).to(torch.bfloat16),
    }
    got = tw.get(tw.put(value))
    assert digest(got) == digest(value)
    assert isinstance(got["ids"], np.ndarray) and got["nested"][1][1:] == ("text", 7)
    assert tw.stats()["recent"][-1].transport == "null"


def test_out_buffers_are_filled_in_place_even_when_not_contiguous(over_null):
    value = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5)}
    out_a = torch.zeros(4, 3).t()  # shape (3, 4), not contiguous
    out_b = torch.zeros(5, dtype=torch.int64)
    got = tw.get(tw.put(value), out={"a": out_a, "b": out_b})
    assert got["a"] is out_a and got["b"] is out_b
    assert torch.equal(out_a, value["a"]) and torch.equal(out_b, value["b"])
    with pytest.raises(ValueError, match="out buffer for tensor"):
        tw.get(tw.put(value), out={"a": torch.zeros(2, 2), "b": out_b})


def test_a_list_of_references_and_free(over_null):
    refs = [tw.put(torch.full((4,), float(i))) for i in range(5)]
    got = tw.get(refs)
    assert [int(t[0]) for t in got] == list(range(5))
    tw.free(refs[0])
    with pytest.raises(tw.ObjectFreedError):
        tw.get(refs[0])
    assert torch.equal(tw.get(refs[1], device="cpu"), torch.full((4,), 1.0))


def test_wait_tensor_freed_over_null(over_null):
    tensor = torch.ones(16)
    ref = tw.put(tensor)
    with pytest.raises(tw.TransferTimeoutError, match="still referenced"):
        tw.wait_tensor_freed(tensor, timeout_s=0.05)
    del ref
    tw.wait_tensor_freed(tensor, timeout_s=10)
