"""Finalizers of references run where the garbage collector finds them: inside whatever the
thread was doing, under whatever locks it held. Each test makes a collection start at the
worst place and checks that the thread goes on and nothing is lost."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import thread as pool_threads
from types import CodeType

import torch

import tensorwire as tw
from tensorwire.runtime import pending
from tensorwire.transport.agent.store import ObjectStore
from tests.helpers.observe import wait_until
from tests.helpers.reentry import collector_reenters


def test_a_dropped_calls_finalizer_inside_a_thread_pools_submit_neither_blocks_nor_loses_the_call():
    """A thread pool's ``submit`` holds plain locks while it allocates; the finalizer of a
    dropped ``@tw.method`` call used to submit to a pool too, and blocked that thread (and
    every later submit in the process) for ever."""
    pending._start_settler()
    dropped_call = object()  # stands for its ObjectRef: the settler keeps what it cannot watch
    box = pending._Unsettled(dropped_call, b"")
    pool = ThreadPoolExecutor(max_workers=1)
    entered, finished = collector_reenters(
        lambda: pool.submit(int).result(timeout=20),
        inside=ThreadPoolExecutor.submit,
        lock=pool_threads._global_shutdown_lock,
        reenter=lambda: pending._settle_orphan(box),
    )
    if finished:  # (a blocked submit holds the pool's locks: the pool is left as it is)
        pool.shutdown()
    assert entered, "the collector never ran inside submit's lock: the test did not test it"
    assert finished, "submit blocked when a dropped call's finalizer ran inside it"
    assert wait_until(lambda: any(kept is dropped_call for kept in pending._kept_past_shutdown), timeout_s=20)
    pending._kept_past_shutdown.remove(dropped_call)


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


def test_a_forked_child_runs_none_of_the_parents_queued_settlements():
    """A settlement queued in the parent when it forks is the parent's, and so is a dropped call
    the child inherited: a child that settled either would release the parent's pins again."""
    pending._start_settler()
    busy, go = threading.Event(), threading.Event()
    pending._settlement.put((lambda: (busy.set(), go.wait(30)), ()))  # keeps the parent's settler busy
    assert busy.wait(30)
    read_end, write_end = os.pipe()
    pending._settlement.put((os.write, (write_end, b"p")))  # still queued at the fork
    inherited = pending._Unsettled(object(), b"")  # a call the parent has not settled yet
    kept_before = len(pending._kept_past_shutdown)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (3.12+: fork of a process with threads)
        pid = os.fork()
    if pid == 0:  # the child: only its own settlements run
        try:
            done = threading.Event()
            pending._start_settler()
            pending._settle_orphan(inherited)  # the parent's dropped call, dropped in the child too
            pending._settlement.put((os.write, (write_end, b"c")))
            pending._settlement.put((done.set, ()))
            ran = done.wait(30)  # in order: a settlement of the inherited call would have run by now
            os._exit(0 if ran and len(pending._kept_past_shutdown) == kept_before else 1)
        finally:
            os._exit(2)
    go.set()
    parent_done = threading.Event()
    pending._settlement.put((parent_done.set, ()))
    status: list[int] = []
    exited = wait_until(lambda: _reaped(pid, status), timeout_s=30)
    if not exited:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert parent_done.wait(30)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        written = pipe.read()
    assert exited and os.waitstatus_to_exitcode(status[-1]) == 0, "the child settled the parent's call, or not its own"
    assert sorted(written) == sorted(b"pc"), f"settlements that ran: {written!r} (p: the parent's, c: the child's)"


def _reaped(pid: int, status: list[int]) -> bool:
    done, code = os.waitpid(pid, os.WNOHANG)
    if done == pid:
        status.append(code)
    return done == pid
