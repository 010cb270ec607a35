"""``tw.get(ref, out=buffers)`` again with the same buffers: the fetch made again, nothing
worked out again.

A consumer that reuses its receive buffers fetches one object into them again and again,
often through a new reference each time (unpickled from a message, a new Ray ``ObjectRef``).
After a second fetch of an object into the same buffers of the caller's (one torch tensor for
every tensor of the value, each filled in place) this process remembers it for that object
(:func:`keep`, keyed on the object's owner, id and capability token, whichever reference
brought it): the agent's :class:`~tensorwire.transport.agent.repeat.Repeat` and which buffers
they were (after the first, only the first buffer's ``id``: :func:`worth_keeping`). The next
``tw.get`` of that object with the same options and ``out`` holding the very same tensor
objects, at the same addresses and shapes, runs the repeat: no matching of ``out`` against
the value, no selection, no destinations. Anything else (other buffers, other options, a
transport that failed, the registry changed) goes the ordinary way, which checks everything
and says what is wrong. Only ``out`` given as a tensor, or a flat list, tuple or dict of
tensors is recognised; nested ones always go the ordinary way. The last
:data:`KEPT_OBJECTS` objects are kept.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tensorwire.runtime.refs import values
from tensorwire.transport.agent.repeat import Repeat
from tensorwire.transport.agent.services import AgentServices
from tensorwire.transport.config import Config

if TYPE_CHECKING:
    from tensorwire.transport.contract import ObjectDescriptor

__all__ = ["Remembered", "again", "keep", "known", "remembered", "worth_keeping"]

KEPT_OBJECTS = 256  # objects whose last fetch into buffers this process keeps (least recently used go)

_kept: OrderedDict[tuple[str, bytes, bytes], Remembered | int] = OrderedDict()
_kept_lock = threading.Lock()


class Remembered(NamedTuple):
    """A fetch of one reference into the caller's buffers, as :func:`again` repeats it."""

    agent: AgentServices  # the agent that made it (a new agent, e.g. after a fork, makes its own)
    config: Config  # the agent's settings then (new settings: the ordinary way, e.g. another forced transport)
    options: tuple[Any, ...]  # (device, transport) as given
    kind: type  # the type of ``out``
    keys: tuple[Any, ...] | None  # a dict's keys, in order
    buffers: tuple[weakref.ref, ...]  # ``out``'s tensors in its own order (not kept alive)
    facts: tuple[tuple[int, torch.Size, torch.dtype], ...]  # each buffer's address, shape and dtype then
    order: tuple[int, ...] | None  # for each tensor of the value, its buffer's position in ``buffers`` (None: the same)
    make: Callable[[list[torch.Tensor]], Any]  # the value from its tensors (:func:`values.rebuilder`)
    repeat: Repeat


def known(desc: ObjectDescriptor) -> Remembered | int | None:
    """What this process keeps of its last fetch of ``desc``'s object into buffers: the fetch to
    repeat, the mark of its first buffer, or None. Kept per object (its owner, id and capability
    token), not per reference: a reference unpickled anew from a message, or a new Ray
    ``ObjectRef`` to the same object, repeats the fetch as the reference it replaced did."""
    key = (desc.owner.agent_id, desc.object_id, desc.token)
    with _kept_lock:
        found = _kept.get(key)
        if found is not None:
            _kept.move_to_end(key)
        return found


def keep(desc: ObjectDescriptor, what: Remembered | int | None) -> None:
    """Keep ``what`` as :func:`known` answers it for ``desc``'s object (None: forget it); the
    least recently used of more than :data:`KEPT_OBJECTS` objects are forgotten."""
    key = (desc.owner.agent_id, desc.object_id, desc.token)
    with _kept_lock:
        if what is None:
            _kept.pop(key, None)
            return
        _kept[key] = what
        _kept.move_to_end(key)
        while len(_kept) > KEPT_OBJECTS:
            _kept.popitem(last=False)


