"""Actor hooks: functions the layers above the runtime run inside tensorwire actors.

Collectives (joining a group, syncing weights) need code of theirs to run inside the user's
actors. Every ``@tw.remote`` class has one hidden method (:data:`HOOK_METHOD`) that runs a
*registered* hook: a module-level function ``fn(actor, *args, **kwargs)`` decorated with
:func:`actor_hook`. The driver names it by the function itself (:func:`call_hook`); the actor
gets its :class:`HookKey` and runs what its registry holds under that key, loading the hook's
module first when this process has not imported it yet (only modules of the ``tensorwire``
package). Anything else is refused, so the hidden method cannot run arbitrary functions.

A hook runs in the actor's own order, after the calls queued before it
(:func:`call_hook`), or beside them in the actor's ``tensorwire`` concurrency group
(:data:`HOOK_GROUP`, which every ``@tw.remote`` class has: :func:`call_hook_concurrently`),
for work that must go on while the actor runs the user's methods (a trainer serving a push
while it trains the next step).

The runtime does not import the collectives: they fill the registry when imported.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "HOOK_GROUP",
    "HOOK_GROUP_THREADS",
    "HOOK_METHOD",
    "HookKey",
    "actor_hook",
    "call_hook",
    "call_hook_concurrently",
    "hook_key",
    "run_hook",
]

HOOK_METHOD = "_tw_hook"
HOOK_GROUP = "tensorwire"  # the concurrency group of hooks that run beside the user's methods
HOOK_GROUP_THREADS = 2
_PACKAGE = "tensorwire."

F = TypeVar("F", bound=Callable[..., Any])


class HookKey(NamedTuple):
    """What the driver sends to name a hook: its module and function name."""

    module: str
    name: str


_registry: dict[HookKey, Callable[..., Any]] = {}
_lock = threading.Lock()


def actor_hook(fn: F) -> F:
    """Decorator: register ``fn(actor, *args, **kwargs)`` as a hook (returns ``fn`` unchanged)."""
    key = HookKey(fn.__module__, fn.__qualname__)
    if not key.module.startswith(_PACKAGE) or "." in key.name or "<" in key.name:
        raise ValueError(f"an actor hook is a module-level function of the tensorwire package, not {key!r}")
    with _lock:
        _registry[key] = fn
    return fn


def hook_key(fn: Callable[..., Any]) -> HookKey:
    """The key of registered hook ``fn`` (driver side); ``ValueError`` for anything else."""
    key = HookKey(getattr(fn, "__module__", "") or "", getattr(fn, "__qualname__", "") or "")
    with _lock:
        registered = _registry.get(key) is fn
    if not registered:
        raise ValueError(f"{fn!r} is not a registered actor hook; decorate it with @actor_hook")
    return key


def run_hook(actor: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
    """Inside an actor: run hook ``key`` (a :class:`HookKey`) on ``actor``."""
    if not isinstance(key, tuple) or len(key) != 2 or not all(isinstance(part, str) for part in key):
        raise ValueError(f"not a tensorwire hook: {key!r} (the driver sends a HookKey)")
    key = HookKey(*key)
    with _lock:
        fn = _registry.get(key)
    if fn is None and key.module.startswith(_PACKAGE):
        try:
            importlib.import_module(key.module)  # a module of the package registers its hooks when imported
        except ImportError as e:
            raise ValueError(f"not a tensorwire hook: {key!r} ({e})") from None
        with _lock:
            fn = _registry.get(key)
    if fn is None:
        raise ValueError(
            f"not a tensorwire hook: {key.module}.{key.name} is not registered (did its module decorate it with "
            "@actor_hook?)"
        )
    return fn(actor, *args, **kwargs)


def call_hook(actor: Any, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Driver: start ``hook(<the actor>, *args, **kwargs)`` inside tensorwire actor ``actor``;
    returns Ray's ``ObjectRef`` of its result (wait with :mod:`tensorwire.runtime.ray.calls`)."""
    key = hook_key(hook)
    return getattr(actor.ray_handle, HOOK_METHOD).remote(tuple(key), *args, **kwargs)


def call_hook_concurrently(actor: Any, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """:func:`call_hook` in the actor's :data:`HOOK_GROUP`: it runs while the actor runs other
    calls (its own methods, one at a time by default), not after them."""
    key = hook_key(hook)
    method = getattr(actor.ray_handle, HOOK_METHOD).options(concurrency_group=HOOK_GROUP)
    return method.remote(tuple(key), *args, **kwargs)
