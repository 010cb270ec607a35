"""Where a fetched value's tensors belong, and the value they make.

:func:`target_device` decides the device a tensor lands on when the caller gave none;
:func:`matched_out` checks the caller's ``out=`` buffers against the value; :func:`place`
makes the value of the fetched tensors (the agent already put each where it was asked for:
:mod:`tensorwire.transport.agent.destinations`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorwire.runtime.refs import values
from tensorwire.transport import metadata
from tensorwire.transport.contract import TensorKind, TensorMeta
from tensorwire.transport.hw import topology

__all__ = ["as_kind", "matched_out", "place", "target_device", "targets"]


def target_device(meta: TensorMeta, device: str | torch.device | None) -> torch.device:
    """Where a fetched tensor lands: ``device`` if given; for a CUDA tensor, the same physical
    GPU (found by UUID, whatever the index) when this process sees it, else this process's
    current GPU, else the CPU."""
    if device is not None:
        return torch.device(device)
    target = metadata.device(meta.device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            return torch.device("cpu")  # no GPU here: land on the host
        index = topology.local_cuda_index(meta.device_uuid) if meta.device_uuid else None
        return torch.device("cuda", index if index is not None else torch.cuda.current_device())
    if target.type not in ("cpu", "cuda"):
        return torch.device("cpu")
    return target


def _check_out(buffer: Any, meta: TensorMeta, index: int) -> torch.Tensor:
    tensor = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer
    if tensor.shape != meta.shape or metadata.dtype_name(tensor.dtype) != meta.dtype:
        raise ValueError(
            f"out buffer for tensor {index} has shape {tuple(tensor.shape)} and dtype "
            f"{metadata.dtype_name(tensor.dtype)}, the value has shape {meta.shape} and dtype {meta.dtype}"
        )
    return tensor


def matched_out(
    skeleton: Any, out: Any, metas: tuple[TensorMeta, ...]
) -> tuple[dict[int, Any], dict[int, torch.Tensor]]:
    """``out``'s buffers by tensor index, as given and as checked torch tensors."""
    outs = values.match_out(skeleton, out) if out is not None else {}
    return outs, {i: _check_out(buffer, metas[i], i) for i, buffer in outs.items()}


_targets: dict[tuple[int, Any], tuple[tuple[TensorMeta, ...], tuple[torch.device, ...]]] = {}


def targets(metas: tuple[TensorMeta, ...], device: Any) -> tuple[torch.device, ...]:
    """``target_device`` of every tensor, worked out once per distinct placement; remembered
    per (metadata, device) unless a tensor lands on the thread's current GPU (which may change)."""
    key = (id(metas), device if device is None or isinstance(device, str) else str(device))
    known = _targets.get(key)
    if known is not None and known[0] is metas:
        return known[1]
    found: dict[tuple[str, str], torch.device] = {}
    result = []
    for meta in metas:
        placement = (meta.device, meta.device_uuid)
        if placement not in found:
            found[placement] = target_device(meta, device)
        result.append(found[placement])
    if device is not None or all(not m.device.startswith("cuda") for m in metas):
        if len(_targets) >= 1024:
            _targets.clear()
        _targets[key] = (metas, tuple(result))
    return tuple(result)


def place(skeleton: Any, tensors: list[torch.Tensor], metas: tuple[TensorMeta, ...], outs: dict[int, Any]) -> Any:
    """The value with its fetched ``tensors`` (already where they were asked for): the
    caller's ``out`` buffers as given, other tensors as the array type the producer gave."""
    leaves = [outs[i] if i in outs else as_kind(t, m.kind) for i, (t, m) in enumerate(zip(tensors, metas, strict=True))]
    return values.unflatten(skeleton, leaves)


def as_kind(tensor: torch.Tensor, kind: TensorKind) -> Any:
    """The array type the producer gave: numpy on the host; cupy on a GPU where cupy is
    installed; otherwise the torch tensor itself (DLPack producers other than cupy)."""
    if kind is TensorKind.NUMPY and tensor.device.type == "cpu":
        return tensor.numpy()
    if kind is TensorKind.CUPY and tensor.device.type == "cuda":
        try:
            import cupy
        except ImportError:
            return tensor
        return cupy.from_dlpack(tensor)
    return tensor
