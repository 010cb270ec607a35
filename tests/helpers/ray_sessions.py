"""Local Ray instances of the tests: one shared by the modules that ask for ``ray_local``, and
sessions a test starts of its own.

Starting a local Ray instance and stopping it again costs about 5 s on the 2-core machine. The
modules that ask for ``ray_local`` share one instance, started by the first of them. It is
stopped (``stop_shared_ray``) before a module that does not ask for it (the root conftest runs
those modules first in their directory, so the instance starts once per directory), before any
test starts a Ray instance of its own (``ray_session``), and after a module in which a test
failed (a failure's traceback keeps that module's actor handles, so its actors would live on).
Between the modules that share it, a module's actors go when its fixtures are torn down and
their handles collected.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

# what tensorwire's Ray start-up derives into the environment, restored after a session
RAY_DERIVED_ENV = ("TENSORWIRE_NODE_ID", "TENSORWIRE_HOST", "TENSORWIRE_CLUSTER_TOKEN")

_shared: contextlib.ExitStack | None = None  # the running shared instance: how to stop it


@contextlib.contextmanager
def _fresh_agent() -> Iterator[None]:
    """A fresh agent and process set-up on loopback addresses; the environment and the agent
    restored afterwards."""
    from tensorwire.runtime.ray import env as ray_env
    from tensorwire.transport.agent.core import shutdown_agent

    saved = {k: os.environ.get(k) for k in RAY_DERIVED_ENV}
    os.environ["TENSORWIRE_HOST"] = "127.0.0.1"  # tests talk over loopback only
    gc.collect()
    shutdown_agent()
    ray_env._configured_pid = 0  # set up again for this session, whatever the last one left
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


@contextlib.contextmanager
def ray_session() -> Iterator[None]:
    """Around a Ray session the caller starts and stops itself in this process: the shared
    instance is stopped first, and the agent is fresh inside (``_fresh_agent``)."""
    stop_shared_ray()
    with _fresh_agent():
        yield


def stop_shared_ray() -> None:
    """Stop the instance the ``ray_local`` modules share, if it runs."""
    global _shared
    stack, _shared = _shared, None
    if stack is not None:
        stack.close()


def ensure_shared_ray() -> None:
    """Start the shared instance unless it runs."""
    import ray

    if _shared is not None and ray.is_initialized():
        return
    stop_shared_ray()
    _start_shared_ray()


def _start_shared_ray() -> None:
    global _shared
    import ray

    import tensorwire as tw

    with contextlib.ExitStack() as stack:
        stack.enter_context(_fresh_agent())
        stack.callback(ray.shutdown)  # before the start: a start that fails half-way is stopped too
        tw.init(address="local", num_cpus=4, include_dashboard=False)
        stack.callback(gc.collect)  # first when stopping: what the last module left goes before Ray
        _shared = stack.pop_all()
