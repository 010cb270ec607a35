"""Short full passes of Python's cyclic garbage collector in tensorwire actors.

A full collection (generation 2) walks every object the process tracks, with the GIL held: in
a Ray actor with torch and gRPC imported that is about 220,000 objects, 90-103 ms on the 2-core
machine. Python starts one whenever enough objects have survived since the last, so now and
then one falls inside a weight-sync push, and every member waiting for that process waits
with it (measured: a trainer's 103 ms pass in the middle of a failover's second try).

At its first method call or hook (after its ``__init__``), a tensorwire actor collects once
(what ``__init__`` left as garbage is freed) and moves the objects it has then (imported
modules, its own state: long-lived) to the collector's permanent generation (``gc.freeze()``):
full collections no longer walk them, and take a few ms. That first call pays one full
collection. Reference counting still frees the frozen objects as usual; only reference cycles
among them that become garbage later (a model replaced whose modules point at each other) are
never collected. ``TENSORWIRE_GC_FREEZE=0`` in the actor's environment leaves the collector as
it is. The driver (the user's program) is left alone.
"""

from __future__ import annotations

import gc
import os
import threading

__all__ = ["FREEZE_ENV", "freeze_at_first_call"]

FREEZE_ENV = "TENSORWIRE_GC_FREEZE"  # "0": leave the collector alone in tensorwire actors

_frozen_pid = 0
_lock = threading.Lock()


def freeze_at_first_call() -> None:
    """Actor, at every call: the first time in this process, collect, then move the objects it
    has to the permanent generation (not when ``TENSORWIRE_GC_FREEZE`` is ``0``)."""
    global _frozen_pid
    if _frozen_pid == os.getpid():
        return
    with _lock:
        if _frozen_pid == os.getpid():
            return
        if os.environ.get(FREEZE_ENV, "1").strip() != "0":
            gc.collect()  # garbage left now would stay forever once frozen
            gc.freeze()
        _frozen_pid = os.getpid()
