"""The per-process agent: one per process, started lazily by :func:`get_agent`.

Its parts, one responsibility each: the object store (:mod:`.store`), the holder protocol
(:mod:`.holders`, :mod:`.outbox`), the control service and its client (:mod:`.control`,
:mod:`.service`, :mod:`.peer_client`, :mod:`.wire`), fetch dispatch and destinations
(:mod:`.fetch`, :mod:`.destinations`), the rendezvous mailbox (:mod:`.rendezvous`), the loaded
transports (:mod:`.instances`, :mod:`.peer_setup`) and transfer records (:mod:`.metrics`).
:mod:`.core` puts them together. What the agent offers the layers above is
:class:`AgentServices`; what it offers transports is
:class:`tensorwire.transport.contract.TransportContext`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorwire.transport.agent.core import Agent, add_startup_hook, current_agent, get_agent, shutdown_agent
    from tensorwire.transport.agent.metrics import TransferRecord, add_observer
    from tensorwire.transport.agent.services import AgentServices

__all__ = [
    "Agent",
    "AgentServices",
    "TransferRecord",
    "add_observer",
    "add_startup_hook",
    "current_agent",
    "get_agent",
    "shutdown_agent",
]

_LAZY = {
    "Agent": "core",
    "add_startup_hook": "core",
    "current_agent": "core",
    "get_agent": "core",
    "shutdown_agent": "core",
    "AgentServices": "services",
    "TransferRecord": "metrics",
    "add_observer": "metrics",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorwire.transport.agent' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tensorwire.transport.agent.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
