"""The per-test leak guard finds what it claims to find (``tests/helpers/leaks.py``)."""

from __future__ import annotations

import torch

import tensorwire as tw
from tests.helpers import leaks


def test_an_owned_object_and_its_segment_are_reported_until_freed(agent):
    before = leaks.snapshot()
    ref = tw.put(torch.arange(1 << 20, dtype=torch.int32))
    agent.export_handles(ref._desc)  # a shared-memory segment, as a first pickle makes
    problems = leaks.leaks_since(before, settle_s=0.2)
    assert len(problems) == 2, problems
    assert "owns 1 object(s)" in problems[0] or f"owns {before.owned + 1} object(s)" in problems[0]
    assert problems[1].startswith("shared-memory segments left behind: ['tw-")
    tw.free(ref)
    assert leaks.leaks_since(before) == []


def test_a_segment_descriptor_left_open_is_reported(agent):
    import os

    before = leaks.snapshot()
    ref = tw.put(torch.zeros(1 << 20, dtype=torch.uint8))
    agent.export_handles(ref._desc)
    (name,) = leaks.segment_entries() - before.segments
    fd = os.open(os.path.join("/dev/shm", name), os.O_RDONLY)
    try:
        tw.free(ref)
        problems = leaks.leaks_since(before, settle_s=0.2)
        assert problems == [f"file descriptors of segments still open: {{{fd}: '/dev/shm/{name} (deleted)'}}"], problems
    finally:
        os.close(fd)
    assert leaks.leaks_since(before) == []


def test_a_segment_of_a_process_started_during_the_test_is_reported():
    from tests.helpers.procs import Worker

    before = leaks.snapshot()
    worker = Worker()
    try:
        ref, _ = worker.call("tests.helpers.tasks:put_and_return", 1 << 20)  # exported: a segment in the worker
        problems = leaks.leaks_since(before, settle_s=0.2)
        assert len(problems) == 1 and f"(owned by pid {worker.pid} " in problems[0], problems
        del ref  # released: the worker frees the object and its segment
        assert leaks.leaks_since(before) == []
    finally:
        worker.close()
