"""Registering tensors as one object of this process: what ``tw.put``, the registered Ray
transport and the collectives build on."""

from __future__ import annotations

from typing import Any

import torch

from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.transport import metadata
from tensorwire.transport.contract import ObjectDescriptor, TensorKind, TensorMeta
from tensorwire.transport.hw import topology
from tensorwire.transport.packing import packed_layout

__all__ = ["register_tensors"]


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
