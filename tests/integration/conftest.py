"""A local Ray instance shared by the integration tests of one module."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

import pytest

RAY_ENV = ("TENSORWIRE_NODE_ID", "TENSORWIRE_HOST", "TENSORWIRE_CLUSTER_TOKEN")


@contextlib.contextmanager
def ray_session() -> Iterator[None]:
    """Around a Ray session in this process: a fresh agent, loopback addresses, and the
    environment and agent restored afterwards (the caller starts and stops Ray inside)."""
    from tensorwire.runtime import ray_env
    from tensorwire.transport.agent.core import shutdown_agent

    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ["TENSORWIRE_HOST"] = "127.0.0.1"  # tests talk over loopback only
    gc.collect()
    shutdown_agent()
    try:
        yield
    finally:
        gc.collect()
        shutdown_agent()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        ray_env._configured_pid = 0


@pytest.fixture(scope="module")
def ray_local():
    """``tw.init`` on a fresh local Ray (no dashboard), shut down after the module."""
    import ray

    import tensorwire as tw

    with ray_session():
        tw.init(address="local", num_cpus=4, include_dashboard=False)
        try:
            yield ray
        finally:
            gc.collect()
            ray.shutdown()
