"""What every member of a weight sync shares, inside its actor: the named tensors it holds,
the spec of a push (sent serialised, kept while it is the same), what is worked out once from
a kept spec, the streams it serves, the hooks that describe and release it, and the fault
points tests use.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorwire.collectives.groups.channel import Channel, member_from
from tensorwire.collectives.weight_sync.commit import aside
from tensorwire.collectives.weight_sync.commit import receiver as commit
from tensorwire.collectives.weight_sync.planning.layout import ParamPiece, describe_value
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec, Region
from tensorwire.collectives.weight_sync.recovery import arrivals, covered
from tensorwire.collectives.weight_sync.streams import staging
from tensorwire.collectives.weight_sync.streams.fanout import Fanout
from tensorwire.runtime.ray.hooks import actor_hook

__all__ = [
    "at_fault_point",
    "bucket_views",
    "channel_of",
    "checked_tensors",
    "fanouts_of",
    "holder_value",
    "layout_hook",
    "layout_key",
    "load_spec",
    "member_tensors",
    "memo",
    "release_hook",
    "set_fault_point",
    "view",
]

_specs: dict[bytes, PushSpec] = {}  # the last specs the driver sent (serialised -> loaded)
_SPECS_KEPT = 4  # a try's and a cover's, of two syncs
_prepared: dict[int, tuple[Any, Any]] = {}  # id(part of a spec) -> (that part, what was computed from it)
_fault_point: list[Callable[[str, int], None]] = []  # set_fault_point's hook, if any


def set_fault_point(hook: Callable[[str, int], None] | None) -> None:
    """Inside a weight-sync member, for fault-injection tests: ``hook(role, k)`` runs each time
    this process has handled bucket level ``k`` of a push (role ``"trainer"``: offered it to
    every stream, ``k`` -1: about to offer the first, ``k`` = the number of levels: every reader
    took every bucket; ``"receiver"``: took it in), e.g. to kill
    or stop the process at a named point
    instead of after a guessed delay. ``None`` removes it."""
    _fault_point[:] = [hook] if hook is not None else []


def at_fault_point(role: str, k: int) -> None:
    for hook in _fault_point:
        hook(role, k)


def holder_value(actor: object, where: str | None, role: str, *, own_tensors: bool = False) -> dict[str, Any]:
    """The named tensors of an actor: ``actor.<where>`` (a module, a dict, or a method giving
    either); by default its ``state_dict()`` method when it has one, else its ``model``.
    ``own_tensors``: a module's parameters and buffers themselves, not detached views of them
    (to swap memory into them)."""
    if where is None:
        method = getattr(actor, "state_dict", None)
        if callable(method):
            return _as_dict(method(), "state_dict()", role, own_tensors)
        where = "model"
    if not isinstance(where, str) or not where:
        raise ValueError(f"{role} must name an attribute or method of the actor")
    if not hasattr(actor, where):
        raise AttributeError(
            f"the {role} actor ({type(actor).__name__}) has no attribute {where!r}; pass {role}=<the attribute "
            "or method that gives an nn.Module or a dict of tensors>"
        )
    value = getattr(actor, where)
    if callable(value) and not isinstance(value, torch.nn.Module):
        value = value()
    return _as_dict(value, where, role, own_tensors)


def _as_dict(value: Any, where: str, role: str, own_tensors: bool = False) -> dict[str, Any]:
    if isinstance(value, torch.nn.Module):
        value = value.state_dict(keep_vars=own_tensors)
    if not isinstance(value, dict):
        raise TypeError(f"{role} {where!r} gives {type(value).__name__}, not an nn.Module or a dict of tensors")
    return value


@actor_hook
def layout_hook(actor: object, where: str | None, role: str) -> list[ParamPiece]:
    """Hook: the pieces this actor holds (``role``: "source" or "target")."""
    return describe_value(holder_value(actor, where, role), role)[0]


@actor_hook
def release_hook(_actor: object, sync_id: str) -> None:
    """Hook, every member: drop the staging, mappings, shadows and records of sync ``sync_id``
    (and a fence still held for it)."""
    staging.release(sync_id)
    _specs.clear()
    _prepared.clear()
    commit.let_go(sync_id)
    aside.release(sync_id)
    arrivals.release(sync_id)
    covered.release(sync_id)


def memo(obj: Any, make: Callable[[Any], Any]) -> Any:
    """``make(obj)`` for a part of a kept spec, computed once (pushes repeat the same spec)."""
    kept = _prepared.get(id(obj))
    if kept is None or kept[0] is not obj:
        if len(_prepared) > 100_000:
            _prepared.clear()
        kept = _prepared[id(obj)] = (obj, make(obj))
    return kept[1]


def layout_key(layout: Sequence[ParamPiece]) -> list[tuple[Any, ...]]:
    """A layout as plain tuples: compared in C (dataclass equality of thousands of entries is not)."""
    return [(h.name, h.global_shape, h.dtype, h.box.offsets, h.box.sizes, h.placements, h.rows) for h in layout]


def bucket_views(
    bucket: tuple[Region, ...], layout: Sequence[ParamPiece]
) -> list[tuple[int, tuple[slice, ...] | None, torch.dtype]]:
    """(param, the slices of its piece or None for the whole local tensor, wire dtype) per region."""
    result = []
    for r in bucket:
        whole = not any(r.box.offsets) and r.box.sizes == layout[r.param].box.sizes
        result.append((r.param, None if whole else r.box.slices(), getattr(torch, r.wire_dtype)))
    return result


def view(tensor: torch.Tensor, where: tuple[slice, ...] | None) -> torch.Tensor:
    return tensor if where is None else tensor[where]


def member_tensors(actor: object, spec: PushSpec, role: str) -> list[torch.Tensor]:
    """The actor's tensors in the order of ``spec.layout``; ``ValueError`` if they changed."""
    own = role == "target" and spec.shadow and spec.publish == "swap"
    return checked_tensors(actor, spec.where, memo(spec.layout, layout_key), role, own=own)


