"""NIXL's Python API and its agents as tensorwire makes them, for the ``nixl`` transport and its
``doctor`` report (each process's transport agent is :func:`.agent.process_agent`). The bench's
bare NIXL baseline makes its own, the same way (``tensorwire/bench/bare_nixl.py``)."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Sequence
from typing import Any

from tensorwire.errors import TransportUnavailableError
from tensorwire.transport.config import ucxx_settings_hidden

__all__ = ["API_MODULES", "BACKENDS_ENV", "new_agent", "nixl_api"]

BACKENDS_ENV = "TENSORWIRE_NIXL_BACKENDS"
API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_PROGRESS_US = int(os.environ.get("TENSORWIRE_NIXL_PROGRESS_US", "1000"))  # progress thread's pause (NIXL's: 0, a spin)
_making = threading.Lock()


def nixl_api() -> Any:
    """NIXL's Python API module (``nixl._api``, else ``nixl_cu12._api``, else ``nixl_cu13._api``)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # else NIXL prints INFO lines to stdout
    for name in API_MODULES:
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    raise TransportUnavailableError("nixl: NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)")


def new_agent(name: str, wanted: Sequence[str] = ()) -> Any:
    """A NIXL agent with ``wanted`` backends (default ``TENSORWIRE_NIXL_BACKENDS``, else ``UCX``) whose progress
    thread pauses ``TENSORWIRE_NIXL_PROGRESS_US`` between polls (NIXL's default spins a core)."""
    api = nixl_api()
    wanted = list(wanted) or [b.strip() for b in os.environ.get(BACKENDS_ENV, "UCX").split(",") if b.strip()] or ["UCX"]
    sync = getattr(api, "nixl_thread_sync_t", None)  # tensorwire fetches and exports from several threads
    config = api.nixl_agent_config(backends=wanted, **({"sync_mode": sync.NIXL_THREAD_SYNC_RW} if sync else {}))
    with _making, ucxx_settings_hidden():  # the API's constructor, patched meanwhile: one agent at a time
        bind, make = api.nixlBind, api.nixlBind.nixlAgent
        bind.nixlAgent = lambda agent_name, c: (setattr(c, "pthrDelay", _PROGRESS_US), make(agent_name, c))[1]
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgent = make
