"""Functions that nixl tests run inside spawned workers (``tests.helpers.procs.Worker``)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

import tensorwire as tw
from tensorwire.collectives.weight_sync.members import common, receiver, trainer
from tensorwire.transport.backends.nixl import agent as nixl_agent
from tests.helpers.tasks import digest

_kept: dict[str, Any] = {}


def stats() -> dict[str, int]:
    return nixl_agent.stats()


def started_stats() -> dict[str, int]:
    """The counters once this process's NIXL agent exists (its own slot tables registered)."""
    nixl_agent.process_agent()
    return nixl_agent.stats()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def connection_metadata() -> bytes:
    """This process's NIXL agent metadata (what its connection info publishes once the agent exists)."""
    return nixl_agent.process_agent().conn_md


def put_kept(name: str, nbytes: int, seed: int = 0) -> tw.Ref:
    """Put a random ``nbytes`` tensor, kept here under ``name``; returns its reference."""
    value = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    _kept[name] = value
    ref = tw.put(value)
    _kept.setdefault("refs", []).append(ref)  # an inline value is tracked only while a reference lives here
    return ref


def put_again(name: str) -> tw.Ref:
    """A new object on the same memory as the kept tensor ``name`` (a parameter returned again)."""
    ref = tw.put(_kept[name])
    _kept.setdefault("refs", []).append(ref)
    return ref


def put_alone(name: str, nbytes: int) -> tuple[tw.Ref, tuple]:
    """Put a new ``nbytes`` tensor kept under ``name``; its reference and its storage's registration key."""
    _kept[name] = torch.ones(nbytes, dtype=torch.uint8)
    _kept[f"{name}/ref"] = tw.put(_kept[name])
    return _kept[f"{name}/ref"], nixl_agent.region(_kept[name])


def drop_alone(name: str) -> None:
    """Free the object ``name`` and drop its tensor: nothing here uses that memory any more."""
    tw.free(_kept.pop(f"{name}/ref"))
    del _kept[name]


def fill_kept(name: str, fill: int) -> str:
    """Overwrite the kept tensor ``name`` in place; the digest of what it holds now."""
    _kept[name].fill_(fill)
    return digest(_kept[name])


def free_kept_refs() -> None:
    """Free every object put by :func:`put_kept` (consumers' references to them see it freed)."""
    for ref in _kept.pop("refs", []):
        tw.free(ref)


def region_registered(key: tuple) -> bool:
    with nixl_agent.process_agent().lock:
        return tuple(key) in nixl_agent.process_agent().regs


def kept_digest(name: str) -> str:
    return digest(_kept[name])


def read_into_out(refs: list[tw.Ref]) -> list[str]:
    """Fetch each reference over nixl into one reused ``out=`` buffer; digests."""
    out = torch.empty(refs[0].nbytes, dtype=torch.uint8)
    result = []
    for ref in refs:
        got = tw.get(ref, out=out, transport="nixl")
        assert got is out
        result.append(digest(out))
    return result


def late_read(ref: tw.Ref, timeout_s: float) -> dict:
    """A nixl fetch that may hit its deadline: the digest or the error class, and this process's
    nixl counters."""
    try:
        value = tw.get(ref, transport="nixl", timeout_s=timeout_s)
    except tw.TensorwireError as e:
        return {"outcome": type(e).__name__, "stats": nixl_agent.stats()}
    return {"outcome": digest(value), "stats": nixl_agent.stats()}


def read_loop(ref: tw.Ref, progress: str, max_s: float, timeout_s: float) -> dict:
    """Fetch ``ref`` over nixl again and again (writing the count of completed reads to the
    file ``progress``) until a fetch fails or ``max_s`` passed; the error class, reads done."""
    out = torch.empty(ref.nbytes, dtype=torch.uint8)
    reads, end = 0, time.monotonic() + max_s
    while time.monotonic() < end:
        try:
            tw.get(ref, out=out, transport="nixl", timeout_s=timeout_s)
        except tw.TensorwireError as e:
            return {"error": type(e).__name__, "message": str(e), "reads": reads}
        reads += 1
        with open(progress + ".tmp", "w") as f:
            f.write(str(reads))
        os.replace(progress + ".tmp", progress)
    return {"error": "", "message": "", "reads": reads}


