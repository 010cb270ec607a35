"""The transports an agent has loaded: one instance per usable registered transport.

The agent keeps one :class:`LoadedTransports`. It instantiates registered transports once
(a transport that cannot run here is remembered with its reason and not tried again), caches
every registered transport's capabilities and cost model for the selector, publishes the
connection info of one-sided transports with a per-peer step (``peer_setup``), and notices
registry changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tensorwire.transport import registry
from tensorwire.transport.agent.peer_setup import PeerSetup
from tensorwire.transport.contract import Capabilities, CostModel, Transport, TransportContext

__all__ = ["LoadedTransports"]

logger = logging.getLogger(__name__)


class LoadedTransports:
    """The usable transport instances of one agent, by registry name (thread-safe reads).

    Args:
        context: What each transport is created with (the agent).
    """

    def __init__(self, context: TransportContext) -> None:
        self._context = context
        self._instances: dict[str, Transport] = {}
        self._unusable: dict[str, str] = {}
        self.capabilities: dict[str, Capabilities] = {}
        self.cost_models: dict[str, CostModel | None] = {}
        self.peer_setup = PeerSetup(context)
        self.version = -1

    def stale(self) -> bool:
        """Whether transports were registered or unregistered since the last :meth:`refresh`."""
        return registry.version() != self.version

    def refresh(self) -> None:
        """Instantiate newly registered transports, cache every registered transport's
        capabilities, and close the instances of transports no longer registered."""
        self.version = registry.version()
        names = registry.registered_transports()
        capabilities: dict[str, Capabilities] = {}
        cost_models: dict[str, CostModel | None] = {}
        for name in names:
            try:
                cls = registry.get_transport_class(name)
            except Exception:  # noqa: BLE001 - a broken plug-in is simply not a candidate
                continue
            capabilities[name], cost_models[name] = cls.capabilities, cls.cost_model
        self.capabilities, self.cost_models = capabilities, cost_models
        for name in names:
            if name in self._instances or name in self._unusable:
                continue
            try:
                transport = registry.get_transport_class(name)(self._context)
                reason = transport.unavailable_reason()
                if reason is None and transport.capabilities.peer_setup:
                    reason = self.peer_setup.publish(transport)
            except Exception as e:  # noqa: BLE001 - a broken plug-in must not break the agent
                reason = f"failed to load: {type(e).__name__}: {e}"
            if reason is None:
                self._instances[name] = transport
            else:
                self._unusable[name] = reason
                logger.debug("transport %s not usable here: %s", name, reason)
        for name in list(self._instances):
            if name not in names:
                self._instances.pop(name).close()

    def names(self) -> tuple[str, ...]:
        """The usable transports, in registry order."""
        return tuple(self._instances)

    def get(self, name: str) -> Transport | None:
        """The instance of ``name``, or None when it is not usable (or not registered)."""
        return self._instances.get(name)

    def __getitem__(self, name: str) -> Transport:
        return self._instances[name]

    def __contains__(self, name: object) -> bool:
        return name in self._instances

    def usable(self) -> dict[str, Transport]:
        """A copy of the usable instances, by name."""
        return dict(self._instances)

    def unusable(self) -> dict[str, str]:
        """Registered transports that cannot run here, with the reason."""
        return dict(self._unusable)

    def forget_peer(self, agent_id: str) -> None:
        """The agent learned that ``agent_id`` is gone: every transport (and the per-peer
        step's cache) drops what is tied to it."""
        self.each(f"forget agent {agent_id}", lambda t: t.forget_peer(agent_id))
        self.peer_setup.forget(agent_id)  # after: a load meanwhile is forgotten too, not kept as loaded

    def each(self, what: str, action: Callable[[Transport], None], *, level: int = logging.WARNING) -> None:
        """``action(transport)`` for every instance; a transport that raises is logged
        (``what`` names the step) and the others still run."""
        for transport in list(self._instances.values()):
            try:
                action(transport)
            except Exception:
                logger.log(level, "transport %s failed to %s", transport.name, what, exc_info=True)
