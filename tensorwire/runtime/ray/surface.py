"""Every part of Ray that tensorwire uses beyond Ray's documented API, in one place.

Aim: none. What remains, each verified on Ray 2.60 (``tests/integration/test_ray_surface.py``
fails naming the attribute if a Ray release changes it):

* ``ActorHandle.__ray_call__`` (a developer method Ray gives every actor so that libraries can
  run a function in it, ray-project/ray#41534), in the ``_ray_system`` concurrency group that
  Ray gives actors with tensor transport enabled (its own transports use both the same way).
  Used once per actor handle by the registered transport (``actor_has_tensor_transport`` for
  producers, ``get_communicator_metadata`` for readers).
* ``ActorHandle.__ray_terminate__`` and ``__ray_ready__`` (developer methods), reached
  through tensorwire's handles as through Ray's.
* ``__ray_invocation_decorator__`` on an actor method (the decorator hook Ray applies in the
  caller) and the ``__ray_*__`` option attributes that ``@ray.method(...)`` sets on a method
  (kept when ``@tw.remote`` wraps the method).
* ``ActorHandle.__dict__`` and its ``_ray_weak_ref`` entry (private): a ``tw.ActorHandle`` is
  also a ``ray.actor.ActorHandle`` sharing the Ray handle's state, marked as not counting
  (:func:`share_handle_state`, for ``make_handle`` in ``runtime/ray/handles.py``), so that
  ``ray.kill``, ``isinstance`` and Ray's own calls take it. The one private access left, and
  made here only.

Nothing in the package walks the caller's stack (``tests/test_layout.py`` checks): a
``@tw.method`` is Ray's ``@ray.method(tensor_transport="tensorwire")`` and its results are
Ray's own references (``runtime/ray/transport.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["RAY_VERSIONS_VERIFIED", "SURFACE", "run_on_actor", "share_handle_state", "start_on_actor"]

RAY_VERSIONS_VERIFIED = ("2.60",)

SURFACE = {
    "ActorHandle.__ray_call__": "run a function in an actor (registered transport: actor check)",
    "ActorHandle.__ray_terminate__": "reached through tensorwire handles",
    "ActorHandle.__ray_ready__": "reached through tensorwire handles",
    "method.__ray_invocation_decorator__": "tw.remote methods: the caller-side hook",
    "ActorHandle.__dict__ / _ray_weak_ref": "tw.ActorHandle shares a Ray handle's state (private)",
}


def run_on_actor(actor: Any, fn: Callable[[Any], Any], *, timeout_s: float) -> Any:
    """``fn(actor_instance)`` run in ``actor``'s system thread; its result.

    Raises:
        ray.exceptions.RayActorError: The actor is dead.
        ray.exceptions.GetTimeoutError: No answer within ``timeout_s``.
    """
    import ray

    return ray.get(start_on_actor(actor, fn), timeout=timeout_s)


def start_on_actor(actor: Any, fn: Callable[[Any], Any]) -> Any:
    """Queue ``fn(actor_instance)`` on ``actor``'s system thread without waiting; Ray's
    ``ObjectRef`` of its result (calls from one process run there in the order queued)."""
    return actor.__ray_call__.options(concurrency_group="_ray_system").remote(fn)


def share_handle_state(handle: Any, ray_handle: Any) -> None:
    """Make ``handle`` (an instance of a subclass of ``ray.actor.ActorHandle``) share
    ``ray_handle``'s state, marked as not counting towards Ray's handles of the actor (the
    caller keeps ``ray_handle`` itself, which does)."""
    handle.__dict__.update(ray_handle.__dict__)
    handle.__dict__["_ray_weak_ref"] = True
