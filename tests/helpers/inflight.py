"""Proving that a transfer is in flight before a test injects a fault into it.

A fault test must not sleep and hope: it waits until bytes have provably started to arrive in
the receive buffer and have not all arrived, freezes the peer it is about to kill (SIGSTOP, so
no more bytes are sent), and only then kills. The producer sends a constant non-zero fill
(``tests.helpers.tasks:put_filled``) into a zeroed buffer, so a sample of the buffer shows
how far the transfer got. Receive buffers in another process live in a file both processes map
(``MAP_SHARED``), so the test process watches them too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

from tests.helpers.observe import wait_until

_SAMPLES = 4096


def arrived(buffer: torch.Tensor, fill: int) -> float:
    """The fraction of ``buffer`` (sampled evenly, last byte included) that holds ``fill``."""
    n = buffer.numel()
    step = max(1, n // _SAMPLES)
    sample = torch.cat([buffer[::step], buffer[-1:]])
    return float((sample == fill).sum()) / sample.numel()


def in_flight(buffer: torch.Tensor, fill: int) -> bool:
    return 0.0 < arrived(buffer, fill) < 1.0


class SharedBuffer:
    """A zeroed ``nbytes`` receive buffer in a file that several processes map shared."""

    def __init__(self, nbytes: int) -> None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, self.path = tempfile.mkstemp(prefix="pytest-inflight-", dir=directory)
        os.ftruncate(fd, nbytes)
        os.close(fd)
        self.nbytes = nbytes
        self.tensor = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Background:
    """``fn()`` on a thread; :meth:`outcome` is what it returned or raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._result: list[object] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result.append(fn())
        except Exception as e:
            self._result.append(e)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def outcome(self, timeout_s: float) -> object:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the call still runs {timeout_s} s after the fault"
        return self._result[0]


def wait_in_flight(buffer: torch.Tensor, fill: int, *, finished: Callable[[], bool], timeout_s: float = 60) -> None:
    """Wait until part, not all, of ``fill`` arrived in ``buffer``; fail the test when the
    transfer ended (``finished()``) or never started before that could be seen."""
    wait_until(lambda: in_flight(buffer, fill) or finished(), timeout_s)
    share = arrived(buffer, fill)
    assert 0.0 < share < 1.0 and not finished(), (
        f"the transfer was never seen in flight ({share:.0%} of the bytes had arrived, "
        f"finished: {finished()}); the fault would not land mid-transfer"
    )


def freeze_then_kill(pid: int, kill: Callable[[], None]) -> None:
    """SIGSTOP ``pid`` (it sends nothing more), then ``kill()`` it."""
    os.kill(pid, signal.SIGSTOP)
    kill()
