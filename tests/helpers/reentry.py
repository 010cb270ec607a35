"""Run a call as a reference's finalizer would find it: interrupted by the garbage collector.

Finalizers of tensorwire references free objects and close mappings, and the collector runs
them on whichever thread allocates when a collection is due, possibly a thread already inside
the lock such a finalizer takes. :func:`collector_reenters` makes that happen on purpose.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable
from types import CodeType
from typing import Any


def _holds(lock: Any) -> bool:
    if lock is None:
        return True
    return lock._is_owned() if hasattr(lock, "_is_owned") else lock.locked()  # RLock or Lock


def _inside(code: CodeType) -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None


def collector_reenters(
    call: Callable[[], object],
    *,
    inside: Callable[..., object] | CodeType,
    lock: Any,
    reenter: Callable[[], object],
) -> tuple[bool, bool]:
    """Run ``call()`` on a thread, collecting at every allocation; the first collection that
    starts on it while it runs ``inside`` (a function, or a code object such as a loop's
    generator) holding ``lock`` (None: any time inside) runs ``reenter()`` there first.
    Returns (whether that happened, whether ``call`` returned within 20 s)."""
    entered: list[bool] = []
    done = threading.Event()
    code = inside if isinstance(inside, CodeType) else inside.__code__

    def meanwhile(phase: str, _info: dict) -> None:
        if phase == "start" and not entered and _holds(lock) and _inside(code):
            entered.append(True)
            reenter()

    worker = threading.Thread(target=lambda: (call(), done.set()), daemon=True)  # a blocked one is left
    threshold = gc.get_threshold()
    gc.callbacks.append(meanwhile)
    gc.set_threshold(1)
    try:
        worker.start()
        worker.join(20)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(meanwhile)
    return bool(entered), done.is_set()
