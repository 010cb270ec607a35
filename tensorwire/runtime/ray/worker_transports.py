"""Run-time transport registrations reach the Ray actors and tasks started after them.

``tensorwire.transport.register_transport()`` changes only the calling process's registry.
When this process starts a Ray actor or task, the registrations it made (those importable by
``module:Class``) travel in the actor's or task's ``runtime_env`` as the
``TENSORWIRE_TRANSPORTS`` variable, which the registry of the worker reads on first use.
Transports of installed distributions (the ``tensorwire.transports`` entry points) need
nothing: every process finds them. With no run-time registration the options are untouched,
so Ray reuses its pooled workers as before.
"""

from __future__ import annotations

import os
from typing import Any

from tensorwire.transport import registry

__all__ = ["with_registrations"]


def _parse(value: str) -> dict[str, str]:
    pairs = (item.partition("=") for item in value.split(",") if "=" in item)
    return {name.strip(): target.strip() for name, _, target in pairs}


def with_registrations(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (Ray actor or task options) with this process's run-time registrations
    added to ``runtime_env["env_vars"]`` (merged with what the caller or this process's own
    environment already carries); ``options`` itself when there are none."""
    registrations = registry.runtime_registrations()
    if not registrations:
        return options
    runtime_env = dict(options.get("runtime_env") or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    inherited = {**_parse(os.environ.get(registry.ENV, "")), **_parse(env_vars.get(registry.ENV, ""))}
    env_vars[registry.ENV] = registry.encode_env({**inherited, **registrations})
    runtime_env["env_vars"] = env_vars
    return {**options, "runtime_env": runtime_env}
