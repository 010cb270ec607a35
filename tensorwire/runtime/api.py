"""The public API on references: ``put`` / ``get`` / ``wait`` / ``free`` / ``stats``.

``put``, ``get`` and ``free`` work in any process, with or without Ray (standalone mode);
``wait`` and ``await ref`` matter for results of Ray calls. ``init`` (Ray start-up) is in
:mod:`.start`; where fetched tensors land, in :mod:`.placement`; fetching one reference, in
:mod:`.reading`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import torch

from tensorwire.errors import TransferTimeoutError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.refs import reading, values
from tensorwire.runtime.refs.ref import Ref, RefState
from tensorwire.runtime.refs.registering import register_tensors
from tensorwire.transport.config import validate_timeout
from tensorwire.transport.contract import MemoryKind
from tensorwire.transport.hw import topology
from tensorwire.transport.waiting import backoff, wait_until

__all__ = [
    "free",
    "get",
    "get_arguments",
    "get_async",
    "is_object_ref",
    "put",
    "register_tensors",
    "stats",
    "wait",
    "wait_tensor_freed",
]

logger = logging.getLogger(__name__)


def put(value: Any) -> Ref:
    """Register ``value``'s tensors in this process and return a reference to it.

    ``value`` may be a tensor, a numpy array or any nesting of dicts, lists, tuples, named
    tuples and dataclasses holding them; other leaves travel as ordinary Python values.
    Tensors are kept by reference, not copied: changing them in place before a consumer
    fetches changes what it receives (like any Python object). Non-contiguous tensors are
    made contiguous (one copy) and tensors are detached from autograd.

    Raises:
        TypeError: Unsupported tensors (sparse, quantized, nested, object arrays), tensors
            hidden in objects that are not walked, or non-tensor parts that cannot be pickled.
        ValueError: A reference cycle in ``value``.

    Warns:
        LargeReferenceWarning: Once per process, when the non-tensor parts pickle to more than
            ``TENSORWIRE_REF_WARN_NBYTES`` (default 1 MiB).
    """
    skeleton, tensors, kinds = values.flatten(value)
    skeleton_bytes = values.dumps_skeleton(skeleton)
    desc = register_tensors(tensors, kinds)
    values.warn_large_skeleton(len(skeleton_bytes), runtime_agent().config.ref_warn_nbytes)
    return Ref(RefState(desc, skeleton_bytes, {}, b""), skeleton)


def _get_one(ref: Any, **options: Any) -> Any:
    if isinstance(ref, Ref):
        return reading.get_ref(ref, **options)
    if is_object_ref(ref):
        return _get_object_ref(ref, **options)
    raise TypeError(f"tensorwire.get expects a Ref or a Ray ObjectRef (or a list of them), got {type(ref).__name__}")


def is_object_ref(value: Any) -> bool:
    """Whether ``value`` is a Ray ``ObjectRef`` (without importing Ray)."""
    return type(value).__name__ == "ObjectRef" and type(value).__module__.startswith("ray")


def _get_object_ref(
    object_ref: Any, *, timeout_s: float | None, device: Any, out: Any, transport: str, view: bool, pooled: bool = False
) -> Any:
    """``tw.get`` of a Ray ``ObjectRef``: a direct-transport reference is read by Ray (with
    ``out=`` / ``device=`` / ``transport=``); any other value comes from Ray's object store,
    placed on ``device`` / into ``out``, and a ``tw.Ref`` it is gets fetched with the options."""
    from tensorwire.runtime.ray import paths as ray_paths

    if object_ref.tensor_transport():  # Ray's direct transport (ours or another)
        return ray_paths.get_direct(
            object_ref, timeout_s=timeout_s, device=device, out=out, transport=transport, view=view
        )
    value = ray_paths.object_store_value(object_ref, timeout_s)
    if isinstance(value, Ref):
        return reading.get_ref(value, device=device, out=out, transport=transport, view=view, timeout_s=timeout_s)
    return reading.place_value(value, device, out)


def get(
    ref: Ref | list[Ref] | tuple[Ref, ...],
    *,
    device: str | torch.device | None = None,
    out: Any = None,
    transport: str = "",
    view: bool = False,
    timeout_s: float | None = None,
) -> Any:
    """Fetch the value a reference points to, with its structure.

    Args:
        ref: A :class:`Ref` or a Ray ``ObjectRef`` (a ``@tw.method`` result: ``out=`` is then a
            tensor or a list of tensors in the value's order, and ``view=`` is refused), or a
            list/tuple of them (fetched concurrently; a list returns).
        device: Where tensors land (default: where the producer had them if this process has
            that device, else the CPU).
        out: Existing tensors to receive into, in the value's structure (a tensor for a
            tensor value, a dict of tensors for a state dict, ...); shapes and dtypes must
            match. With a list of refs, a list of such values.
        transport: Force a transport by name ("" uses the producer's choice, if it made one,
            else picks automatically; ``TENSORWIRE_TRANSPORT`` forces one process-wide).
        view: Return zero-copy views where the transport allows (same process: the
            producer's own tensors; same node: a copy-on-write mapping of shared memory).
            In the producer's own process views are the default.
        timeout_s: Deadline for the fetch, including waiting for a Ray call to finish (default
            ``TENSORWIRE_TIMEOUT_S`` or 60 s for the transfer; no limit on the call).

    Raises:
        ObjectFreedError: The object was freed. OwnerDiedError: its owner exited.
        PeerLostError: The owner did not answer. PermissionDeniedError: forged reference.
        NoTransportError: No (or the forced) transport can serve. ValueError: ``out`` does
            not match. TransferTimeoutError: the deadline passed (over nixl a READ then
            still running may yet write into ``out``). DeviceUnavailableError
            (a ValueError): ``device`` is not one this process sees.
    """
    if timeout_s is not None:
        timeout_s = validate_timeout(timeout_s)
    if device is not None:
        device = topology.checked_device(device)  # before any transfer starts
    if isinstance(ref, Ref):  # the common case, one call fewer
        return reading.get_ref(ref, device=device, out=out, transport=transport, view=view, timeout_s=timeout_s)
    if isinstance(ref, (list, tuple)):
        outs = list(out) if out is not None else [None] * len(ref)
        if len(outs) != len(ref):
            raise ValueError(f"out has {len(outs)} entries for {len(ref)} refs")
        options = {"device": device, "transport": transport, "timeout_s": timeout_s}
        return _get_all(list(ref), outs, [view] * len(ref), options)
    return _get_one(ref, device=device, out=out, transport=transport, view=view, timeout_s=timeout_s)


def _get_all(refs: list[Any], outs: list[Any], views: list[bool], options: dict[str, Any]) -> list[Any]:
    """Fetch ``refs`` concurrently; ``views[i]`` is the ``view`` of ``refs[i]``, and a
    reference fetched as a copy lands in pooled host memory when ``options["pooled"]``."""
    jobs = [functools.partial(_get_one, r, out=o, view=v, **options) for r, o, v in zip(refs, outs, views, strict=True)]
    if len(jobs) <= 1:
        return [job() for job in jobs]
    futures = [reading.executor().submit(job) for job in jobs]
    return [f.result() for f in futures]


def get_arguments(refs: list[Ref], *, device: str | torch.device | None, transport: str) -> list[Any]:
    """Consumer (a ``@tw.remote`` actor or task): the values of a call's reference arguments,
    fetched concurrently. Values holding GPU tensors come as zero-copy views where the
    transport allows (cuda_ipc); host values landing on the host are copied once into pooled
    memory already faulted in (:mod:`tensorwire.transport.host_pool`), which later arguments
    of the same size reuse once these tensors are gone.

    Args:
        refs: The arguments' references: ``tw.Ref``s, and Ray ``ObjectRef``s a task reads itself.
        device: Where tensors land (the call's ``device`` option or the actor's GPU).
        transport: The call's forced transport, "" for automatic.
    """
    views = [isinstance(r, Ref) and any(m.memory is MemoryKind.CUDA for m in r.state.desc.metas) for r in refs]
    options = {"device": device, "transport": transport, "timeout_s": None, "pooled": True}
    return _get_all(refs, [None] * len(refs), views, options)


async def get_async(ref: Ref | list[Ref], **kwargs: Any) -> Any:
    """``await``-able :func:`get`; runs on a thread pool."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(reading.executor(), functools.partial(get, ref, **kwargs))


def wait(refs: list[Any], *, num_returns: int = 1, timeout_s: float | None = None) -> tuple[list[Any], list[Any]]:
    """Wait until ``num_returns`` of ``refs`` (``tw.Ref``s, always ready, and Ray ``ObjectRef``s
    of calls) can be fetched without waiting for their call.

    Returns:
        ``(ready, not_ready)``: at most ``num_returns`` ready references and the rest, each
        in the order given. On timeout, fewer than ``num_returns`` may be ready.
    """
    refs = list(refs)
    timeout = None if timeout_s is None else validate_timeout(timeout_s)
    if not all(isinstance(r, Ref) or is_object_ref(r) for r in refs):
        raise TypeError("tensorwire.wait expects a list of Refs or Ray ObjectRefs")
    if not 0 <= num_returns <= len(refs):
        raise ValueError(f"num_returns={num_returns} must be between 0 and len(refs)={len(refs)}")
    ready_ids = {id(r) for r in refs if isinstance(r, Ref)}
    calls = [r for r in refs if not isinstance(r, Ref)]
    if calls and len(ready_ids) < num_returns:
        from tensorwire.runtime.ray import paths as ray_paths

        wanted = min(len(calls), num_returns - len(ready_ids))
        ready_ids |= {id(r) for r in ray_paths.wait_calls(calls, num_returns=wanted, timeout_s=timeout)}
    ready = [r for r in refs if id(r) in ready_ids][:num_returns]
    chosen = {id(r) for r in ready}
    return ready, [r for r in refs if id(r) not in chosen]


def wait_tensor_freed(tensor: Any, *, timeout_s: float = 60.0) -> None:
    """Producer: wait until no reference to a value holding ``tensor`` (or any tensor of a
    value: a dict, list, ...) is left, so that overwriting it in place cannot change what a
    consumer reads. Values that travelled inline were copied when returned: they never wait.

    Raises:
        TransferTimeoutError: References are still held after ``timeout_s`` (the message
            says how many objects). ValueError: ``timeout_s`` is not positive.
    """
    timeout_s = validate_timeout(timeout_s)
    _skeleton, tensors, _kinds = values.flatten(tensor)
    if not tensors:
        raise TypeError(f"wait_tensor_freed expects a tensor or a value holding tensors, got {type(tensor).__name__}")
    storages = frozenset(t.untyped_storage().data_ptr() for t in tensors)
    agent = runtime_agent()
    deadline = time.monotonic() + timeout_s

    def freed(_slice_s: float) -> bool | None:
        agent.flush(timeout_s=min(10.0, max(0.01, deadline - time.monotonic())))  # releases on their way
        return None if agent.owned_sharing(storages) else True

    def still_held() -> Exception:
        return TransferTimeoutError(
            f"{agent.owned_sharing(storages)} object(s) holding this tensor are still referenced after {timeout_s} s: "
            "a consumer still holds a tw.Ref to it (drop it, or tw.free(ref) to free it early)"
        )

    wait_until(freed, deadline=deadline, what="wait_tensor_freed", pause=backoff(0.001, 0.05), on_timeout=still_held)


def free(ref: Ref) -> None:
    """Free the object now, in its owner, whoever still holds references.

    Later fetches raise ``ObjectFreedError``. Freeing twice, or after the owner exited, is a
    no-op.

    Raises:
        TypeError: Not a ``Ref``: a Ray ``ObjectRef`` (of a ``@tw.method`` call too) is freed by
            Ray's reference counting once no copy of it is left (``del ref``).
    """
    if not isinstance(ref, Ref):
        raise TypeError(
            f"tensorwire.free expects a Ref, got {type(ref).__name__}: Ray frees the objects of its ObjectRefs "
            "(those of @tw.method calls too) once no copy of the reference is left (del ref)"
        )
    runtime_agent().free(ref.state.desc)


def stats() -> dict[str, Any]:
    """This process's agent: objects owned and held, and transfers by transport."""
    return runtime_agent().stats()
