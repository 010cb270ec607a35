"""The groups this process is a member of: the join and leave hooks the driver calls
(:mod:`tensorwire.collectives.groups.api`), and ``tw.collective.get_group(name)`` inside an actor."""

from __future__ import annotations

import threading

from tensorwire.collectives.groups.channel import member_from
from tensorwire.collectives.groups.group import Backend, Group
from tensorwire.collectives.groups.tensorwire_group import TensorwireGroup
from tensorwire.collectives.groups.torch_group import TorchGroup
from tensorwire.errors import TransferTimeoutError
from tensorwire.runtime.ray.hooks import actor_hook

__all__ = ["get_group", "group_names", "join", "leave"]

_groups: dict[str, Group] = {}
_groups_lock = threading.Lock()


def _live() -> dict[str, Group]:
    """The groups this process has not left, under the lock (``Group.destroy`` leaves)."""
    for name in [n for n, g in _groups.items() if g.left]:
        del _groups[name]
    return _groups


@actor_hook
def join(  # noqa: PLR0917 - a hook: called positionally through Ray
    _actor: object,
    name: str,
    channel: str,
    rank: int,
    descriptions: list[tuple[bytes, int]],
    backend: Backend,
    timeout_s: float,
) -> Backend:
    """Hook: become member ``rank`` of group ``name`` (every member joins at once)."""
    members = [member_from(r, d) for r, d in enumerate(descriptions)]
    with _groups_lock:
        if name in _live():
            raise ValueError(f"this process is already in a group named {name!r}; destroy it first")
    backend = Backend(backend)
    kind = TensorwireGroup if backend is Backend.TENSORWIRE else TorchGroup
    try:
        group = kind(channel, rank, members, backend, timeout_s)
    except TransferTimeoutError as e:
        raise TransferTimeoutError(f"group {name!r}: not every member joined in time: {e}") from None
    group.name = name
    with _groups_lock:
        _groups[name] = group
    return backend


@actor_hook
def leave(_actor: object, name: str) -> bool:
    """Hook: leave group ``name``; False if this process was not in it."""
    with _groups_lock:
        group = _live().get(name)
    if group is None:
        return False
    group.destroy()
    return True


def get_group(name: str = "default") -> Group:
    """This process's membership of group ``name`` (inside a member actor)."""
    with _groups_lock:
        group = _live().get(name)
        if group is None:
            known = sorted(_groups) or "none"
            raise ValueError(f"this process is not in a group named {name!r} (its groups: {known})")
        return group


def group_names() -> list[str]:
    """The groups this process is a member of."""
    with _groups_lock:
        return sorted(_live())
