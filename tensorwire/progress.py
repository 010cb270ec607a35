"""Progress bars for long user-facing work (bench, weight sync, doctor): tqdm, on stderr.

Standard output stays for results (tables, ``--json``); a bar is drawn only when enabled
(by default callers enable it when stderr is a terminal). Every step is drawn: the callers'
steps are coarse (a benchmark method, a transport check) or already rate-limited (weight
sync polls ten times a second).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

__all__ = ["ProgressBar"]


class ProgressBar:
    """A tqdm bar on stderr with an adjustable ``total``; does nothing when not ``enabled``.

    Args:
        total: Steps expected (may change while it runs: :attr:`total`).
        desc: What the bar is for (its prefix).
        unit: The name of one step.
        enabled: Draw it; when False every method is a no-op.
    """

    def __init__(self, total: int, *, desc: str, unit: str = "step", enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=sys.stderr, ascii=True, mininterval=0, miniters=1, leave=True
            )
        self._total = total
        self.done = 0

    @property
    def total(self) -> int:
        return self._total

    @total.setter
    def total(self, value: int) -> None:
        self._total = value
        if self._bar is not None:
            self._bar.total = value
            self._bar.refresh()

    def step(self, what: str = "", n: int = 1) -> None:
        """``n`` more steps done; ``what`` (the last one) is shown after the bar."""
        self.done += n
        if self._bar is not None:
            if what:
                self._bar.set_postfix_str(what[:60], refresh=False)
            self._bar.update(n)

    def advance_to(self, done: int, what: str = "") -> None:
        """Steps done so far is ``done`` (never goes back)."""
        if done > self.done:
            self.step(what, done - self.done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
