"""Finalizers of references run where the garbage collector finds them: inside whatever the
thread was doing, under whatever locks it held. Each test makes a collection start at the
worst place and checks that the thread goes on and nothing is lost."""

from __future__ import annotations

from types import CodeType

import torch

import tensorwire as tw
from tensorwire.transport.agent.store import ObjectStore
from tests.helpers.reentry import collector_reenters


def test_counting_the_stores_bytes_survives_a_finalizer_freeing_an_object_meanwhile(agent):
    """``tw.stats()`` and ``wait_tensor_freed`` walk the owner's objects; a reference's
    finalizer run during the walk frees one (the walk used to raise "dictionary changed size
    during iteration")."""
    refs = [tw.put(torch.full((1000 + i,), i, dtype=torch.uint8)) for i in range(3)]
    store = agent._store
    victim = store.get(refs[1]._desc.object_id)
    counted: list[int] = []
    entered, finished = collector_reenters(
        lambda: counted.append(store.nbytes()),
        inside=next(c for c in ObjectStore.nbytes.__code__.co_consts if isinstance(c, CodeType)),  # the walk
        lock=None,
        reenter=lambda: store.free(victim),
    )
    assert entered, "the collector never ran during the walk: the test did not test it"
    assert finished, "counting the store's bytes failed when an object was freed meanwhile"
    assert not store.is_live(victim) and all(store.get(r._desc.object_id) is not None for r in (refs[0], refs[2]))
    assert counted and counted[0] >= 1000 + 1002  # the two that stay are counted


def test_an_object_freed_while_it_is_exported_is_not_left_offered(agent, monkeypatch):
    """Freeing does not wait for an export in progress (a finalizer inside the export, or
    another thread): a release that came before the export kept its state must not leave
    the object offered to consumers, its live word set, for ever."""
    from tensorwire.transport.backends.shm.transport import ShmTransport

    ref = tw.put(torch.full((1 << 20,), 5, dtype=torch.uint8))  # above the inline limit
    entry = agent._store.get(ref._desc.object_id)
    original, servers = ShmTransport.export, []

    def freed_meanwhile(self, obj):
        tensors = obj.tensors  # the export has read them already
        agent._store.free(entry)  # every transport's release runs now, before the export kept anything
        obj.tensors = tensors
        handle = original(self, obj)
        servers.append(obj.transport_state[self.name][0])
        return handle

    monkeypatch.setattr(ShmTransport, "export", freed_meanwhile)
    agent._store.export_handles(ref._desc)
    assert servers, "shm did not export the object: the test did not test it"
    assert "shm" not in entry.stored.transport_state
    assert ref._desc.object_id not in servers[0]._segments
