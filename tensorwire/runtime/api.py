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
from tensorwire.runtime import reading, values
from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.runtime.ref import Ref, RefState
from tensorwire.transport import metadata
from tensorwire.transport.config import validate_timeout
from tensorwire.transport.contract import MemoryKind, ObjectDescriptor, TensorKind, TensorMeta
from tensorwire.transport.hw import topology
from tensorwire.transport.packing import packed_layout
from tensorwire.transport.waiting import backoff, wait_until

__all__ = [
    "free",
    "get",
    "get_arguments",
    "get_async",
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


def register_tensors(tensors: list[torch.Tensor], kinds: list[TensorKind] | None = None) -> ObjectDescriptor:
    """Register contiguous ``tensors`` as one object of this process, with no reference to it:
    the caller frees it (``runtime_agent().free(desc)``). What :func:`put` and the
    collectives build on."""
    kinds = kinds or [TensorKind.TORCH] * len(tensors)
    offsets, packed_nbytes = packed_layout(t.numel() * t.element_size() for t in tensors)
    metas = tuple(
        TensorMeta(
            shape=tuple(t.shape),
            dtype=metadata.dtype_name(t.dtype),
            device=str(t.device),
            nbytes=t.numel() * t.element_size(),
            offset=offset,
            kind=kind,
            device_uuid=topology.cuda_uuid(t.get_device()) if t.device.type == "cuda" else "",
        )
        for t, offset, kind in zip(tensors, offsets, kinds, strict=True)
    )
    return runtime_agent().register(tensors, metas, packed_nbytes, ready=_ready_events(tensors))


def _ready_events(tensors: list[torch.Tensor]) -> list[Any]:
    """One CUDA event per device, recorded on its current stream after the work queued so far."""
    events = []
    for index in sorted({t.get_device() for t in tensors if t.device.type == "cuda"}):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        events.append((index, event))
    return events


def _get_one(ref: Any, **options: Any) -> Any:
    if isinstance(ref, Ref):
        return reading.get_ref(ref, **options)
    from tensorwire.runtime.raycompat import Arrived

    if isinstance(ref, Arrived):
        return reading.get_ref(Ref(ref.state._replace(pin_id=b"")), **options)
    if type(ref).__name__ == "ObjectRef" and type(ref).__module__.startswith("ray"):
        return _get_object_ref(ref, **options)
    raise TypeError(f"tensorwire.get expects a Ref (or a list of Refs), got {type(ref).__name__}")


def _as_ref(value: Any) -> Ref:
    from tensorwire.runtime.raycompat import state_of

    return Ref(state_of(value)._replace(pin_id=b""))


def _get_object_ref(object_ref: Any, *, timeout_s: float | None, **options: Any) -> Any:
    """``tw.get`` of a plain Ray ``ObjectRef``: a reference it holds is fetched with the
    options; any other value is returned as Ray gives it."""
    from tensorwire.runtime.pending import raw_value

    if getattr(object_ref, "tensor_transport", lambda: None)():  # Ray's direct transport (ours or another)
        from tensorwire.runtime.ray_paths import get_direct

        return get_direct(object_ref, timeout_s=timeout_s, **options)

    try:
        value = raw_value(object_ref, timeout_s)
    except TimeoutError:
        raise TransferTimeoutError(f"the Ray call has not finished within {timeout_s} s") from None
    if isinstance(value, (Ref, RefState)) or type(value).__name__ == "Arrived":
        return _get_one(value if isinstance(value, Ref) else _as_ref(value), timeout_s=timeout_s, **options)
    return value


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
        ref: A :class:`Ref`, or a list/tuple of them (fetched concurrently; a list returns).
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
        timeout_s: Deadline for the fetch, including waiting for a pending call (default
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
    of the same size reuse once these tensors are gone; staged task results as :func:`get`.

    Args:
        refs: The arguments' references, resolved (their states came with the call) or staged.
        device: Where tensors land (the call's ``device`` option or the actor's GPU).
        transport: The call's forced transport, "" for automatic.
    """
    views = [not r.is_staged and any(m.memory is MemoryKind.CUDA for m in r.resolve().desc.metas) for r in refs]
    options = {"device": device, "transport": transport, "timeout_s": None, "pooled": True}
    return _get_all(refs, [None] * len(refs), views, options)


async def get_async(ref: Ref | list[Ref], **kwargs: Any) -> Any:
    """``await``-able :func:`get`; runs on a thread pool."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(reading.executor(), functools.partial(get, ref, **kwargs))


def wait(refs: list[Ref], *, num_returns: int = 1, timeout_s: float | None = None) -> tuple[list[Ref], list[Ref]]:
    """Wait until ``num_returns`` of ``refs`` can be fetched without waiting for their call.

    Returns:
        ``(ready, not_ready)``: at most ``num_returns`` ready references and the rest, each
        in the order given. On timeout, fewer than ``num_returns`` may be ready.
    """
    refs = list(refs)
    if not all(isinstance(r, Ref) for r in refs):
        raise TypeError("tensorwire.wait expects a list of Refs")
    if not 0 <= num_returns <= len(refs):
        raise ValueError(f"num_returns={num_returns} must be between 0 and len(refs)={len(refs)}")
    deadline = None if timeout_s is None else time.monotonic() + validate_timeout(timeout_s)
    while True:
        ready_ids = {id(r) for r in refs if r.ready()}
        if len(ready_ids) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            break
        waiting = [r.pending.object_ref for r in refs if id(r) not in ready_ids and r.pending is not None]
        if waiting:
            import ray

            left = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
            ray.wait(waiting, num_returns=1, timeout=left)
        time.sleep(0.001)
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
    no-op. A pending reference waits for its call first; a staged task result is left to
    Ray's reference counting.
    """
    if not isinstance(ref, Ref):
        raise TypeError(f"tensorwire.free expects a Ref, got {type(ref).__name__}")
    if ref.is_staged:
        return
    runtime_agent().free(ref.resolve().desc)


def stats() -> dict[str, Any]:
    """This process's agent: objects owned and held, and transfers by transport."""
    return runtime_agent().stats()
