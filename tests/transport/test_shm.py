"""shm specifics: private segments, cleanup on free and after SIGKILL, full /dev/shm."""

from __future__ import annotations

import errno
import os
import pickle
import stat

import pytest
import torch

import tensorwire as tw
from tensorwire.transport import shm
from tests.helpers.observe import segment_names
from tests.helpers.procs import Worker
from tests.helpers.tasks import digest


def test_segment_is_private_and_unlinked_on_free(agent):
    before = segment_names()
    ref = tw.put(torch.randn(100_000))
    pickle.dumps(ref)  # leaving the process exports the segment
    new = segment_names() - before
    assert len(new) == 1
    (name,) = new
    info = os.stat(os.path.join(shm.SHM_DIR, name))
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    assert len(name.rsplit("-", 1)[1]) == 32  # 128 random bits
    tw.free(ref)
    assert segment_names() == before


def test_segments_of_a_killed_producer_are_removed_by_the_next_agent():
    w = Worker()
    try:
        ref = w.call("tests.helpers.tasks:put_filled", 1 << 20)
        pickle.dumps(ref)
        names = {n for n in segment_names() if n.startswith(f"{shm.segment_prefix()}{w.pid}-")}
        assert len(names) == 1
        w.kill()
        assert shm.remove_orphan_segments() >= 1
        assert not names & segment_names()
    finally:
        w.close()


def test_full_dev_shm_falls_back_to_a_two_sided_transport_with_a_warning(agent, worker, monkeypatch, caplog):
    def no_room(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "pwrite", no_room)
    value = torch.randn(200_000)
    ref = tw.put(value)
    agent._warned.discard("export:shm")
    with pytest.warns(RuntimeWarning, match="shm could not export"):
        blob = pickle.dumps(ref)
    got_digest, used = worker.call("tests.helpers.tasks:get_transport", pickle.loads(blob))
    assert (got_digest, used) == (digest(value), "ucx")  # next in the ranking: shm, ucx, host, gloo
    got_digest, used = worker.call("tests.helpers.tasks:get_transport", pickle.loads(blob), transport="host")
    assert (got_digest, used) == (digest(value), "host")
    caplog.clear()  # the captured warning's exception keeps the object alive (the leak guard would see it)


def test_forced_shm_on_full_dev_shm_is_a_clear_error(agent, worker, monkeypatch, caplog):
    monkeypatch.setattr(shm.os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    ref = tw.put(torch.randn(200_000))
    with pytest.warns(RuntimeWarning):
        agent._warned.discard("export:shm")
        blob = pickle.dumps(ref)
    assert worker.call("tests.helpers.tasks:get_error", pickle.loads(blob), transport="shm") == "TransportError"
    caplog.clear()  # the captured warning's exception keeps the object alive (the leak guard would see it)
