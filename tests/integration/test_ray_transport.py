"""tensorwire as a registered Ray tensor transport: ``@ray.method(tensor_transport="tensorwire")``
on plain Ray actors, with Ray's own API (``ray.get``, ``ray.wait``, ``ray.put``, passing
references to actors), checked by the data that arrives and by what the producer keeps."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import ray
import torch

import tensorwire as tw
from tests.helpers.observe import wait_until
from tests.integration.ray_transport_actors import Consumer, Producer, checksum, state_dict


@pytest.fixture(scope="module")
def producer(ray_local):
    return Producer.remote()


@pytest.fixture(scope="module")
def consumers(ray_local):
    return [Consumer.remote() for _ in range(3)]


def _expected_tensor(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("numel", [8, 300_000])  # inline-sized, and read from the producer's memory
def test_tensor_actor_to_actor_and_to_the_driver(producer, consumers, numel):
    ref = producer.tensor.remote(numel, seed=numel)
    expected = _expected_tensor(numel, seed=numel)
    assert ray.get(consumers[0].checksum.remote(ref), timeout=60) == pytest.approx(checksum(expected))
    assert torch.equal(ray.get(ref, timeout=60), expected)


def test_nested_values_keep_their_structure_and_non_tensor_parts(producer):
    value = ray.get(producer.nested.remote(1000), timeout=60)
    assert torch.equal(value["w"], torch.ones(1000))
    assert torch.equal(value["parts"][0], torch.arange(4.0)) and value["parts"][1:] == ["tag", 7]
    assert isinstance(value["pair"], tuple) and torch.equal(value["pair"][0], torch.full((2,), 3.0))


def test_thousand_tensor_state_dict_actor_to_actor(producer, consumers):
    ref = producer.state_dict.remote(1024)
    assert ray.get(consumers[1].checksum.remote(ref), timeout=120) == pytest.approx(checksum(state_dict(1024)))
    got = ray.get(ref, timeout=120)
    assert list(got) == list(state_dict(1024)) and all(torch.equal(got[k], v) for k, v in state_dict(1024).items())


def test_one_reference_many_readers(producer, consumers):
    ref = producer.tensor.remote(200_000, seed=3)
    expected = checksum(_expected_tensor(200_000, seed=3))
    sums = ray.get([c.checksum.remote(ref) for c in consumers] + [consumers[0].checksum.remote(ref)], timeout=60)
    assert sums == [pytest.approx(expected)] * 4
    assert checksum(ray.get(ref, timeout=60)) == pytest.approx(expected)


def test_ray_get_inside_another_actor_of_nested_references(producer, consumers):
    """Nested references are lent to the reader, which calls ``ray.get``. (Ray lends a nested
    reference only once its owner holds its metadata: references made by ``ray.put``, Ray #59644.)"""
    in_actor = ray.get(producer.put_tensor.remote(50_000), timeout=60)
    refs = [*in_actor, ray.put(torch.ones(30), _tensor_transport="tensorwire")]
    assert ray.get(consumers[2].checksum_of_nested_refs.remote(refs), timeout=60) == pytest.approx(200_030.0)


def test_the_reader_records_which_transport_moved_it_and_why(producer, consumers):
    ray.get(consumers[0].checksum.remote(producer.tensor.remote(300_000)), timeout=60)
    transport, reason = ray.get(consumers[0].recent_transports.remote(1), timeout=60)[0]
    assert transport in tw.stats()["transports_usable"] and reason
    assert "same node" in reason  # one machine: the selector saw the two processes share it


def test_ray_wait_and_per_call_tensor_transport(producer, consumers):
    ref = producer.plain.options(tensor_transport="tensorwire").remote(100_000)
    ready, not_ready = ray.wait([ref], timeout=60)
    assert ready == [ref] and not not_ready
    assert ray.get(consumers[0].checksum.remote(ref), timeout=60) == pytest.approx(200_000.0)
    plain = producer.plain.remote(10)  # without the option: Ray's object store, as before
    assert torch.equal(ray.get(plain, timeout=60), torch.full((10,), 2.0))


def test_ray_put_with_the_tensorwire_transport(producer, consumers):
    [in_actor] = ray.get(producer.put_tensor.remote(70_000), timeout=60)
    assert torch.equal(ray.get(in_actor, timeout=60), torch.full((70_000,), 4.0))
    assert ray.get(consumers[1].checksum.remote(in_actor), timeout=60) == pytest.approx(280_000.0)
    in_driver = ray.put(torch.full((90_000,), 5.0), _tensor_transport="tensorwire")
    assert ray.get(consumers[1].checksum.remote(in_driver), timeout=60) == pytest.approx(450_000.0)


def test_a_value_without_tensors_travels_through_ray_with_a_warning(producer, monkeypatch):
    assert ray.get(producer.number.remote(), timeout=60) == 5
    from tensorwire.runtime.ray import transport as ray_transport

    monkeypatch.setattr(ray_transport, "_warned_no_tensors", False)
    with pytest.warns(UserWarning, match="drop tensor_transport"):  # (in the producer, as here)
        metadata = ray_transport.TensorwireTransport().extract_tensor_transport_metadata("obj-none", [])
    assert metadata.tensor_meta == [] and metadata.state == b""


def test_a_tensor_on_an_unsupported_device_names_the_fix(producer):
    with pytest.raises(ray.exceptions.RayTaskError, match=r"\.to\('cpu'\)"):
        ray.get(producer.on_meta_device.remote(), timeout=60)


def test_an_unknown_transport_name_is_refused(producer):
    with pytest.raises(ValueError, match="TENSORWIREX"):
        producer.plain.options(tensor_transport="tensorwirex")


def test_wait_tensor_freed_and_gc_release_the_producers_object(producer, consumers):
    before = ray.get(producer.resources.remote(), timeout=60)
    ref = producer.kept_tensor.remote()
    assert ray.get(consumers[0].checksum.remote(ref), timeout=60) == pytest.approx(499_500.0)
    assert ray.get(producer.resources.remote(), timeout=60)["published"] == before["published"] + 1
    freed = producer.wait_kept_freed.remote(60)
    del ref
    gc.collect()
    assert ray.get(freed, timeout=90) is True
    assert wait_until(
        lambda: ray.get(producer.resources.remote(), timeout=60)["published"] == before["published"], timeout_s=60
    )


def test_a_thousand_cycles_leak_nothing(producer, consumers):
    """Objects, bytes, registrations and file descriptors of the producer come back to where
    they were after 1,000 produce/consume cycles (Ray frees asynchronously: bounded wait)."""
    for numel in (16, 100_000):  # warm-up: the transports' one-time connections and segments
        ray.get(consumers[0].checksum.remote(producer.tensor.remote(numel)), timeout=60)
    gc.collect()
    baseline = ray.get(producer.resources.remote(), timeout=60)
    reader_baseline = ray.get(consumers[0].resources.remote(), timeout=60)
    for cycle in range(1000):
        numel = 100_000 if cycle % 10 == 0 else 16  # mostly small; every tenth one by reference
        ray.get(consumers[0].checksum.remote(producer.tensor.remote(numel, seed=cycle)), timeout=60)
    gc.collect()

    def settled() -> bool:
        now = ray.get(producer.resources.remote(), timeout=60)
        return now["published"] == 0 and now["objects"] <= baseline["objects"] and now["fds"] <= baseline["fds"] + 2

    assert wait_until(settled, timeout_s=120), ray.get(producer.resources.remote(), timeout=60)
    reader = ray.get(consumers[0].resources.remote(), timeout=60)
    assert reader["objects"] <= reader_baseline["objects"] and reader["fds"] <= reader_baseline["fds"] + 2


def test_a_dead_producer_raises_in_the_reader_not_a_hang(ray_local, consumers):
    victim = Producer.remote()
    pid = ray.get(victim.pid.remote(), timeout=60)
    ref = victim.tensor.remote(200_000)
    assert ray.wait([ref], timeout=60)[0] == [ref]  # produced and published (not read here)
    ray.kill(victim)
    assert wait_until(lambda: not _alive(pid), timeout_s=60)  # gone (ray.kill does not wait)
    with pytest.raises(tw.OwnerDiedError, match="has exited"):
        ray.get(ref, timeout=120)
    with pytest.raises(tw.OwnerDiedError, match="has exited"):  # Ray's task error, also tensorwire's
        ray.get(consumers[2].checksum.remote(ref), timeout=120)
    # as Ray's own transports raise it: code that catches Ray's ActorDiedError catches ours
    with pytest.raises(ray.exceptions.ActorDiedError, match="has exited") as in_driver:
        ray.get(ref, timeout=120)
    with pytest.raises(ray.exceptions.ActorDiedError, match="has exited") as in_task:
        ray.get(consumers[2].checksum.remote(ref), timeout=120)
    assert isinstance(in_task.value, ray.exceptions.RayTaskError)  # the consumer's call failed
    assert not isinstance(in_driver.value, ray.exceptions.RayTaskError)
    assert ray.get(consumers[2].checksum.remote(torch.ones(3)), timeout=60) == 3.0  # the reader lives on


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_aborts_before_and_during_a_read(monkeypatch):
    """An abort for a read not yet started fails that read once; an abort that comes while a
    read runs drops its result; an unfinished ``ray.get`` read honours its timeout."""
    import concurrent.futures

    from tensorwire.runtime.ray import transport as ray_transport
    from tensorwire.runtime.refs import placement

    manager = ray_transport.TensorwireTransport()
    metadata = manager.extract_tensor_transport_metadata("obj-abort", [torch.arange(100_000.0)])
    try:
        manager.abort_transport("obj-abort", manager.get_communicator_metadata(None, None))
        with pytest.raises(tw.TransferAbortedError, match="aborted"):
            manager.recv_multiple_tensors("obj-abort", metadata, None)
        [fine] = manager.recv_multiple_tensors("obj-abort", metadata, None)  # the mark is spent
        assert torch.equal(fine, torch.arange(100_000.0))

        targets = placement.targets

        def aborted_meanwhile(metas, device):  # runs inside the read, before its bytes move
            manager.abort_transport("obj-abort", None)
            return targets(metas, device)

        monkeypatch.setattr(placement, "targets", aborted_meanwhile)
        with pytest.raises(tw.TransferAbortedError):
            manager.recv_multiple_tensors("obj-abort", metadata, None)
    finally:
        manager.garbage_collect("obj-abort", metadata, [])
    never = ray_transport.TensorwireFetch(obj_id="obj-never", tensors=[], future=concurrent.futures.Future())
    with pytest.raises(TimeoutError, match="obj-never"):
        manager.wait_fetch_complete(never, timeout=0.05)


def test_tw_get_of_a_registered_transport_reference(producer):
    """``tw.get`` takes ``out=`` and ``device=`` through Ray's target APIs and ``transport=`` to
    the registered transport's read, and refuses what Ray's reads do not take."""
    ref = producer.tensor.remote(50_000, seed=4)
    buffer = torch.zeros(50_000)
    got = tw.get(ref, out=buffer, timeout_s=60)
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer, _expected_tensor(50_000, seed=4))
    assert torch.equal(tw.get(producer.tensor.remote(10, seed=5), device="cpu", timeout_s=60), _expected_tensor(10, 5))
    again = tw.get(ref, timeout_s=60)  # out= was that read's only: Ray's targets are not left set
    assert again.data_ptr() != buffer.data_ptr() and torch.equal(again, _expected_tensor(50_000, seed=4))
    assert torch.equal(tw.get(ref, transport="host", timeout_s=60), _expected_tensor(50_000, seed=4))
    assert tw.stats()["recent"][-1].transport == "host"  # not the selector's shm
    assert torch.equal(tw.get(ref, timeout_s=60), _expected_tensor(50_000, seed=4))
    assert tw.stats()["recent"][-1].transport == "shm"  # the option was this read's only
    with pytest.raises(ValueError, match="view="):
        tw.get(ref, view=True)
    with pytest.raises(ValueError, match="list of tensors"):
        tw.get(ref, out={"w": buffer})


