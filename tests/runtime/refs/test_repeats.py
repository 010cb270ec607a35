"""``tw.get(ref, out=buffers)`` again into the same buffers: the fetch is made again without
working it out again (:mod:`tensorwire.runtime.refs.repeats`), and reads the bytes as they are now.
Anything that differs from the first fetch (other buffers, a buffer changed in place, other
options, a failed transport, the object freed) goes the ordinary way, with its checks and errors.

In this process over the test-only ``null`` transport (``over_null``); between processes over
shm (same node, the direct read's ``repeater``) and over nixl across claimed nodes."""

from __future__ import annotations

import importlib.util
import pickle
import threading
import time

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.errors import TransferTimeoutError, TransportError
from tensorwire.transport import register_transport, unregister_transport
from tensorwire.transport.backends.null import NullTransport
from tensorwire.transport.backends.shm import cma
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest

T = "tests.helpers.tasks"


def _last() -> tuple[str, bool]:
    """The last fetch's transport and whether it was a repeat."""
    record = tw.stats()["recent"][-1]
    return record.transport, record.repeated


def _count(transport: str) -> int:
    return tw.stats()["transfers"].get(transport, {}).get("count", 0)


def _kept_to_repeat(value: torch.Tensor) -> tuple[tw.Ref, list[torch.Tensor]]:
    """A reference to ``[value]`` and buffers it was fetched into twice: the next fetch repeats."""
    ref = tw.put([value])
    out = [torch.zeros_like(value)]
    tw.get(ref, out=out)
    tw.get(ref, out=out)
    return ref, out


def test_the_same_buffers_again_are_filled_by_a_repeat_with_the_bytes_as_they_are_now(over_null):
    value = [torch.arange(10.0), torch.arange(4, dtype=torch.int32)]
    ref = tw.put(value)
    out = [torch.zeros(10), torch.zeros(4, dtype=torch.int32)]
    tw.get(ref, out=out)  # the first fetch into these buffers marks them; the second keeps it
    got = tw.get(ref, out=out)
    assert got[0] is out[0] and got[1] is out[1] and _last() == ("null", False)
    counted = _count("null")
    for step in range(1, 4):
        value[0].add_(1)
        value[1].mul_(2)
        got = tw.get(ref, out=out)
        assert got[0] is out[0] and got[1] is out[1] and got is not out  # a new list, like an ordinary fetch
        assert torch.equal(out[0], torch.arange(10.0) + step) and torch.equal(out[1], torch.arange(4) * 2**step)
        assert _last() == ("null", True)
    assert _count("null") == counted + 3  # every repeat is recorded
    assert ref.transport == "null"


def test_new_buffers_every_time_are_never_kept_to_repeat(over_null):
    from tensorwire.runtime.refs.repeats import Remembered

    value = torch.arange(10.0)
    ref = tw.put([value])
    for step in range(4):
        value.fill_(step)
        out = [torch.zeros(10)]
        tw.get(ref, out=out)
        assert torch.equal(out[0], value) and _last() == ("null", False)
        assert not isinstance(ref.remembered, Remembered)  # only the first buffer's mark: nothing made
    tw.get(ref, out=out)  # the second fetch into the last buffers keeps it
    assert isinstance(ref.remembered, Remembered)


def test_a_new_reference_to_the_same_object_repeats_and_another_object_does_not(over_null):
    """Repeats are kept per object: a reference unpickled anew (from a message) into the same
    buffers is a repeat; another object into those buffers is not."""
    value = torch.arange(10.0)
    ref = tw.put([value])
    blob = pickle.dumps(ref)
    out = [torch.zeros(10)]
    tw.get(pickle.loads(blob), out=out)
    tw.get(pickle.loads(blob), out=out)  # a second reference, the same buffers: kept
    for step in (1, 2, 3):
        value.fill_(step)
        anew = pickle.loads(blob)
        assert tw.get(anew, out=out)[0] is out[0] and torch.equal(out[0], value)
        assert _last() == ("null", True) and anew.transport == "null"
    other = tw.put([torch.full((10,), 7.0)])
    tw.get(other, out=out)
    assert torch.equal(out[0], torch.full((10,), 7.0)) and _last() == ("null", False)


