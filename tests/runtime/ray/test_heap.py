"""When a tensorwire actor freezes what the garbage collector walks (``runtime/ray/heap.py``): at
the first call through each entry (a method, an async method, a hook), once per process, after
one collection; never with ``TENSORWIRE_GC_FREEZE=0``. The collector's functions are recorded
here, not run (``tests/integration/test_ray_runtime.py`` runs them in an actor)."""

from __future__ import annotations

import asyncio

import pytest

from tensorwire.runtime.ray import actor, heap
from tensorwire.runtime.ray import env as ray_env
from tensorwire.runtime.ray.handles import PLAIN


@pytest.fixture
def recorded(monkeypatch):
    """What the collector was asked to do, in order (nothing frozen in this process yet)."""
    calls: list[str] = []
    monkeypatch.setattr(heap.gc, "collect", lambda *_args: calls.append("collect") or 0)
    monkeypatch.setattr(heap.gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(heap, "_frozen_pid", 0)
    monkeypatch.setattr(ray_env, "_async_actor", False)  # an async method marks the process
    monkeypatch.delenv(heap.FREEZE_ENV, raising=False)
    return calls


class Plain:
    def ping(self) -> str:
        return "pong"

    async def ping_async(self) -> str:
        return "pong, async"


def test_freezes_once_per_process_after_a_collection(recorded):
    heap.freeze_at_first_call()
    heap.freeze_at_first_call()
    assert recorded == ["collect", "freeze"]


def test_gc_freeze_off_does_nothing(recorded, monkeypatch):
    monkeypatch.setenv(heap.FREEZE_ENV, "0")
    heap.freeze_at_first_call()
    heap.freeze_at_first_call()
    assert recorded == []


def test_each_entry_into_an_actor_freezes_first(recorded, monkeypatch):
    method = actor._wrap_method(Plain.ping, PLAIN, async_actor=False)
    assert method(Plain()) == "pong" and recorded == ["collect", "freeze"]

    monkeypatch.setattr(heap, "_frozen_pid", 0)
    recorded.clear()
    method_async = actor._wrap_method(Plain.ping_async, PLAIN, async_actor=True)
    assert asyncio.run(method_async(Plain())) == "pong, async" and recorded == ["collect", "freeze"]

    monkeypatch.setattr(heap, "_frozen_pid", 0)
    recorded.clear()
    assert actor._tw_hook(object(), ("tensorwire.collectives.groups.membership", "leave"), "no-such-group") is False
    assert recorded == ["collect", "freeze"]