def test_import_registers_and_actors_made_before_registration_get_it(tmp_path):
    """In a fresh driver: ``import ray`` then ``import tensorwire`` registers the name (the
    decorator accepts it); a producer and a reader created before the registration are given
    the transport on their first use of it."""
    script = tmp_path / "late.py"
    script.write_text(
        textwrap.dedent(
            """
            import ray, torch

            ray.init(num_cpus=2, include_dashboard=False)

            @ray.remote(enable_tensor_transport=True)
            class Early:
                def make(self):
                    return torch.full((50_000,), 3.0)

            @ray.remote(enable_tensor_transport=True)
            class EarlyReader:
                def total(self, value):
                    return float(value.sum())

            early, early_reader = Early.remote(), EarlyReader.remote()
            ray.get([early.__ray_ready__.remote(), early_reader.__ray_ready__.remote()])
            import tensorwire as tw  # Ray is imported: this registers "tensorwire"

            @ray.remote
            class Decorated:
                @ray.method(tensor_transport="tensorwire")
                def make(self):
                    return torch.ones(10)

            ref = early.make.options(tensor_transport="tensorwire").remote()
            print("late", float(ray.get(ref, timeout=60).sum()))
            print("decorated", float(ray.get(Decorated.remote().make.remote(), timeout=60).sum()))
            late_ref = early.make.options(tensor_transport="tensorwire").remote()
            print("early reader", ray.get(early_reader.total.remote(late_ref), timeout=60))
            """
        )
    )
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=300, env=env
    )
    assert "late 150000.0" in done.stdout and "decorated 10.0" in done.stdout, done.stderr[-3000:]
    assert "early reader 150000.0" in done.stdout, done.stderr[-3000:]


