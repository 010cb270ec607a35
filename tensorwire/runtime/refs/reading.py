"""Fetching the value behind one ``tw.Ref``: fetch its tensors through the agent, make the
value; and placing a value that came whole from Ray's object store. :func:`tensorwire.get`
and ``await ref`` come here; the reference is used only through its own methods, so this
module does not import :mod:`.ref`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tensorwire.errors import TransferTimeoutError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.refs import placement, repeats, values
from tensorwire.transport import metadata
from tensorwire.transport.agent import destinations
from tensorwire.transport.contract import TensorMeta

__all__ = ["executor", "get_async", "get_ref", "place_value"]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def place_value(value: Any, device: Any, out: Any) -> Any:
    """A value that came whole (from Ray's object store), its tensors moved to ``device`` or
    copied into ``out`` as :func:`get_ref` would place them."""
    if device is None and out is None:
        return value
    skeleton, tensors, kinds = values.flatten(value)
    metas = tuple(
        TensorMeta(tuple(t.shape), metadata.dtype_name(t.dtype), str(t.device), 0, 0, kind)
        for t, kind in zip(tensors, kinds, strict=True)
    )
    outs, checked = placement.matched_out(skeleton, out, metas)
    dst = [checked.get(i) for i in range(len(metas))]
    tensors = destinations.finish(tensors, dst, placement.targets(metas, device))
    return placement.place(skeleton, tensors, metas, outs)


def get_ref(
    ref: Any,
    *,
    device: str | torch.device | None = None,
    out: Any = None,
    transport: str = "",
    view: bool = False,
    timeout_s: float | None = None,
    pooled: bool = False,
) -> Any:
    """The value ``ref`` (a :class:`~.ref.Ref`) points to, fetched (``tensorwire.get``
    documents the options; ``pooled``: host tensors land in pooled memory); into the same
    ``out`` as last time, the same fetch again (:mod:`.repeats`)."""
    agent = runtime_agent()
    options = (device, transport)
    into_buffers = out is not None and not view and not pooled  # a fetch that may be repeated
    if into_buffers:
        limit_s = agent.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit_s
        repeated = repeats.again(ref.remembered, out, options, agent, deadline)
        if repeated is not None:
            ref.mark_moved(repeated[0])
            return repeated[1]
        timeout_s = deadline - time.monotonic()  # what a repeat that failed left
        if timeout_s <= 0:
            raise TransferTimeoutError(f"fetch of object {ref.object_id} not done before its deadline ({limit_s} s)")
    skeleton = ref.skeleton()
    state = ref.state
    desc = state.desc
    outs, checked = placement.matched_out(skeleton, out, desc.metas)
    targets = placement.targets(desc.metas, device)
    if into_buffers and repeats.worth_keeping(ref, checked, len(desc.metas)):  # the same buffers again
        tensors, record, repeat = agent.fetch_repeatable(
            desc,
            state.handles,
            dst=[checked[i] for i in range(len(desc.metas))],
            targets=targets,
            transport=transport or state.transport,
            timeout_s=timeout_s,
        )
        ref.remember(repeats.remembered(agent, out, options, skeleton, checked, repeat))
    else:
        same_process = desc.owner.agent_id == agent.peer.agent_id
        tensors, record = agent.fetch(
            desc,
            state.handles,
            dst=[checked.get(i) for i in range(len(desc.metas))] if checked else None,
            targets=targets,
            transport=transport or state.transport,
            view=not checked and (view or same_process),
            pooled=pooled,
            timeout_s=timeout_s,
        )
    ref.mark_moved(record.transport)
    return placement.place(skeleton, tensors, desc.metas, outs)


async def get_async(ref: Any, **options: Any) -> Any:
    """``await``-able :func:`get_ref` (``await ref`` calls it); runs on a thread pool."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor(), functools.partial(get_ref, ref, **options))


def executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tensorwire-get")
        return _pool