def test_a_tensor_and_a_dict_of_tensors_are_repeated_and_a_dict_in_another_order_is_not(over_null):
    single = torch.arange(6.0)
    ref = tw.put(single)
    out = torch.zeros(6)
    tw.get(ref, out=out)
    assert tw.get(ref, out=out) is out
    single.fill_(3)
    assert tw.get(ref, out=out) is out and torch.equal(out, single) and _last() == ("null", True)

    state = {"a": torch.arange(3.0), "b": torch.arange(5.0)}
    ref = tw.put(state)
    a, b = torch.zeros(3), torch.zeros(5)
    tw.get(ref, out={"a": a, "b": b})
    tw.get(ref, out={"a": a, "b": b})
    state["a"].fill_(7)
    got = tw.get(ref, out={"a": a, "b": b})  # another dict, the same keys and buffers
    assert got["a"] is a and torch.equal(a, state["a"]) and _last() == ("null", True)
    state["b"].fill_(8)
    got = tw.get(ref, out={"b": b, "a": a})  # keys in another order: matched the ordinary way
    assert got["b"] is b and torch.equal(b, state["b"]) and _last() == ("null", False)


def test_out_in_another_order_or_with_a_buffer_more_is_repeated_each_tensor_into_its_own(over_null):
    state = {"a": torch.arange(3.0), "b": torch.arange(5.0)}
    ref = tw.put(state)
    a, b, extra = torch.zeros(3), torch.zeros(5), torch.full((2,), -1.0)
    for out in ({"b": b, "a": a}, {"a": a, "extra": extra, "b": b}):
        tw.get(ref, out=out)
        tw.get(ref, out=out)  # the second fetch into these buffers: kept
        for step in (1, 2):
            state["a"].fill_(step)
            state["b"].fill_(10 * step)
            got = tw.get(ref, out=out)
            assert _last() == ("null", True) and set(got) == {"a", "b"}
            assert got["a"] is a and got["b"] is b and torch.equal(a, state["a"]) and torch.equal(b, state["b"])
    assert torch.equal(extra, torch.full((2,), -1.0))  # not the value's: untouched


def test_a_repeat_records_the_first_fetch_with_its_own_duration(over_null):
    ref, out = _kept_to_repeat(torch.arange(16.0))
    first = tw.stats()["recent"][-1]
    tw.get(ref, out=out)
    again = tw.stats()["recent"][-1]
    assert again.repeated and not first.repeated
    same = ("transport", "reason", "nbytes", "src", "dst")
    assert [getattr(again, f) for f in same] == [getattr(first, f) for f in same]
    assert again.nbytes == 64 and again.duration_s > 0
    assert (again.zero_copy, again.failed_attempts, again.placed_s) == (False, 0, 0.0)


def test_other_buffers_or_options_go_the_ordinary_way_then_are_repeated_in_turn(over_null):
    value = torch.arange(8.0)
    ref = tw.put([value])
    first, second = [torch.zeros(8)], [torch.zeros(8)]
    tw.get(ref, out=first)
    tw.get(ref, out=second)
    assert torch.equal(second[0], value) and _last() == ("null", False)
    tw.get(ref, out=second)  # the second fetch into these buffers: kept
    assert _last() == ("null", False)
    value.add_(1)
    tw.get(ref, out=second)
    assert torch.equal(second[0], value) and _last() == ("null", True)
    tw.get(ref, out=second, device="cpu")  # another option: the ordinary way
    assert _last() == ("null", False)
    tw.get(ref, out=[second[0]])  # a new list around the same buffer is the same buffers
    assert _last() == ("null", False)  # (options were device="cpu" last time)
    tw.get(ref, out=[second[0]])
    assert _last() == ("null", True)


