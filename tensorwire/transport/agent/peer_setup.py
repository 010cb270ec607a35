"""The per-peer connection step of one-sided transports (``Capabilities.peer_setup``).

A one-sided transport that needs state about a producer before it can read from it (NIXL's
agent metadata, an RDMA key table) declares ``peer_setup``. Every process publishes the
transport's ``connection_info()`` in its ``PeerInfo.transport_info`` when the transport starts
(and newer info when the transport publishes it); a consumer calls ``load_peer(owner, info)``
once per (transport, producer), on its first fetch from that producer, with no control call:
the info travels in the producer's ``PeerInfo``, which every reference carries as the owner was
when the reference left (or, for a handle exported on request, in the ``Export`` reply).
Success is cached until the producer is forgotten; a failure is not cached (the next fetch
tries again) and the fetch falls back to another transport.
"""

from __future__ import annotations

import logging
import threading

from tensorwire.errors import TensorwireError, TransportUnavailableError
from tensorwire.transport.contract import PeerInfo, Transport, TransportContext

__all__ = ["PeerSetup"]

logger = logging.getLogger(__name__)


class PeerSetup:
    """One agent's loaded peers per transport; thread-safe, one load per key at a time."""

    def __init__(self, context: TransportContext) -> None:
        self._context = context
        self._lock = threading.Lock()
        self._loaded: set[tuple[str, str]] = set()  # (transport, agent id)
        self._loading: dict[tuple[str, str], threading.Lock] = {}

    def publish(self, transport: Transport) -> str | None:
        """Any process, when ``transport`` starts: publish its connection info; returns why it
        is unusable here (its ``connection_info`` failed), or None."""
        try:
            info = transport.connection_info()
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not break the agent
            return f"connection_info() failed: {type(e).__name__}: {e}"
        self._context.publish_transport_info(transport.name, info)
        return None

    def ensure(self, transport: Transport, owner: PeerInfo) -> None:
        """Consumer, before a fetch from ``owner``: load its info once (blocks while loading).

        Raises:
            TransportUnavailableError: ``owner`` published no info for the transport, or
                ``load_peer`` failed (the fetch falls back to the next transport).
        """
        key = (transport.name, owner.agent_id)
        if key in self._loaded or owner.agent_id == self._context.peer.agent_id:
            return
        with self._lock:
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:
            if key in self._loaded:
                return
            info = dict(owner.transport_info).get(transport.name)
            if info is None:
                raise TransportUnavailableError(
                    f"{transport.name}: agent {owner.agent_id} published no connection info for it"
                )
            try:
                transport.load_peer(owner, info)
            except TensorwireError:
                raise
            except Exception as e:
                raise TransportUnavailableError(
                    f"{transport.name}: loading the connection info of agent {owner.agent_id} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
            with self._lock:
                self._loaded.add(key)
                self._loading.pop(key, None)
            logger.debug("%s: loaded the connection info of agent %s", transport.name, owner.agent_id)

    def loaded(self, transport: str, agent_id: str) -> bool:
        """Whether this process loaded ``agent_id``'s info for ``transport``."""
        return (transport, agent_id) in self._loaded

    def forget(self, agent_id: str) -> None:
        """The agent learned that ``agent_id`` is gone: its loads are forgotten."""
        with self._lock:
            self._loaded = {k for k in self._loaded if k[1] != agent_id}
            for key in [k for k in self._loading if k[1] == agent_id]:
                self._loading.pop(key, None)
