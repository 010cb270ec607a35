"""Driver side of groups: ``create_group`` and ``destroy_group`` over tensorwire actors.

The driver asks each actor for its agent's address (through Ray), decides the backend, then
makes all of them join at once through a hidden hook method of every ``@tw.remote`` class.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tensorwire.collectives.groups import channel
from tensorwire.collectives.groups import membership as groups
from tensorwire.collectives.groups.group import BACKENDS, Backend
from tensorwire.runtime.ray import calls
from tensorwire.runtime.ray.actor import ActorHandle
from tensorwire.runtime.ray.hooks import call_hook

__all__ = ["GroupInfo", "call_hook", "check_actors", "create_group", "describe_actors", "destroy_group"]

_created: dict[str, GroupInfo] = {}
_created_lock = threading.Lock()
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class GroupInfo:
    """A group as the driver made it; ``destroy()`` makes every live member leave."""

    name: str
    backend: Backend
    actors: tuple[ActorHandle, ...]

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def destroy(self, timeout_s: float = 30.0) -> list[int]:
        return destroy_group(self.name, timeout_s=timeout_s)


def check_actors(actors: Sequence[ActorHandle], what: str) -> tuple[ActorHandle, ...]:
    """``actors`` as a tuple; ``TypeError`` for anything not made with ``@tw.remote``,
    ``ValueError`` for an actor given twice (``what`` names the caller)."""
    actors = tuple(actors)
    for actor in actors:
        if not isinstance(actor, ActorHandle):
            raise TypeError(f"{what} takes actors made with @tw.remote, got {type(actor).__name__}")
    for i, actor in enumerate(actors):
        if any(calls.same_actor(actor, other) for other in actors[:i]):
            raise ValueError(f"{what}: an actor appears twice")
    return actors


def describe_actors(actors: Sequence[ActorHandle], timeout_s: float) -> list[tuple[bytes, int]]:
    """Each actor's agent (``Peer`` bytes) and GPU count, asked concurrently."""
    refs = [call_hook(actor, channel.describe_self) for actor in actors]
    return calls.gather(refs, timeout_s=timeout_s)


def _auto_backend(descriptions: Sequence[tuple[bytes, int]]) -> Backend:
    """nccl when every member sees a GPU (where NCCL serves best), else gloo."""
    return Backend.NCCL if all(gpus > 0 for _, gpus in descriptions) else Backend.GLOO


def create_group(
    actors: Sequence[ActorHandle],
    backend: Backend | str = "auto",
    name: str = "default",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> GroupInfo:
    """Make ``actors`` a group: actor ``i`` is rank ``i``; inside them ``get_group(name)``.

    Args:
        actors: Actors made with ``@tw.remote`` (at least one; each once).
        backend: "auto" (nccl when every member sees a GPU, else gloo), "nccl", "gloo", or
            "tensorwire" (our transports: shm/cuda_ipc on a node, relayed across nodes).
        name: The group's name; a process may be in several groups of different names.
        timeout_s: Deadline of joining and of every operation of the group.

    Raises:
        ValueError: Bad arguments, or a group of that name exists (destroy it first).
        TypeError: Something other than tensorwire actors.
        ray.exceptions.GetTimeoutError / RayActorError: A member did not join.
    """
    actors = check_actors(actors, "create_group")
    if not actors:
        raise ValueError("create_group needs at least one actor")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use auto, {', '.join(BACKENDS)}")
    if not isinstance(name, str) or not name or len(name) > 100:
        raise ValueError("a group name is a non-empty string of at most 100 characters")
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    with _created_lock:
        if name in _created:
            raise ValueError(f"group {name!r} exists; destroy_group({name!r}) first")
        _created[name] = GroupInfo(name, Backend.GLOO, actors)  # reserved while it forms
    try:
        descriptions = describe_actors(actors, timeout_s)
        chosen = _auto_backend(descriptions) if backend == "auto" else Backend(backend)
        channel_name = f"tw-group-{name}-{secrets.token_hex(6)}"  # messages of a re-made group never mix
        refs = [
            call_hook(actor, groups.join, name, channel_name, rank, descriptions, chosen, timeout_s)
            for rank, actor in enumerate(actors)
        ]
        calls.gather(refs, timeout_s=timeout_s + 5.0)
    except BaseException:
        _leave_all(name, actors, timeout_s=10.0)
        with _created_lock:
            _created.pop(name, None)
        raise
    info = GroupInfo(name, chosen, actors)
    with _created_lock:
        _created[name] = info
    return info


def _leave_all(name: str, actors: Sequence[ActorHandle], *, timeout_s: float) -> list[int]:
    """Ask every actor to leave ``name``; the ranks that could not be asked (dead)."""
    refs = [call_hook(actor, groups.leave, name) for actor in actors]
    unreachable = []
    for rank, ref in enumerate(refs):
        outcome = calls.settle(ref, timeout_s=timeout_s)
        if outcome.failure in (calls.CallFailure.ACTOR_DIED, calls.CallFailure.TIMED_OUT):
            unreachable.append(rank)
        elif not outcome.ok and outcome.error is not None:
            raise outcome.error
    return unreachable


def destroy_group(name: str = "default", *, timeout_s: float = 30.0) -> list[int]:
    """Make every live member leave group ``name`` (members that died are skipped), so that
    the name can be used again. Returns the ranks that could not be reached.

    Raises:
        ValueError: This driver made no group of that name.
    """
    with _created_lock:
        info = _created.get(name)
    if info is None:
        raise ValueError(f"no group named {name!r} was created here")
    unreachable = _leave_all(name, info.actors, timeout_s=timeout_s)
    with _created_lock:
        _created.pop(name, None)
    return unreachable