def test_a_tuple_of_buffers_is_repeated_and_another_tensor_on_the_same_memory_is_not(over_null):
    value = [torch.arange(6.0), torch.arange(3.0)]
    ref = tw.put(value)
    a, b = torch.zeros(6), torch.zeros(3)
    tw.get(ref, out=(a, b))
    tw.get(ref, out=(a, b))
    value[0].fill_(5)
    tw.get(ref, out=(a, b))
    assert torch.equal(a, value[0]) and _last() == ("null", True)
    again_a = a.view(6)  # another tensor object over the same memory: checked the ordinary way
    value[0].fill_(6)
    got = tw.get(ref, out=(again_a, b))
    assert got[0] is again_a and torch.equal(a, value[0]) and _last() == ("null", False)


def test_a_transposed_buffer_and_new_settings_go_the_ordinary_way(over_null, agent):
    from dataclasses import replace

    value = torch.arange(16.0).reshape(4, 4)
    ref = tw.put([value])
    out = [torch.zeros(4, 4)]
    tw.get(ref, out=out)
    out[0].t_()  # the same object, memory and shape, but no longer contiguous
    value.add_(1)
    tw.get(ref, out=out)
    assert torch.equal(out[0], value) and _last() == ("null", False)  # filled as a transposed buffer is
    tw.get(ref, out=out)
    agent.set_config(replace(agent.config, timeout_s=30.0))  # settings changed since: worked out again
    tw.get(ref, out=out)
    assert _last() == ("null", False)
    tw.get(ref, out=out, transport="null")  # another option (the same transport, named)
    assert _last() == ("null", False)


def test_a_repeat_has_the_time_limit_of_its_own_call(over_null, monkeypatch):
    ref = tw.put([torch.arange(5.0)])
    out = [torch.zeros(5)]
    tw.get(ref, out=out, timeout_s=0.5)
    tw.get(ref, out=out, timeout_s=0.5)  # kept by a fetch with a short limit
    left = []
    real = NullTransport.fetch

    def timed(self, request, dst):
        left.append(request.deadline - time.monotonic())
        return real(self, request, dst)

    monkeypatch.setattr(NullTransport, "fetch", timed)
    tw.get(ref, out=out)  # the default limit (60 s here), not the first call's
    tw.get(ref, out=out, timeout_s=2.0)
    assert _last() == ("null", True) and len(left) == 2
    assert left[0] > 10 and 0 < left[1] <= 2.0


