"""The nixl consumer's kept READs (plans) and the producer's grace: a repeated fetch posts
READs prepared once per (object, destination); the tag is read with the data when the producer
keeps freed memory for a grace, after it otherwise; a fetch that starts after a free is
refused while the memory still lingers."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.observe import wait_until
from tests.helpers.procs import Worker

INSTALLED = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13"))
pytestmark = pytest.mark.skipif(
    not INSTALLED, reason="NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)"
)

MIB = 1 << 20
TCP = {"UCX_TLS": "tcp,self", "OMP_NUM_THREADS": "1", "TENSORWIRE_INLINE_NBYTES": "0"}  # 4 KiB not inline
P = "tests.helpers.nixl_plan_tasks"


@pytest.fixture(scope="module")
def pair():
    """A producer and a consumer that claim different nodes and use UCX over TCP only."""
    producer = Worker(env={**TCP, "TENSORWIRE_NODE_ID": "plans-a"})
    consumer = Worker(env={**TCP, "TENSORWIRE_NODE_ID": "plans-b"})
    yield producer, consumer
    producer.close()
    consumer.close()


@pytest.fixture(autouse=True)
def defaults(pair):
    """Each test leaves the producer's grace and the consumer's prepared READs (as the
    environment says: on by default) as it found them, passed or failed."""
    yield
    pair[0].call(f"{P}:set_grace", 0.02)
    pair[1].call(f"{P}:set_prepared", None)


def test_repeated_fetches_post_prepared_reads_one_plan_per_destination(pair):
    producer, consumer = pair
    consumer.call(f"{P}:set_prepared", True)
    # larger than a slab slot: read where it lies; a grace no READ here outlasts: one trip each time
    ref = producer.call(f"{P}:put", "repeat", 64 << 10, 1, 600.0)
    expected = producer.call(f"{P}:digest_of", "repeat")
    before = consumer.call(f"{P}:stats") if consumer.call(f"{P}:stats") else {"plans_made": 0, "plans": 0}
    got = consumer.call(f"{P}:fetch_into", ref, ["a"] * 5 + ["b"] * 3 + ["a"])
    assert got["digests"] == [expected] * 9
    # the first fetch into a buffer makes its READs for itself; the second keeps them, later ones reuse them
    assert got["stats"]["plans_made"] - before["plans_made"] == 2, got["stats"]
    assert got["stats"]["plans"] - before["plans"] == 2, got["stats"]
    assert got["stats"]["tags_after"] == before.get("tags_after", 0), got["stats"]  # data and tag in one READ
    # from the third fetch into the same buffer the repeat posts the kept plan itself: a 3-5, b 3
    assert got["stats"]["plans_repeated"] - before.get("plans_repeated", 0) == 4, got["stats"]
    consumer.call(f"{P}:drop_buffer", "a")  # its memory freed: its plan goes (an address may be reused)
    assert wait_until(lambda: consumer.call(f"{P}:stats")["plans"] - before["plans"] == 1, timeout_s=30)
    again = consumer.call(f"{P}:fetch_into", ref, ["a", "a", "a"])  # a new buffer named "a": a new plan
    assert again["digests"] == [expected] * 3
    assert again["stats"]["plans_made"] - before["plans_made"] == 3, again["stats"]
    assert again["stats"]["plans_repeated"] - before.get("plans_repeated", 0) == 5, again["stats"]


def test_a_repeat_holds_its_buffer_weakly_so_its_plan_goes_with_it(pair):
    """The reference kept, its buffer dropped: the plan the repeats posted (and the
    registrations it holds) goes; a repeater holding the buffer would keep both alive."""
    producer, consumer = pair
    ref = producer.call(f"{P}:put", "weak", 64 << 10, 6, 600.0)
    got = consumer.call(f"{P}:repeat_into_a_buffer_then_drop_it", ref)
    assert got["digests"] == [producer.call(f"{P}:digest_of", "weak")] * 3
    before, after = got["before"] or {"plans": 0, "plans_repeated": 0}, got["after"]
    assert after["plans"] - before["plans"] == 1 and after["plans_repeated"] - before["plans_repeated"] == 1, got
    assert wait_until(lambda: consumer.call(f"{P}:stats")["plans"] == before["plans"], timeout_s=30)


def test_tag_is_read_with_the_data_within_the_grace_and_after_it_otherwise(pair):
    producer, consumer = pair
    small = producer.call(f"{P}:put", "small", 4096, 2, 30.0)  # a grace no trip here outlasts
    start = consumer.call(f"{P}:stats") or {"tags_after": 0}
    got = consumer.call(f"{P}:fetch_into", small, ["s"] * 4)
    assert got["digests"] == [producer.call(f"{P}:digest_of", "small")] * 4
    assert got["stats"]["tags_after"] == start.get("tags_after", 0), got["stats"]  # one trip each
    assert got["stats"]["plans_made"] - start.get("plans_made", 0) == 1, got["stats"]  # on by default: kept at the 2nd
    tiny = producer.call(f"{P}:put", "tiny", 4096, 3, 1e-6)  # every trip outlasts half of 1 us
    got = consumer.call(f"{P}:fetch_into", tiny, ["t"] * 4)
    assert got["digests"] == [producer.call(f"{P}:digest_of", "tiny")] * 4
    assert got["stats"]["tags_after"] - start.get("tags_after", 0) == 4, got["stats"]
    big = producer.call(f"{P}:put", "big", 8 * MIB, 4, 30.0)  # over LINGER_NBYTES: no grace at all
    got = consumer.call(f"{P}:fetch_into", big, ["g"] * 2)
    assert got["digests"] == [producer.call(f"{P}:digest_of", "big")] * 2
    assert got["stats"]["tags_after"] - start.get("tags_after", 0) == 6, got["stats"]


@pytest.mark.parametrize("before", [2, 3, 0], ids=["kept-plan", "repeated", "first-fetch"])
def test_a_fetch_after_free_is_refused_while_the_memory_lingers(pair, before):
    """Refused whether the fetch is the first into its buffer, or a repeat into one with a kept
    plan (its repeater made by that fetch, or already posting it)."""
    producer, consumer = pair
    # larger than a slab slot (read where it lies); its handle promises a 600 s grace
    ref = producer.call(f"{P}:put", f"freed-{before}", 64 << 10, 5, 600.0)
    consumer.call(f"{P}:set_prepared", bool(before))
    start = consumer.call(f"{P}:stats") or {"plans": 0, "plans_repeated": 0}
    if before:  # this buffer has a kept plan when the object is freed
        got = consumer.call(f"{P}:fetch_into", ref, [f"f{before}"] * before)
        assert got["digests"] == [producer.call(f"{P}:digest_of", f"freed-{before}")] * before
        assert got["stats"]["plans_repeated"] - start["plans_repeated"] == before - 2, got["stats"]
    freed = producer.call(f"{P}:free", f"freed-{before}")
    assert freed["alive"] and freed["stats"]["lingering"] >= 1, freed  # kept for the grace ...
    assert consumer.call(f"{P}:outcome", ref, f"f{before}") == "ObjectFreedError"  # ... never read as live
    assert consumer.call(f"{P}:stats")["plans"] == start["plans"]  # a kept plan was retired
    producer.call(f"{P}:end_graces")
    assert wait_until(lambda: producer.call(f"{P}:freed_memory_gone"), timeout_s=30)


@pytest.mark.parametrize("nbytes", [4096, 64 << 10], ids=["packed", "in-place"])
def test_a_free_between_the_read_and_the_second_look_at_the_tag_is_seen(pair, nbytes):
    """A READ that took longer than half the grace (here: every one) reads the tag again after
    the data; an object freed in between is refused though its first READ saw it live."""
    producer, consumer = pair
    ref = producer.call(f"{P}:put", f"midway{nbytes}", nbytes, 10, 1e-6)
    assert consumer.call(f"{P}:fetch_freed_midway", ref, f"m{nbytes}") == "ObjectFreedError"


def test_small_host_objects_are_read_in_one_descriptor_bytes_exact(pair):
    producer, consumer = pair
    before = consumer.call(f"{P}:stats") or {"packed_fetches": 0}
    ref = producer.call(f"{P}:put_mixed", "mixed")  # bfloat16, int64, bool and an empty tensor: 377 bytes
    got, after = consumer.call(f"{P}:fetch_value", ref)
    assert got == [producer.call(f"{P}:value_digest", "mixed")] * 2
    assert producer.call(f"{P}:packed_slot", "mixed") is not None
    assert after["packed_fetches"] - before.get("packed_fetches", 0) == 2, after  # new tensors, then out=


def test_a_slab_slot_taken_by_a_new_object_never_serves_the_old_reference(pair):
    producer, consumer = pair
    old = producer.call(f"{P}:put", "slot-old", 2048, 8)
    assert consumer.call(f"{P}:outcome", old, "o") == producer.call(f"{P}:digest_of", "slot-old")
    slot = producer.call(f"{P}:packed_slot", "slot-old")
    assert slot is not None
    producer.call(f"{P}:free", "slot-old")
    producer.call(f"{P}:end_graces")  # the slot goes back to the slab ...
    assert wait_until(lambda: producer.call(f"{P}:stats")["lingering"] == 0, timeout_s=30)
    new = producer.call(f"{P}:put", "slot-new", 2048, 9)
    assert (
        producer.call(f"{P}:packed_slot", "slot-new") == slot
    )  # ... and the next object takes it (last in, first out)
    assert consumer.call(f"{P}:outcome", old, "o") == "ObjectFreedError"  # the new object's tag is not the old one's
    assert consumer.call(f"{P}:outcome", new, "o") == producer.call(f"{P}:digest_of", "slot-new")


def test_with_every_slab_slot_taken_small_objects_take_the_usual_path(pair):
    producer, consumer = pair
    refs = producer.call(f"{P}:put_many", 300, 1024)  # exported as they leave: the last ones find the slab full
    assert consumer.call(f"{P}:fetch_each", refs) == producer.call(f"{P}:digests_of", [f"many{i}" for i in range(300)])
    assert (
        producer.call(f"{P}:packed_slot", "many0") is not None and producer.call(f"{P}:packed_slot", "many299") is None
    )


def test_a_registration_whose_memory_went_while_in_use_is_never_handed_out_again(pair):
    _, consumer = pair
    got = consumer.call(f"{P}:stale_registration_in_use")
    assert got == {"same": False, "listed": True, "old_stale": True, "deregistered": 1}, got


def test_a_kept_plan_holds_every_registration_its_reads_may_resolve_to(pair):
    """NIXL resolves a READ's local descriptor to any registration covering it; one overlapping
    the destination (a wider view of the same memory, or freed memory's registration not yet
    gone) must not be deregistered while a kept READ may point at it (it was: SIGSEGV)."""
    producer, consumer = pair
    consumer.call(f"{P}:set_prepared", True)
    ref = producer.call(f"{P}:put", "overlap", 64 << 10, 11, 600.0)
    got = consumer.call(f"{P}:overlapping_registration_held", ref)
    assert got["digests"] == [producer.call(f"{P}:digest_of", "overlap")] * 3, got
    assert got["held"] == 1, got  # the kept plan holds the wider view's registration
    assert got["dropped_plans"] >= 1 and got["gone"], got  # its storage went: the plan, then it, go


def test_no_plan_is_kept_while_it_would_hold_a_registration_of_freed_memory(pair):
    producer, consumer = pair
    consumer.call(f"{P}:set_prepared", True)
    ref = producer.call(f"{P}:put", "overlap-freed", 64 << 10, 12, 600.0)
    got = consumer.call(f"{P}:plan_not_kept_while_it_would_hold_freed_memory", ref)
    assert got["digests"] == [producer.call(f"{P}:digest_of", "overlap-freed")] * 6, got
    assert got["while_used"] == 0, got  # kept, it would have gone at its next use
    assert got["gone"] and got["after"] == 1, got  # that registration gone: the second fetch keeps its READs


def test_a_registration_made_anew_at_a_stale_ones_key_is_deregistered_after_it(pair):
    """NIXL deregisters the oldest registration of an (address, bytes, device): deregistering
    the younger first would free the metadata of the older one, still in use."""
    got = pair[1].call(f"{P}:younger_twin_waits_for_the_older", 1 << 20)
    assert got["waiting"] == {"new_in_nixl": True, "deregistered": 0}, got
    assert got["after"] == {"old_in_nixl": False, "new_in_nixl": False, "deregistered": 2}, got


def test_prepared_reads_are_on_unless_the_environment_turns_them_off(pair):
    producer = pair[0]
    ref = producer.call(f"{P}:put", "by-env", 64 << 10, 1, 600.0)
    expected = producer.call(f"{P}:digest_of", "by-env")
    made = {}
    for setting in ("1", "0", ""):
        consumer = Worker(  # "": empty, as if unset (the default)
            env={**TCP, "TENSORWIRE_NODE_ID": f"plans-env-{setting or 'default'}", "TENSORWIRE_NIXL_PREPARED": setting}
        )
        try:
            got = consumer.call(f"{P}:fetch_into", ref, ["a"] * 3)
        finally:
            consumer.close()
        assert got["digests"] == [expected] * 3
        made[setting] = got["stats"]["plans_made"]
    assert made == {"1": 1, "0": 0, "": 1}  # the second fetch into "a" keeps its READs unless turned off
