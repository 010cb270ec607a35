"""What callers ask of the registered Ray transport beyond Ray's own interface: a producer's
default transport for its readers, and one read's options (transport, target buffers,
device). Kept apart from :mod:`.transport`, which imports Ray and reads these."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["ReadOptions", "current_read_options", "note_readers_transport", "read_options", "read_pool", "take_hint"]

_MAX_HINTS = 4096  # producers' transport hints not yet taken by an extraction (oldest dropped)

_hints: collections.OrderedDict[tuple[int, int, str], str] = collections.OrderedDict()  # first tensor -> transport
_hints_lock = threading.Lock()
_reading = threading.local()  # this thread's read options (``read_options``)
_read_pool: concurrent.futures.ThreadPoolExecutor | None = None  # reads ``ray.get`` starts
_read_pool_lock = threading.Lock()


def _hint_key(tensor: Any) -> tuple[int, int, str] | None:
    """Where a tensor's bytes are: address, size, device (None for an empty tensor, which has
    no address of its own)."""
    nbytes = tensor.numel() * tensor.element_size()
    return (tensor.data_ptr(), nbytes, str(tensor.device)) if nbytes else None


def note_readers_transport(value: Any, transport: str) -> None:
    """Producer, as a method returns ``value``: its readers' default transport is ``transport``
    (``@tw.method(transport=)``). Noted by where the value's first non-empty tensor is, as Ray
    may extract the value on another thread; taken by that extraction. (Two calls returning the
    same tensor at once with different transports may swap them; a note no extraction takes,
    e.g. a failed call's, is dropped after :data:`_MAX_HINTS` newer ones.)"""
    import torch

    from tensorwire.runtime.refs import values

    _skeleton, tensors, _kinds = values.flatten(value)
    keys = (_hint_key(t) for t in tensors if isinstance(t, torch.Tensor))
    key = next((k for k in keys if k is not None), None)
    if key is None:
        return
    with _hints_lock:
        _hints[key] = transport
        while len(_hints) > _MAX_HINTS:
            _hints.popitem(last=False)


def take_hint(tensors: list[Any]) -> str:
    import torch

    with _hints_lock:
        if not _hints:
            return ""
        for tensor in tensors:
            key = _hint_key(tensor) if isinstance(tensor, torch.Tensor) else None
            hint = _hints.pop(key, None) if key is not None else None
            if hint is not None:
                return hint
    return ""


@dataclass(frozen=True)
class ReadOptions:
    transport: str = ""
    target_buffers: list[Any] | None = None  # tw.get(ref, out=): this read only (Ray's targets stay set)
    device: Any = None


@contextlib.contextmanager
def read_options(*, transport: str = "", target_buffers: list[Any] | None = None, device: Any = None) -> Iterator[None]:
    """Within this block, reads of registered-transport references that Ray starts on this
    thread (``ray.get``; a call's arguments, where Ray starts their transfer from the calling
    thread) use ``transport`` ("" for the producer's or the automatic choice), land in
    ``target_buffers`` or on ``device``."""
    previous = getattr(_reading, "options", None)
    _reading.options = ReadOptions(transport, target_buffers, device)
    try:
        yield
    finally:
        _reading.options = previous


def current_read_options() -> ReadOptions:
    return getattr(_reading, "options", None) or ReadOptions()


def read_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The reads ``ray.get`` starts run here: not on ``tw.get``'s pool, whose threads may be the
    ones waiting for them."""
    global _read_pool
    with _read_pool_lock:
        if _read_pool is None:
            _read_pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tensorwire-ray-read")
        return _read_pool