def checked_tensors(
    actor: object, where: str | None, key: list[tuple[Any, ...]], role: str, *, own: bool = False
) -> list[torch.Tensor]:
    """The actor's tensors at ``where`` in the order of the layout whose :func:`layout_key` is
    ``key`` (``own``: the tensors themselves, not fresh copies or views); ``ValueError`` if they
    changed since."""
    mine, tensors = describe_value(holder_value(actor, where, role, own_tensors=own), role, own_tensors=own)
    if layout_key(mine) != key:
        who = "trainer" if role == "source" else "receiver"
        raise ValueError(f"the {who}'s tensors changed shape, dtype or names since the WeightSync was made")
    return tensors


def load_spec(spec: PushSpec | bytes, version: int | None, channel: str | None) -> PushSpec:
    """The spec of this push: given, or serialised by the driver (kept while it is the same)."""
    if isinstance(spec, bytes):
        kept = _specs.get(spec)
        if kept is None:
            if len(_specs) >= _SPECS_KEPT:
                _specs.clear()  # (the parts memo() keeps go by identity: a cleared spec's are made again)
            kept = _specs[spec] = pickle.loads(spec)  # from our driver, through Ray's own channel
        spec = kept
    if version is not None:
        spec = dataclasses.replace(spec, version=version, channel=channel or spec.channel)
    return spec


def channel_of(spec: PushSpec) -> Channel:
    """The push's channel among its members, as this member."""
    members = [member_from(r, d) for r, d in enumerate(spec.members)]
    return Channel(spec.channel, spec.rank, members, spec.timeout_s)


def fanouts_of(
    channel: Channel, spec: PushSpec, on_done: Callable[[int, int], None] | None = None
) -> dict[int, Fanout]:
    """A :class:`Fanout` per stream this member serves (``on_done(stream, k)``: every reader
    acknowledged bucket ``k``)."""
    result = {}
    for role in spec.roles:
        if role.children:
            done = (lambda k, s=role.stream: on_done(s, k)) if on_done else (lambda _k: None)
            result[role.stream] = Fanout(
                channel,
                role.children,
                sync_id=spec.sync_id,
                stream=role.stream,
                slot_nbytes=role.slot_nbytes,
                transport=spec.transport,
                on_done=done,
            )
    return result
