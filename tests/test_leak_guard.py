"""The per-test leak guard finds what it claims to find (``tests/helpers/leaks.py``)."""

from __future__ import annotations

import torch

import tensorwire as tw
from tests.helpers import leaks


def test_an_owned_object_and_its_segment_are_reported_until_freed(agent, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_SHM_DIRECT", "0")  # shm packs a segment when the reference leaves
    before = leaks.snapshot()
    ref = tw.put(torch.arange(1 << 20, dtype=torch.int32))
    agent.export_handles(ref._desc)  # a shared-memory segment, as a first pickle makes
    problems = leaks.leaks_since(before, settle_s=0.2)
    assert len(problems) == 3, problems
    assert "owns 1 object(s)" in problems[0] or f"owns {before.owned + 1} object(s)" in problems[0]
    assert problems[1].startswith("shared-memory segments left behind: inode ") and "this process" in problems[1]
    assert problems[2].startswith("file descriptors of segments still open: ")  # the producer's, until freed
    tw.free(ref)
    assert leaks.leaks_since(before) == []


def test_a_segment_descriptor_left_open_is_reported(agent, monkeypatch):
    import os

    monkeypatch.setenv("TENSORWIRE_SHM_DIRECT", "0")
    before = leaks.snapshot()
    ref = tw.put(torch.zeros(1 << 20, dtype=torch.uint8))
    agent.export_handles(ref._desc)
    (inode,) = set(leaks.segment_entries()) - before.segments
    held = min(set(leaks.segment_fds()) - before.fds)  # one of the producer's own descriptors
    fd = os.open(f"/proc/self/fd/{held}", os.O_RDONLY)  # a second descriptor of the same segment
    try:
        tw.free(ref)
        problems = leaks.leaks_since(before, settle_s=0.2)
        assert len(problems) == 2, problems
        assert problems[0] == f"shared-memory segments left behind: inode {inode}: this process", problems
        assert problems[1] == f"file descriptors of segments still open: {{{fd}: '/memfd:tensorwire (deleted)'}}"
    finally:
        os.close(fd)
    assert leaks.leaks_since(before) == []


def test_a_segment_of_a_process_started_during_the_test_is_reported():
    from tests.helpers.procs import Worker

    before = leaks.snapshot()
    worker = Worker(env={"TENSORWIRE_SHM_DIRECT": "0"})
    try:
        ref, _ = worker.call("tests.helpers.tasks:put_and_return", 1 << 20)  # exported: a segment in the worker
        problems = leaks.leaks_since(before, settle_s=0.2)
        assert len(problems) == 1 and f": pid {worker.pid} (" in problems[0], problems
        del ref  # released: the worker frees the object and its segment
        assert leaks.leaks_since(before) == []
    finally:
        worker.close()
