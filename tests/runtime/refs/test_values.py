"""The value walker: structure kept, tensors slotted, bad input named by path."""

from __future__ import annotations

import collections
import dataclasses
import pickle
import threading
from typing import NamedTuple

import numpy as np
import pytest
import torch

from tensorwire.runtime.refs.values import Slot, dumps_skeleton, flatten, match_out, unflatten
from tensorwire.transport.contract import TensorKind


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str
    extra: list


class Pair(NamedTuple):
    left: torch.Tensor
    right: int


def test_round_trip_keeps_types_and_attributes():
    sd = collections.OrderedDict(a=torch.ones(2), b=torch.zeros(3))
    sd._metadata = {"": {"version": 1}}  # like nn.Module.state_dict()
    value = {"sd": sd, "batch": Batch(torch.arange(3), "y", [np.ones(2), 5]), "pair": Pair(torch.ones(1), 2)}
    skeleton, tensors, kinds = flatten(value)
    assert len(tensors) == 5 and [k is TensorKind.NUMPY for k in kinds] == [False, False, False, True, False]
    rebuilt = unflatten(pickle.loads(dumps_skeleton(skeleton)), tensors)
    assert type(rebuilt["sd"]) is collections.OrderedDict and rebuilt["sd"]._metadata == sd._metadata
    assert isinstance(rebuilt["batch"], Batch) and rebuilt["batch"].label == "y"
    assert isinstance(rebuilt["pair"], Pair) and rebuilt["pair"].right == 2
    assert value["sd"]["a"] is sd["a"]  # the input is not modified


def test_tied_tensor_is_one_slot():
    shared = torch.randn(4)
    skeleton, tensors, _ = flatten({"embed": shared, "head": shared})
    assert len(tensors) == 1
    rebuilt = unflatten(skeleton, tensors)
    assert rebuilt["embed"] is rebuilt["head"]


def test_noncontiguous_and_grad_tensors_are_made_plain():
    base = torch.randn(4, 5, requires_grad=True)
    _, tensors, _ = flatten([base.t(), torch.nn.Parameter(torch.ones(2))])
    assert all(t.is_contiguous() and not t.requires_grad for t in tensors)
    assert torch.equal(tensors[0], base.detach().t())


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ({"s": torch.eye(3).to_sparse()}, r"value\['s'\]: torch.sparse_coo tensors are not supported"),
        ([np.array(["a", "b"])], r"value\[0\]: numpy arrays of dtype <U1"),
        ([np.array([object()])], r"dtype object"),
        ({"m": torch.empty(3, device="meta")}, "meta device"),
    ],
)
def test_unsupported_tensors_are_named_by_path(value, pattern):
    with pytest.raises(TypeError, match=pattern):
        flatten(value)


def test_tensor_hidden_in_an_unwalked_container_is_refused():
    skeleton, _, _ = flatten({"s": {1, 2}, "obj": [frozenset([torch.ones(1).numpy().tobytes()])]})
    dumps_skeleton(skeleton)  # fine: no tensors inside
    with pytest.raises(TypeError, match="inside an object tensorwire does not walk"):
        dumps_skeleton(flatten({"box": _Box(torch.ones(2))})[0])


class _Box:
    def __init__(self, t):
        self.t = t


def test_unpicklable_leaf_is_a_type_error():
    with pytest.raises(TypeError, match="cannot be pickled"):
        dumps_skeleton(flatten({"lock": threading.Lock()})[0])


def test_cycle_is_a_value_error():
    cyclic: list = [torch.ones(1)]
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="reference cycle"):
        flatten(cyclic)


def test_match_out_by_structure():
    skeleton = {"a": Slot(0), "b": [Slot(1)]}
    a, b = torch.empty(1), torch.empty(2)
    assert match_out(skeleton, {"b": [b], "a": a}) == {0: a, 1: b}
    with pytest.raises(ValueError, match=r"out: missing key 'a'"):
        match_out(skeleton, {"b": [b]})
    with pytest.raises(ValueError, match=r"out\['b'\]: expected a sequence of length 1"):
        match_out(skeleton, {"a": a, "b": []})


