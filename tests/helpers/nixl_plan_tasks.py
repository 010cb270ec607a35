"""Functions that the nixl plan and grace tests run inside spawned workers."""

from __future__ import annotations

from typing import Any

import torch

import tensorwire as tw
from tensorwire.transport.backends.nixl import agent as nixl_agent
from tensorwire.transport.host_pool import liveness
from tests.helpers.tasks import digest

_kept: dict[str, Any] = {}


class _Freed:
    """What a freed storage's weak reference says."""

    def expired(self) -> bool:
        return True


def put(name: str, nbytes: int, seed: int, grace_s: float = nixl_agent.GRACE_S) -> tw.Ref:
    """Producer: a random ``nbytes`` tensor kept under ``name``, put; its handles promise a
    grace of ``grace_s`` (this process's setting from now on)."""
    nixl_agent.GRACE_S = grace_s
    _kept[name] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    _kept[f"{name}/ref"] = tw.put(_kept[name])
    return _kept[f"{name}/ref"]


def digest_of(name: str) -> str:
    return digest(_kept[name])


def free(name: str) -> dict:
    """Producer: free the object ``name`` (its tensor dropped here too): whether its memory was
    still alive right after, and the counters."""
    _kept["weak"] = liveness(_kept[name])
    del _kept[name]
    tw.free(_kept.pop(f"{name}/ref"))
    return {"alive": not _kept["weak"].expired(), "stats": nixl_agent.stats()}


def end_graces() -> None:
    """Producer: every lingering object's grace ends now (the sweep lets them go)."""
    agent = nixl_agent.process_agent()
    with agent.lock:
        agent.lingering = type(agent.lingering)(e._replace(until=0.0) for e in agent.lingering)
    agent.wake.set()


def freed_memory_gone() -> bool:
    """Producer: whether the memory of the object last freed by :func:`free` is gone."""
    return _kept["weak"].expired() and nixl_agent.stats()["lingering"] == 0


def stats() -> dict:
    return nixl_agent.stats()


def fetch_into(ref: tw.Ref, names: list[str]) -> dict:
    """Consumer: fetch ``ref`` over nixl into the buffer named by each of ``names`` in turn
    (made on first use, cleared before each fetch); digests, and the counters after."""
    digests = []
    for name in names:
        out = _kept.setdefault(f"out/{name}", torch.empty(ref.nbytes, dtype=torch.uint8))
        out.zero_()
        assert tw.get(ref, out=out, transport="nixl") is out
        digests.append(digest(out))
    return {"digests": digests, "stats": nixl_agent.stats()}


def outcome(ref: tw.Ref, name: str) -> str:
    """Consumer: a fetch into buffer ``name``: its digest, or the error's class name."""
    try:
        return fetch_into(ref, [name])["digests"][0]
    except tw.TensorwireError as e:
        return type(e).__name__


def repeat_into_a_buffer_then_drop_it(ref: tw.Ref) -> dict:
    """Consumer: keep ``ref``, fetch it three times into a new buffer (the third a repeat,
    posted by the repeater), then drop the buffer (the reference stays): digests, and the
    counters before and after the fetches."""
    _kept["held"] = ref
    out = torch.empty(ref.nbytes, dtype=torch.uint8)
    before, digests = nixl_agent.stats(), []
    for _ in range(3):
        out.zero_()
        assert tw.get(ref, out=out, transport="nixl") is out
        digests.append(digest(out))
    return {"digests": digests, "before": before, "after": nixl_agent.stats()}


def drop_buffer(name: str) -> None:
    del _kept[f"out/{name}"]


