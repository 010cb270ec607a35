"""Runtime pieces of the Ray-native work that need no Ray: an inline value back in its
producer after the producer let it go, references used as values, transport names, pytree
containers, wait_tensor_freed."""

from __future__ import annotations

import gc
import pickle
import threading

import pytest
import torch
from torch.utils import _pytree

import tensorwire as tw
from tensorwire.runtime.ray.handles import check_transport
from tensorwire.runtime.refs import values
from tensorwire.runtime.refs.ref import Ref
from tensorwire.transport.agent.core import get_agent


class Pair:
    def __init__(self, left, right) -> None:
        self.left, self.right = left, right


_pytree.register_pytree_node(Pair, lambda p: ([p.left, p.right], None), lambda ch, _ctx: Pair(*ch))


def test_inline_value_back_in_its_producer_after_it_let_go():
    ref = tw.put(torch.arange(10, dtype=torch.int32))  # 40 bytes: travels inline
    state = pickle.loads(pickle.dumps(ref)).state  # as a copy that left and came back carries it
    assert "inline" in state.handles
    del ref
    gc.collect()
    get_agent().flush()
    back = Ref(state._replace(pin_id=b""))
    assert torch.equal(tw.get(back), torch.arange(10, dtype=torch.int32))  # not ObjectFreedError
    assert back.transport == "inline"


def test_a_reference_used_as_its_value_names_tw_get():
    ref = tw.put({"w": torch.ones(3)})
    for misuse in (lambda: ref.values(), lambda: ref["w"], lambda: list(ref), lambda: len(ref)):  # noqa: PLW0108
        with pytest.raises(tw.UnresolvedRefError, match=r"tw\.get"):
            misuse()
    assert bool(ref) and not hasattr(ref, "keys")  # hasattr stays quiet (also an AttributeError)
    with pytest.raises(AttributeError, match="single tensor"):
        _ = ref.shape  # a property's own error is kept


def test_transport_names_are_checked_when_given():
    assert check_transport("SHM", "x") == "shm"
    assert check_transport("auto", "x") == check_transport("tensorwire", "x") == ""
    assert check_transport("OBJECT_STORE", "x") is None
    with pytest.raises(ValueError, match=r"'mooncake' is not a tensorwire transport; available: .*shm"):
        check_transport("mooncake", "x")
    with pytest.raises(TypeError):
        check_transport(3, "x")
    with pytest.raises(ValueError, match="not a tensorwire transport"):
        tw.method(transport="gloo2")


def test_pytree_containers_walk_and_come_back_as_their_type():
    value = {"p": Pair(torch.arange(3), [torch.ones(2), "x"]), "n": 1}
    skeleton, tensors, _ = values.flatten(value)
    assert len(tensors) == 2
    back = values.unflatten(pickle.loads(values.dumps_skeleton(skeleton)), tensors)
    assert isinstance(back["p"], Pair) and torch.equal(back["p"].left, torch.arange(3)) and back["p"].right[1] == "x"
    got = tw.get(tw.put(value))
    assert isinstance(got["p"], Pair) and torch.equal(got["p"].right[0], torch.ones(2))


def test_tensordict_walks():
    tensordict = pytest.importorskip("tensordict", reason="tensordict is not installed")
    td = tensordict.TensorDict({"a": torch.randn(2, 3), "b": {"c": torch.zeros(2)}}, batch_size=[2])
    got = tw.get(tw.put([td]))[0]
    assert type(got) is type(td) and torch.equal(got["a"], td["a"]) and got.batch_size == td.batch_size


def test_wait_tensor_freed_in_the_producer():
    tensor = torch.ones(1 << 18)
    ref = tw.put({"w": tensor})
    with pytest.raises(tw.TransferTimeoutError, match="still referenced"):
        tw.wait_tensor_freed(tensor, timeout_s=0.2)
    done = threading.Event()

    def waiter() -> None:
        tw.wait_tensor_freed(tensor, timeout_s=60)
        done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    del ref
    gc.collect()
    thread.join(timeout=90)
    assert done.is_set()
    tw.wait_tensor_freed(torch.ones(2), timeout_s=1)  # never published: returns at once
    with pytest.raises(TypeError, match="tensor"):
        tw.wait_tensor_freed("nothing", timeout_s=1)
