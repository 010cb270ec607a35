"""Ray start-up for ``tensorwire.init``: start a local Ray instance or join a cluster."""

from __future__ import annotations

import logging
import os
from typing import Any

from tensorwire.runtime.ray.env import configure_process

__all__ = ["init"]

logger = logging.getLogger(__name__)

_RAY_START_ATTEMPTS = 3


def _start_ray(ray: Any, address: str | None, kwargs: dict[str, Any]) -> None:
    """``ray.init``, tried again when a local instance it starts times out during start-up.

    Ray gives a new local node a fixed 30 s to register with its GCS, and the GCS 30 s to
    publish its port; on a loaded machine (seen in the suite's load run) either can be missed
    and ``ray.init`` raises. Joining
    an existing cluster is not retried."""
    starts_local = address in (None, "local") and not os.environ.get("RAY_ADDRESS")
    for attempt in range(1, _RAY_START_ATTEMPTS + 1):
        try:
            ray.init(address=address, **kwargs)
            return
        except Exception as e:
            timed_out = "timed out during startup" in str(e) or "gcs_server_port" in str(e)  # raylet / GCS
            if not starts_local or not timed_out or attempt == _RAY_START_ATTEMPTS:
                raise
            logger.warning("Ray's local node timed out during start-up (attempt %d); starting it again", attempt)
            ray.shutdown()


def init(address: str | None = None, **ray_init_kwargs: Any) -> None:
    """Start a local Ray instance (the embedded default) or join the cluster at ``address``.

    When Ray is already initialized in this process it is used as it is (the keyword
    arguments are then ignored). Call ``init`` before creating references in the driver:
    the driver's agent takes its node id, address and cluster token from Ray.

    Args:
        address: A Ray address (``"auto"``, ``"ray://..."``); None starts a local instance
            unless ``RAY_ADDRESS`` is set.
        **ray_init_kwargs: Passed to ``ray.init`` (``num_cpus``, ``include_dashboard``, ...).

    Raises:
        RuntimeError: This process already owns references made before ``init``.
    """
    import ray

    from tensorwire.runtime.ray import transport as ray_transport
    from tensorwire.transport.agent import current_agent, shutdown_agent

    ray_transport.register()  # before the user creates actors (Ray's rule for custom transports)
    if not ray.is_initialized():
        _start_ray(ray, address, ray_init_kwargs)
    existing = current_agent()
    expected_node_id = os.environ.get("TENSORWIRE_NODE_ID") or ray.get_runtime_context().get_node_id()
    if existing is not None and existing.peer.node_id != expected_node_id:
        if existing.owned_objects():
            raise RuntimeError(
                "tensorwire.init() must come before the first tensorwire.put() in this process: "
                f"{existing.owned_objects()} object(s) are already owned by an agent started outside Ray"
            )
        shutdown_agent()
    configure_process()
