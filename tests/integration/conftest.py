"""A local Ray instance shared by the integration tests of one module."""

from __future__ import annotations

import gc
import os

import pytest

RAY_ENV = ("TENSORWIRE_NODE_ID", "TENSORWIRE_HOST", "TENSORWIRE_CLUSTER_TOKEN")


@pytest.fixture(scope="module")
def ray_local():
    """``tw.init`` on a fresh local Ray (no dashboard); shut down, environment restored, after."""
    import ray

    import tensorwire as tw
    from tensorwire.runtime import ray_env
    from tensorwire.transport.agent import shutdown_agent

    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ["TENSORWIRE_HOST"] = "127.0.0.1"  # tests talk over loopback only
    gc.collect()
    shutdown_agent()
    tw.init(num_cpus=4, include_dashboard=False)
    yield ray
    gc.collect()
    shutdown_agent()
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    ray_env._configured_pid = 0