def _leaves(out: Any, kind: type, keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """``out``'s items in its own order if it is a tensor or a flat container of ``kind``
    (with ``keys``), else None."""
    if kind is torch.Tensor:
        return (out,) if isinstance(out, torch.Tensor) else None
    if type(out) is not kind:
        return None
    if keys is None:
        return tuple(out)
    return tuple(out.values()) if tuple(out) == keys else None


def worth_keeping(ref: Any, checked: dict[int, torch.Tensor], count: int) -> bool:
    """Whether an ordinary fetch of ``ref`` into the caller's buffers ``checked`` (one for
    each of its ``count`` tensors) should be kept to repeat: its first buffer was the last
    fetch's too. Keeping one costs some microseconds, so a caller that brings new buffers every
    time never pays it; the reference then holds only the first buffer's ``id`` (a reused id
    only makes a fetch kept that is not repeated: :func:`again` checks everything)."""
    if len(checked) != count or not count:
        return False
    known = ref.remembered
    first = checked[0]
    if isinstance(known, Remembered):
        same = known.buffers[0 if known.order is None else known.order[0]]() is first
    else:
        same = known == id(first)
    if not same:
        ref.remember(id(first))
    return same


def remembered(  # noqa: PLR0917 - what the ordinary fetch had in hand
    agent: AgentServices,
    out: Any,
    options: tuple[Any, ...],
    skeleton: Any,
    checked: dict[int, torch.Tensor],
    repeat: Repeat | None,
) -> Remembered | None:
    """What a repeat of a fetch into ``out`` needs (``checked``: its buffers by the value's tensor
    index, one for each, as the ordinary fetch used them); None where :func:`again` would not
    recognise it."""
    if repeat is None:
        return None
    count = len(checked)
    kind = torch.Tensor if isinstance(out, torch.Tensor) else type(out)
    keys = tuple(out) if kind is dict else None
    if kind not in (torch.Tensor, list, tuple, dict):
        return None
    leaves = _leaves(out, kind, keys)
    if leaves is None or not all(type(leaf) is torch.Tensor for leaf in leaves):
        return None
    position = {id(leaf): i for i, leaf in enumerate(leaves)}
    if any(id(checked[i]) not in position for i in range(count)):
        return None  # a buffer was converted (a numpy array): not the caller's object
    order = tuple(position[id(checked[i])] for i in range(count))
    return Remembered(
        agent,
        agent.config,
        options,
        kind,
        keys,
        tuple(weakref.ref(leaf) for leaf in leaves),
        tuple((leaf.data_ptr(), leaf.shape, leaf.dtype) for leaf in leaves),
        None if order == tuple(range(len(leaves))) else order,
        values.rebuilder(skeleton),
        repeat,
    )


def again(
    known: Remembered | int | None, out: Any, options: tuple[Any, ...], agent: AgentServices, deadline: float
) -> tuple[str, Any] | None:
    """Fetch again as ``known`` remembers it, by ``deadline`` (``time.monotonic()``), if
    ``out``, ``options`` and this process's ``agent`` and its settings are what it remembers:
    (the transport, the value); None when the ordinary fetch must run.

    Raises:
        TransferTimeoutError: The deadline passed.
    """
    if not isinstance(known, Remembered):
        return None
    if known.options != options or known.agent is not agent or known.config is not agent.config:
        return None
    leaves = (out,) if known.kind is torch.Tensor else _leaves(out, known.kind, known.keys)  # one tensor: no call
    if leaves is None or len(leaves) != len(known.buffers):
        return None
    for leaf, buffer, fact in zip(leaves, known.buffers, known.facts, strict=True):
        if leaf is not buffer() or (leaf.data_ptr(), leaf.shape, leaf.dtype) != fact or not leaf.is_contiguous():
            return None
    dst = list(leaves) if known.order is None else [leaves[i] for i in known.order]
    record = known.repeat(dst, deadline)
    return None if record is None else (record.transport, known.make(dst))
