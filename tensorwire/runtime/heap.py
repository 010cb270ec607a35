"""Short full passes of Python's cyclic garbage collector in tensorwire actors.

A full collection (generation 2) walks every object the process tracks, with the GIL held: in
a Ray actor with torch and gRPC imported that is about 220,000 objects, 90-100 ms on the 2-core
machine. Python starts one whenever enough objects have survived since the last, so now and
then one falls inside a weight-sync push, and every member waiting for that process waits
with it (measured: a trainer's 100 ms pass in the middle of a failover's second try).

At its first method call or hook (after its ``__init__``), a tensorwire actor moves the objects
it has then (imported modules, its own state: long-lived) to the collector's permanent
generation (``gc.freeze()``): full collections no longer walk them, and take a few ms.
Reference counting still frees them as usual; only reference cycles among them that become
garbage later stay uncollected. ``TENSORWIRE_GC_FREEZE=0`` in the actor's environment leaves
the collector as it is. The driver (the user's program) is left alone.
"""

from __future__ import annotations

import gc
import os
import threading

__all__ = ["FREEZE_ENV", "freeze_startup_objects"]

FREEZE_ENV = "TENSORWIRE_GC_FREEZE"  # "0": leave the collector alone in tensorwire actors

_frozen_pid = 0
_lock = threading.Lock()


def freeze_startup_objects() -> None:
    """Actor: move the objects this process has now to the permanent generation (once per
    process; not when ``TENSORWIRE_GC_FREEZE`` is ``0``)."""
    global _frozen_pid
    if _frozen_pid == os.getpid():
        return
    with _lock:
        if _frozen_pid == os.getpid():
            return
        if os.environ.get(FREEZE_ENV, "1").strip() != "0":
            gc.freeze()
        _frozen_pid = os.getpid()