def put_mixed(name: str) -> tw.Ref:
    """Producer: a small value of several dtypes (bfloat16, an empty tensor) kept under ``name``."""
    generator = torch.Generator().manual_seed(7)
    _kept[name] = {
        "a": torch.randn(100, generator=generator).to(torch.bfloat16),
        "b": torch.arange(33, dtype=torch.int64),
        "empty": torch.empty(0, dtype=torch.float32),
        "c": torch.randint(0, 2, (5,), generator=generator, dtype=torch.bool),
    }
    _kept[f"{name}/ref"] = tw.put(_kept[name])
    return _kept[f"{name}/ref"]


def value_digest(name: str) -> str:
    return digest(list(_kept[name].values()))


def fetch_value(ref: tw.Ref) -> tuple[list[str], dict]:
    """Consumer: fetch a dict value over nixl twice (new tensors, then into those, zeroed
    first): its digest each time, the counters."""
    value = tw.get(ref, transport="nixl")
    digests = [digest(list(value.values()))]
    for tensor in value.values():
        tensor.zero_()
    again = tw.get(ref, transport="nixl", out=value)
    assert all(again[k] is value[k] for k in value)  # filled in place
    return [*digests, digest(list(value.values()))], nixl_agent.stats()


def put_many(count: int, nbytes: int) -> list[tw.Ref]:
    """Producer: ``count`` small objects, all kept live (more than the slab has slots)."""
    refs = [put(f"many{i}", nbytes, i) for i in range(count)]
    return refs


def digests_of(names: list[str]) -> list[str]:
    return [digest(_kept[n]) for n in names]


def fetch_each(refs: list[tw.Ref]) -> list[str]:
    return [digest(tw.get(ref, transport="nixl")) for ref in refs]


def packed_slot(name: str) -> int | None:
    """Producer: the slab slot the exported object ``name`` is packed in (None: not packed)."""
    from tensorwire.runtime.agent import agent as runtime_agent

    desc = _kept[f"{name}/ref"].state.desc
    state = runtime_agent().local_object(desc.object_id, desc.token).transport_state.get("nixl")
    return state.slot if type(state).__name__ == "_Packed" else None


def set_grace(grace_s: float) -> None:
    nixl_agent.GRACE_S = grace_s


def set_prepared(on: bool | None) -> None:
    """Consumer: keep prepared READs per (object, destination), or not; None: as the
    environment says (on unless ``TENSORWIRE_NIXL_PREPARED=0``)."""
    import os

    from tensorwire.transport.backends.nixl import plans

    plans.PREPARED = on if on is not None else os.environ.get(plans.PREPARED_ENV, "1").strip() != "0"


def fetch_freed_midway(ref: tw.Ref, name: str) -> str:
    """Consumer: a fetch into buffer ``name`` whose object is freed at its owner after the READ of
    data and tag and before the tag is read again (with a grace shorter than any READ, it always
    is): the digest, or the error's class name."""
    from tensorwire.transport.backends.nixl import plans

    real = plans.Plan.read_tag

    def freeing(plan: Any, agent: Any) -> Any:
        tw.free(ref)  # blocks for the owner's answer: its tag is cleared there now
        return real(plan, agent)

    plans.Plan.read_tag = freeing
    try:
        return outcome(ref, name)
    finally:
        plans.Plan.read_tag = real


def stale_registration_in_use() -> dict:
    """A registration still in use whose memory is freed (its weak reference expired, as when a
    kept plan or a lingering object outlives its tensor) is not handed out for new memory at
    the same address: that gets a registration of its own; the old one goes at its last unuse."""
    agent = nixl_agent.process_agent()
    tensor = torch.ones(1 << 20, dtype=torch.uint8)
    (old,) = agent.acquire([tensor])

    old.weak = _Freed()
    before = dict(nixl_agent.stats())
    (new,) = agent.acquire([tensor])  # "new memory" at the same address
    listed = agent.regs.get(nixl_agent.region(tensor)) is new
    agent.unuse([old])
    after = dict(nixl_agent.stats())
    agent.unuse([new])
    return {
        "same": new is old,
        "listed": listed,
        "old_stale": old.stale,
        "deregistered": after["deregistered"] - before["deregistered"],
    }


