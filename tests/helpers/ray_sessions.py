"""Local Ray instances of the tests: one shared by the modules that ask for ``ray_local``, and
sessions of a test's own.

Starting a local Ray instance and stopping it again costs about 5 s on the 2-core machine. The
modules that ask for ``ray_local`` share one instance, started by the first of them and stopped
by ``stop_shared_ray``: before a module that does not ask for it (the root conftest runs those
modules first in their directory, so the shared instance starts once per directory) and before
any test starts a Ray instance of its own (``ray_session``). Between the modules that share it,
the actors of the module that ended go with their handles (its module fixtures are torn down
first, then collected).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

RAY_ENV = ("TENSORWIRE_NODE_ID", "TENSORWIRE_HOST", "TENSORWIRE_CLUSTER_TOKEN")

_shared: list[contextlib.ExitStack] = []  # the running shared instance, if any


@contextlib.contextmanager
def _fresh_agent() -> Iterator[None]:
    """A fresh agent, loopback addresses, and the environment and agent restored afterwards."""
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


@contextlib.contextmanager
def ray_session() -> Iterator[None]:
    """Around a Ray session of the caller's own in this process (the caller starts and stops
    Ray inside): the shared instance stopped first, then as ``_fresh_agent``."""
    stop_shared_ray()
    with _fresh_agent():
        yield


def stop_shared_ray() -> None:
    """Stop the instance the ``ray_local`` modules share, if it runs."""
    while _shared:
        _shared.pop().close()


def _start_shared_ray() -> None:
    import ray

    import tensorwire as tw

    with contextlib.ExitStack() as stack:
        stack.enter_context(_fresh_agent())
        tw.init(address="local", num_cpus=4, include_dashboard=False)
        stack.callback(ray.shutdown)
        stack.callback(gc.collect)  # before the shutdown: what the last module left goes first
        _shared.append(stack.pop_all())


def shared_ray() -> None:
    """The shared instance, started if it does not run."""
    import ray

    if not _shared or not ray.is_initialized():
        stop_shared_ray()
        _start_shared_ray()