def test_ray_get_into_buffers_the_caller_set(producer):
    """``ray.experimental.set_target_for_ref``: the value lands in the caller's tensors."""
    ref = producer.tensor.remote(100_000, seed=9)
    buffer = torch.zeros(100_000)
    ray.experimental.set_target_for_ref(ref, [buffer])
    got = ray.get(ref, timeout=60)
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer, _expected_tensor(100_000, seed=9))
    bad_buffers = {  # Ray's own checks answer first through ray.get
        "[Ss]hape": torch.zeros(11),
        "int32": torch.zeros(10, dtype=torch.int32),
        "contiguous": torch.zeros(20)[::2],
    }
    for why, bad in bad_buffers.items():  # (kept alive: Ray holds target buffers weakly)
        wrong = producer.tensor.remote(10)
        ray.experimental.set_target_for_ref(wrong, [bad])
        with pytest.raises(ValueError, match=why):
            ray.get(wrong, timeout=60)


def test_target_buffers_are_checked_before_a_read():
    """The reader's own checks of ``set_target_for_ref`` buffers, behind Ray's (which the
    end-to-end test above meets first)."""
    from tensorwire.runtime.ray.transport import TensorwireTransport

    manager = TensorwireTransport()
    metadata = manager.extract_tensor_transport_metadata("obj-buffers", [torch.arange(10.0)])
    try:
        for bad, why in (
            (torch.zeros(11), r"target buffer 0 is \(11,\)"),
            (torch.zeros(10, dtype=torch.int32), "int32"),
            (torch.zeros(20)[::2], "not contiguous"),
            (None, "2 target buffers"),
        ):
            buffers = [torch.zeros(10), torch.zeros(10)] if bad is None else [bad]
            with pytest.raises(ValueError, match=why):
                manager.recv_multiple_tensors("obj-buffers", metadata, None, buffers)
        out = torch.zeros(10)
        [got] = manager.recv_multiple_tensors("obj-buffers", metadata, None, [out])
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, torch.arange(10.0))
    finally:
        manager.garbage_collect("obj-buffers", metadata, [])
    assert manager.published_count() == 0
