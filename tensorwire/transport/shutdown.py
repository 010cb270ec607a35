"""Bounded shutdown: a close step that a native library keeps blocked never blocks exit.

Closing a transport may call into a native library (ucxx, gloo, NCCL) whose own shutdown can
block. Each such step runs on a daemon thread and is waited for a bounded time; if it has not
finished by then, a warning names what was left behind and the caller goes on, so that the
process can still exit (a daemon thread stuck in native code does not keep it alive).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["CLOSE_TIMEOUT_S", "run_bounded"]

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # per close step; a healthy step takes milliseconds


def run_bounded(step: Callable[[], None], *, what: str, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
    """Run ``step`` on a daemon thread and wait at most ``timeout_s`` for it.

    Called by whoever closes something (the agent, a group, a weight sync); blocks for at most
    ``timeout_s``. Returns True when the step finished (an exception it raised is logged, not
    raised: a close must not fail the caller), False when it was left running, with a warning
    naming ``what``.
    """
    done = threading.Event()

    def run() -> None:
        try:
            step()
        except Exception:
            logger.warning("%s failed", what, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=run, name=f"tensorwire-close-{what}", daemon=True).start()
    if done.wait(timeout_s):
        return True
    logger.warning(
        "%s did not finish within %.1f s; leaving it behind (its thread may still run in native code)",
        what,
        timeout_s,
    )
    return False