def overlapping_registration_held(ref: tw.Ref) -> dict:
    """Consumer: a registration of a wider view of the memory fetched into (another registration
    overlapping the destination, which NIXL may resolve the READs to) is held by the kept plan,
    and goes with that plan once its own memory is freed; the value stays exact throughout."""
    import numpy as np

    agent = nixl_agent.process_agent()
    base = np.zeros(ref.nbytes + 8192, dtype=np.uint8)
    wide = torch.from_numpy(base)
    (wide_reg,) = agent.acquire([wide])
    agent.unuse([wide_reg])  # registered, unused: what a freed value's destination leaves behind
    out = torch.from_numpy(base[4096 : 4096 + ref.nbytes])  # a storage of its own over the same memory
    digests = []
    for _ in range(2):  # the second fetch keeps its READs
        out.zero_()
        tw.get(ref, out=out, transport="nixl")
        digests.append(digest(out))
    held, plans_before = wide_reg.users, nixl_agent.stats()["plans"]
    del wide  # its storage goes (the memory stays: ``out`` views it)
    agent._sweep_once()  # what the sweep thread does within 0.2 s, now
    gone, plans_after = wide_reg.rid not in agent.registered, nixl_agent.stats()["plans"]
    out.zero_()
    tw.get(ref, out=out, transport="nixl")
    digests.append(digest(out))
    return {"held": held, "dropped_plans": plans_before - plans_after, "gone": gone, "digests": digests}


def plan_not_kept_while_it_would_hold_freed_memory(ref: tw.Ref) -> dict:
    """Consumer: a registration overlapping the destination whose memory was freed but which
    something still uses (here: an extra use) would be held by the plan, which would then go
    at its next use: the pair's READs are made per fetch until that registration went, then kept."""
    import numpy as np

    agent = nixl_agent.process_agent()
    base = np.zeros(ref.nbytes + 8192, dtype=np.uint8)
    wide = torch.from_numpy(base)
    (wide_reg,) = agent.acquire([wide])  # used (and kept in use) by "someone"
    del wide  # its memory is freed as far as the registration knows
    out = torch.from_numpy(base[4096 : 4096 + ref.nbytes])
    made = nixl_agent.stats()["plans_made"]
    digests = []

    def fetch(times: int) -> int:
        for _ in range(times):
            out.zero_()
            tw.get(ref, out=out, transport="nixl")
            digests.append(digest(out))
        return nixl_agent.stats()["plans_made"] - made

    while_used = fetch(3)
    agent.unuse([wide_reg])  # its last use: the sweep deregisters it
    agent._sweep_once()
    gone = wide_reg.rid not in agent.registered
    after = fetch(3)
    return {"while_used": while_used, "gone": gone, "after": after, "digests": digests}


def younger_twin_waits_for_the_older(nbytes: int) -> dict:
    """NIXL deregisters the *oldest* registration of an (address, bytes, device): new memory
    registered where a stale registration (still in use) lies is deregistered only after it."""
    agent = nixl_agent.process_agent()
    tensor = torch.ones(nbytes, dtype=torch.uint8)
    (old,) = agent.acquire([tensor])

    old.weak = _Freed()
    (new,) = agent.acquire([tensor])  # "new memory" at the same address: old goes stale
    start = agent.stats["deregistered"]
    agent.unuse([new])
    with agent.lock:
        agent._drop(new)  # as the cache's trim or the sweep would
    waiting = {"new_in_nixl": new.rid in agent.registered, "deregistered": agent.stats["deregistered"] - start}
    agent.unuse([old])  # the stale one's last use: it goes, then the one waiting behind it
    return {
        "waiting": waiting,
        "after": {
            "old_in_nixl": old.rid in agent.registered,
            "new_in_nixl": new.rid in agent.registered,
            "deregistered": agent.stats["deregistered"] - start,
        },
    }
