"""``put`` / ``get`` / ``free`` / ``stats``: the standalone API (no Ray needed)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tensorwire.runtime import values
from tensorwire.runtime.ref import Ref
from tensorwire.transport.agent import get_agent
from tensorwire.transport.base import TensorKind, TensorMeta
from tensorwire.transport.packing import packed_layout

__all__ = ["free", "get", "put", "stats"]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


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
    """
    skeleton, tensors, is_numpy = values.flatten(value)
    skeleton_bytes = values.dumps_skeleton(skeleton)
    offsets, packed_nbytes = packed_layout(t.numel() * t.element_size() for t in tensors)
    metas = tuple(
        TensorMeta(
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            device=str(t.device),
            nbytes=t.numel() * t.element_size(),
            offset=offset,
            kind=TensorKind.NUMPY if numpy else TensorKind.TORCH,
        )
        for t, offset, numpy in zip(tensors, offsets, is_numpy, strict=True)
    )
    desc = get_agent().register(tensors, metas, packed_nbytes)
    return Ref(desc, skeleton_bytes, {}, skeleton)


def _target_device(meta: TensorMeta, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    target = torch.device(meta.device)
    if target.type == "cuda" and not (torch.cuda.is_available() and (target.index or 0) < torch.cuda.device_count()):
        return torch.device("cpu")  # the producer's GPU does not exist here: land on the host
    if target.type not in ("cpu", "cuda"):
        return torch.device("cpu")
    return target


def _check_out(buffer: Any, meta: TensorMeta, index: int) -> torch.Tensor:
    tensor = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer
    if tuple(tensor.shape) != meta.shape or str(tensor.dtype).removeprefix("torch.") != meta.dtype:
        raise ValueError(
            f"out buffer for tensor {index} has shape {tuple(tensor.shape)} and dtype "
            f"{str(tensor.dtype).removeprefix('torch.')}, the value has shape {meta.shape} and dtype {meta.dtype}"
        )
    return tensor


def _get_one(
    ref: Ref,
    *,
    device: str | torch.device | None,
    out: Any,
    transport: str,
    view: bool,
    timeout_s: float | None,
) -> Any:
    if not isinstance(ref, Ref):
        raise TypeError(f"tensorwire.get expects a Ref (or a list of Refs), got {type(ref).__name__}")
    agent = get_agent()
    desc = ref._desc
    metas = desc.metas
    skeleton = ref._load_skeleton()
    outs = values.match_out(skeleton, out) if out is not None else {}
    out_tensors = {i: _check_out(buffer, metas[i], i) for i, buffer in outs.items()}
    targets = [_target_device(m, device) for m in metas]
    same_process = desc.owner.agent_id == agent.peer.agent_id
    dst: list[torch.Tensor] | None = None
    if out_tensors or not (view or same_process):
        dst = []
        for i, meta in enumerate(metas):
            buffer = out_tensors.get(i)
            if buffer is not None and buffer.device.type == "cpu" and buffer.is_contiguous():
                dst.append(buffer)  # receive straight into the caller's memory
            else:
                dst.append(torch.empty(meta.shape, dtype=getattr(torch, meta.dtype)))
    tensors, _record = agent.fetch(
        desc, ref._handles, dst=dst, transport=transport, view=dst is None, timeout_s=timeout_s
    )
    leaves: list[Any] = []
    for i, (tensor, meta, target) in enumerate(zip(tensors, metas, targets, strict=True)):
        buffer = out_tensors.get(i)
        if buffer is not None:
            if buffer is not tensor:
                buffer.copy_(tensor)
            leaves.append(outs[i])
            continue
        placed = tensor if tensor.device == target else tensor.to(target)
        leaves.append(placed.numpy() if meta.kind is TensorKind.NUMPY and placed.device.type == "cpu" else placed)
    return values.unflatten(skeleton, leaves)


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
        transport: Force a transport by name ("" picks automatically; the environment
            variable ``TENSORWIRE_TRANSPORT`` forces one for the whole process).
        view: Return zero-copy views where the transport allows (same process: the
            producer's own tensors; same node: a copy-on-write mapping of shared memory).
            In the producer's own process views are the default.
        timeout_s: Deadline for the fetch (default ``TENSORWIRE_TIMEOUT_S`` or 60 s).

    Raises:
        ObjectFreedError: The object was freed. OwnerDiedError: its owner exited.
        PeerLostError: The owner did not answer. PermissionDeniedError: forged reference.
        NoTransportError: No (or the forced) transport can serve. ValueError: ``out`` does
            not match. TransferTimeoutError: the deadline passed.
    """
    if isinstance(ref, (list, tuple)):
        outs = list(out) if out is not None else [None] * len(ref)
        if len(outs) != len(ref):
            raise ValueError(f"out has {len(outs)} entries for {len(ref)} refs")
        options = {"device": device, "transport": transport, "view": view, "timeout_s": timeout_s}
        if len(ref) <= 1:
            return [_get_one(r, out=o, **options) for r, o in zip(ref, outs, strict=True)]
        futures = [_executor().submit(_get_one, r, out=o, **options) for r, o in zip(ref, outs, strict=True)]
        return [f.result() for f in futures]
    return _get_one(ref, device=device, out=out, transport=transport, view=view, timeout_s=timeout_s)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tensorwire-get")
        return _pool


def free(ref: Ref) -> None:
    """Free the object now, in its owner, whoever still holds references.

    Later fetches raise ``ObjectFreedError``. Freeing twice, or after the owner exited, is a
    no-op.
    """
    if not isinstance(ref, Ref):
        raise TypeError(f"tensorwire.free expects a Ref, got {type(ref).__name__}")
    get_agent().free(ref._desc)


def stats() -> dict[str, Any]:
    """This process's agent: objects owned and held, and transfers by transport."""
    return get_agent().stats()