def test_flat_lists_and_state_dicts_match_and_rebuild_like_any_value():
    """A plain list or dict of tensors takes a one-pass path; the answers and the errors are
    those of the full walk (the same slot twice keeps its first buffer)."""
    a, b, c = torch.empty(1), torch.empty(2), torch.empty(3)
    assert match_out([Slot(0), Slot(1), Slot(0)], (a, b, c)) == {0: a, 1: b}
    assert match_out({"x": Slot(1), "y": Slot(0)}, {"y": a, "x": b, "extra": c}) == {0: a, 1: b}
    with pytest.raises(ValueError, match=r"out: expected a sequence of length 2"):
        match_out([Slot(0), Slot(1)], [a])
    with pytest.raises(ValueError, match=r"out\[1\]: expected a tensor to receive into, got str"):
        match_out([Slot(0), Slot(1)], [a, "b"])
    with pytest.raises(ValueError, match=r"out: missing key 'y'"):
        match_out({"x": Slot(0), "y": Slot(1)}, {"x": a})
    assert unflatten([Slot(1), Slot(0)], [a, b]) == [b, a]
    rebuilt = unflatten({"x": Slot(1), "y": Slot(0)}, [a, b])
    assert type(rebuilt) is dict and list(rebuilt.items()) == [("x", b), ("y", a)]
    mixed = unflatten({"x": Slot(0), "n": 3}, [a])  # not only tensors: the full walk
    assert mixed == {"x": a, "n": 3}


class _DLPackOnly:
    """A producer that offers its data only through the DLPack protocol (like cupy or JAX)."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, **kwargs):
        return self._tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


def test_dlpack_producers_become_tensors_without_a_copy():
    base = torch.arange(12, dtype=torch.float32)
    _skeleton, tensors, kinds = flatten({"x": _DLPackOnly(base), "y": base})
    assert kinds == [TensorKind.DLPACK, TensorKind.TORCH]
    assert torch.equal(tensors[0], base) and tensors[0].data_ptr() == base.data_ptr()


def test_a_broken_dlpack_producer_is_a_clear_type_error():
    class Broken(_DLPackOnly):
        def __dlpack__(self, **kwargs):
            raise RuntimeError("device lost")

    with pytest.raises(TypeError, match=r"value\['x'\]: Broken could not be read through DLPack"):
        flatten({"x": Broken(torch.zeros(2))})


def test_a_lone_tensors_skeleton_is_pickled_once_and_loads_as_its_slot():
    from tensorwire.runtime.refs import values

    first = values.dumps_skeleton(values.Slot(0))
    assert values.dumps_skeleton(values.Slot(0)) is first  # reused, not pickled again
    loaded = pickle.loads(first)
    assert type(loaded) is values.Slot and loaded.index == 0
    assert pickle.loads(values.dumps_skeleton(values.Slot(3))).index == 3


def test_plain_lists_are_copied_whole_and_tensors_among_plain_items_still_found():
    ids = list(range(100_000))
    skeleton, tensors, _ = flatten({"ids": ids, "mixed": [1, "a", torch.ones(3), None], "tag": (1, b"x", 2.5, True)})
    assert skeleton["ids"] == ids and skeleton["ids"] is not ids  # a copy: later changes do not reach it
    ids.append(-1)
    assert len(skeleton["ids"]) == 100_000
    assert len(tensors) == 1 and isinstance(skeleton["mixed"][2], Slot) and skeleton["tag"] == (1, b"x", 2.5, True)
    loaded = pickle.loads(dumps_skeleton(skeleton))
    assert loaded["ids"] == list(range(100_000)) and loaded["mixed"][2].index == 0


def test_a_plain_skeleton_skips_the_hidden_tensor_pickler(monkeypatch):
    from tensorwire.runtime.refs import values

    class Refusing:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the checking pickler ran")

    monkeypatch.setattr(values, "_SkeletonPickler", Refusing)
    skeleton, _, _ = flatten({"ids": [1, 2, 3], "w": torch.ones(2), "meta": ("a", None)})
    assert pickle.loads(dumps_skeleton(skeleton))["ids"] == [1, 2, 3]
    with pytest.raises(TypeError, match="checking pickler ran"):
        dumps_skeleton(flatten({"odd": {1, 2}})[0])  # a set is not plain: it goes through the check


def test_a_plain_looking_value_with_an_object_in_it_is_still_checked_for_hidden_tensors():
    class Holder:
        def __init__(self) -> None:
            self.t = torch.ones(2)

    skeleton, _, _ = flatten({"ids": [1, 2, 3], "holder": [Holder()]})
    with pytest.raises(TypeError, match="does not walk"):
        dumps_skeleton(skeleton)