def test_threads_repeating_one_reference_into_their_own_buffers_each_get_theirs(over_null):
    value = torch.arange(1000.0)
    ref = tw.put([value])
    wrong = []

    def loop(seed: int) -> None:
        out = [torch.full((1000,), float(seed))]
        for _ in range(200):
            got = tw.get(ref, out=out)
            if got[0] is not out[0] or not torch.equal(out[0], value):
                wrong.append(seed)
            out[0].fill_(-1)

    threads = [threading.Thread(target=loop, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and wrong == []


def test_a_buffer_changed_in_place_is_checked_again(over_null):
    value = torch.arange(8.0)
    ref = tw.put([value])
    out = [torch.zeros(8)]
    tw.get(ref, out=out)
    out[0].set_(torch.zeros(8).untyped_storage())  # new memory under the same tensor object
    value.add_(2)
    tw.get(ref, out=out)
    assert torch.equal(out[0], value) and _last() == ("null", False)
    out[0].resize_(9)  # the same object, another shape: refused, as the first time would
    with pytest.raises(ValueError, match="out buffer for tensor"):
        tw.get(ref, out=out)


def test_views_and_converted_buffers_are_never_repeated(over_null):
    value = np.arange(6, dtype=np.float32)
    ref = tw.put([value])
    out = [np.zeros(6, dtype=np.float32)]  # converted to a torch tensor on each fetch
    tw.get(ref, out=out)
    tw.get(ref, out=out)
    assert np.array_equal(out[0], value) and _last() == ("null", False)
    torch_ref = tw.put([torch.arange(4.0)])
    buffers = [torch.zeros(4)]
    tw.get(torch_ref, out=buffers)
    tw.get(torch_ref, out=buffers, view=True)  # a view asked for, into buffers: the ordinary way
    assert _last() == ("null", False)


def test_a_freed_object_is_an_error_not_the_last_bytes(over_null):
    ref = tw.put([torch.arange(5.0)])
    out = [torch.zeros(5)]
    tw.get(ref, out=out)
    tw.get(ref, out=out)
    tw.get(ref, out=out)
    assert _last() == ("null", True)
    tw.free(ref)
    with pytest.raises(tw.ObjectFreedError):
        tw.get(ref, out=out)


def test_a_repeat_whose_transport_fails_hands_over_to_the_ordinary_fetch(over_null, monkeypatch):
    value = torch.arange(5.0)
    ref = tw.put([value])
    out = [torch.zeros(5)]
    tw.get(ref, out=out)
    tw.get(ref, out=out)
    calls = []
    real = NullTransport.fetch

    def fails_once(self, request, dst):
        calls.append(request.deadline)
        if len(calls) == 1:
            time.sleep(0.3)
            raise TransportError("null: made to fail once")
        return real(self, request, dst)

    monkeypatch.setattr(NullTransport, "fetch", fails_once)
    value.fill_(4)
    tw.get(ref, out=out)
    assert len(calls) == 2 and torch.equal(out[0], value) and _last() == ("null", False)
    assert calls[1] <= calls[0] + 0.05  # the ordinary fetch had the time the repeat left, not a new limit


def test_a_plug_ins_repeater_that_fails_leaves_the_repeat_to_fetch(over_null, monkeypatch):
    def broken(self, request, dst):
        raise RuntimeError("a plug-in's repeater, broken")

    def raising(deadline):
        raise RuntimeError("a plug-in's repeated read, broken")

    value = torch.arange(5.0)
    for repeater in (broken, lambda self, request, dst: raising):  # making it fails; running it fails
        monkeypatch.setattr(NullTransport, "repeater", repeater)
        ref = tw.put([value])
        out = [torch.zeros(5)]
        tw.get(ref, out=out)
        tw.get(ref, out=out)
        value.add_(1)
        tw.get(ref, out=out)
        assert torch.equal(out[0], value) and _last() == ("null", True)


def test_a_repeat_that_failed_with_no_time_left_is_a_timeout_naming_the_limit(over_null, monkeypatch):
    ref, out = _kept_to_repeat(torch.arange(5.0))
    calls = []

    def slow_failure(self, request, dst):
        calls.append(request)
        time.sleep(0.3)
        raise TransportError("null: made to fail slowly")

    monkeypatch.setattr(NullTransport, "fetch", slow_failure)
    with pytest.raises(TransferTimeoutError, match=r"not done before its deadline \(0.2 s\)"):
        tw.get(ref, out=out, timeout_s=0.2)
    assert len(calls) == 1  # the ordinary fetch did not start with a new limit


def test_a_repeat_past_its_deadline_raises_and_starts_no_other_fetch(over_null, monkeypatch):
    ref, out = _kept_to_repeat(torch.arange(5.0))
    calls = []

    def times_out(self, request, dst):
        calls.append(request)
        raise TransferTimeoutError("null: made to time out")

    monkeypatch.setattr(NullTransport, "fetch", times_out)
    with pytest.raises(TransferTimeoutError, match="made to time out"):
        tw.get(ref, out=out, timeout_s=5)
    assert len(calls) == 1  # no second fetch into buffers a transfer may still be writing


def test_a_transport_registered_meanwhile_makes_the_next_fetch_ordinary(over_null):
    ref = tw.put([torch.arange(5.0)])
    out = [torch.zeros(5)]
    tw.get(ref, out=out)
    register_transport("null_extra", NullTransport)
    try:
        tw.get(ref, out=out)
        assert _last() == ("null", False)
        tw.get(ref, out=out)
        assert _last() == ("null", True)
    finally:
        unregister_transport("null_extra")


@pytest.mark.skipif(cma.unavailable_reason() is not None, reason=f"no direct reads here: {cma.unavailable_reason()}")
def test_the_same_buffers_again_over_shm_read_the_bytes_as_they_are_now(agent, worker):
    value = torch.full((1 << 16,), 3, dtype=torch.uint8)  # larger than an inline value
    ref = tw.put([value])
    blob = pickle.dumps(ref)
    assert worker.call(f"{T}:get_into_kept_out", "again", pickle.loads(blob)) == (digest([value]), "shm", False)
    assert worker.call(f"{T}:get_into_kept_out", "again") == (digest([value]), "shm", False)  # remembered now
    worker.call(f"{T}:refuse_shm_fetches")  # from now on only the repeat's own read can serve
    for fill in (9, 11):
        value.fill_(fill)
        assert worker.call(f"{T}:get_into_kept_out", "again") == (digest([value]), "shm", True)
    value.fill_(13)  # a reference received anew (unpickled in the worker) repeats as well
    assert worker.call(f"{T}:get_anew_into_kept_out", "again", blob) == (digest([value]), "shm", True)
    tw.free(ref)  # the repeat's read sees the live word cleared; the ordinary way names the error
    assert worker.call(f"{T}:get_into_kept_out", "again") == ("ObjectFreedError", "", False)
    worker.call(f"{T}:refuse_shm_fetches", False)


NIXL = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13"))


@pytest.mark.skipif(not NIXL, reason="NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)")
@pytest.mark.parametrize("nbytes", [4096, 1 << 20], ids=["4KiB-packed", "1MiB"])
def test_the_same_buffers_again_across_nodes_over_nixl(nbytes):
    tcp = {"UCX_TLS": "tcp,self", "OMP_NUM_THREADS": "1", "TENSORWIRE_INLINE_NBYTES": "0"}  # 4 KiB not inline
    producer = Worker(env={**tcp, "TENSORWIRE_NODE_ID": "repeat-a"})
    consumer = Worker(env={**tcp, "TENSORWIRE_NODE_ID": "repeat-b"})
    try:
        ref = producer.call("tests.helpers.nixl_tasks:put_kept", "again", nbytes, 5)
        first = producer.call("tests.helpers.nixl_tasks:kept_digest", "again")
        assert consumer.call(f"{T}:get_into_kept_out", "again", ref, transport="nixl") == (first, "nixl", False)
        assert consumer.call(f"{T}:get_into_kept_out", "again", transport="nixl") == (first, "nixl", False)
        for fill in (1, 2):
            now = producer.call("tests.helpers.nixl_tasks:fill_kept", "again", fill)
            ordinary = consumer.call(f"{T}:get_digest", ref, transport="nixl")  # into new buffers
            assert ordinary == (first if nbytes <= 4096 else now)  # a small object is packed as it was exported
            assert consumer.call(f"{T}:get_into_kept_out", "again", transport="nixl") == (ordinary, "nixl", True)
        # a reference received anew, in a message of its own each time: still a repeat
        got = consumer.call(f"{T}:get_anew_into_kept_out", "again", pickle.dumps(ref), transport="nixl")
        assert got == (ordinary, "nixl", True)
        producer.call("tests.helpers.nixl_tasks:free_kept_refs")
        assert consumer.call(f"{T}:get_into_kept_out", "again", transport="nixl") == ("ObjectFreedError", "", False)
    finally:
        producer.close()
        consumer.close()