def timed_outcome(ref: tw.Ref, timeout_s: float) -> dict:
    """One nixl fetch: the error class (or "ok"), its message, the seconds it took."""
    start = time.monotonic()
    try:
        value = tw.get(ref, transport="nixl", timeout_s=timeout_s)
    except tw.TensorwireError as e:
        return {"outcome": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"outcome": digest(value), "message": "", "seconds": time.monotonic() - start}


def new_object(round_: int, nbytes: int) -> tw.Ref:
    """Producer: a new object of ``nbytes`` (fill = round % 251); the previous one freed."""
    previous = _kept.pop("round", None)
    if previous is not None:
        tw.free(previous)
    ref = tw.put(torch.full((nbytes,), round_ % 251, dtype=torch.uint8))
    _kept["round"] = ref
    return ref


def check_round(ref: tw.Ref, round_: int) -> bool:
    """Consumer: fetch over nixl into a new buffer; whether every byte is the round's fill."""
    got = tw.get(ref, transport="nixl")
    return bool((got == round_ % 251).all())


def free_kept() -> None:
    previous = _kept.pop("round", None)
    if previous is not None:
        tw.free(previous)
    _kept.clear()


def put_value(value: Any) -> tw.Ref:
    """Put ``value``; its reference stays here until :func:`free_kept` (small values go inline)."""
    ref = tw.put(value)
    _kept.setdefault("refs", []).append(ref)
    return ref


def broadcast_and_transports(name: str, rank: int, descriptions: list, src: int) -> tuple[str, list[str]]:
    """One tensorwire-backend broadcast (tests/collectives/standalone.py); the digest and the
    transports of this process's fetches during it."""
    from tests.collectives.standalone import broadcast

    before = len(tw.stats()["recent"])
    got = broadcast(name, rank, descriptions, "cpu", src)
    return got, [r.transport for r in tw.stats()["recent"][before:]]


def read_plain(refs: list[tw.Ref], transport: str = "nixl") -> dict:
    """Fetch each reference over ``transport`` with no ``out=``, each result dropped before the next
    fetch; the digests, and how many registrations and pool leases that took here."""
    from tensorwire.runtime.agent import agent

    nixl_agent.process_agent()
    registered, reused = nixl_agent.stats()["registered"], agent().host_pool.stats()["reused"]
    digests = []
    for ref in refs:
        value = tw.get(ref, transport=transport)
        digests.append(digest(value))
        del value  # its memory goes back to the pool
    return {
        "digests": digests,
        "registered": nixl_agent.stats()["registered"] - registered,
        "pool_reused": agent().host_pool.stats()["reused"] - reused,
    }


def sync_twice(role: str, specs: list, tensors: int) -> list[dict]:
    """Push (``role`` "send") or receive two versions into one holder's weights, the sender
    changing them in place between; per version its digest and the registrations it took here."""
    from tests.collectives import standalone

    actor = standalone.holder(tensors, "cpu", seed=3 if role == "send" else None)
    results = []
    for spec in specs:
        nixl_agent.process_agent()
        registered = nixl_agent.stats()["registered"]
        run = trainer.send if role == "send" else receiver.receive
        result = dataclasses.asdict(run(actor, spec))
        result.update(digest=digest(actor.weights), registered=nixl_agent.stats()["registered"] - registered)
        if role == "send":
            common.release_hook(None, spec.sync_id)  # after the receiver has it: the caller orders the calls
            for weight in actor.weights.values():
                weight.mul_(-1)  # a training step: the same memory, new values
        else:
            common.release_hook(actor, spec.sync_id)
        results.append(result)
    return results
