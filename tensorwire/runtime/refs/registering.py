"""Registering tensors as one object of this process: what ``tw.put``, the registered Ray
transport and the collectives build on."""

from __future__ import annotations

from typing import Any

import torch

from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.transport import metadata
from tensorwire.transport.contract import ObjectDescriptor, TensorKind, TensorMeta
from tensorwire.transport.hw import topology
from tensorwire.transport.packing import packed_layout

__all__ = ["register_tensors"]


def register_tensors(tensors: list[torch.Tensor], kinds: list[TensorKind] | None = None) -> ObjectDescriptor:
    """Register contiguous ``tensors`` as one object of this process, with no reference to it:
    the caller frees it (``runtime_agent().free(desc)``). What :func:`put` and the
    collectives build on.

    Made per tensor in plain calls (a state dict of 1,024 tensors is registered every step):
    device names and dtype names are worked out once per device and dtype.
    """
    kinds = kinds or [TensorKind.TORCH] * len(tensors)
    nbytes_each = [t.nbytes for t in tensors]
    offsets, packed_nbytes = packed_layout(nbytes_each)
    devices: dict[torch.device, tuple[str, str]] = {}  # device -> (name, GPU UUID)
    metas = []
    for t, nbytes, offset, kind in zip(tensors, nbytes_each, offsets, kinds, strict=True):
        device = t.device
        named = devices.get(device)
        if named is None:
            uuid = topology.cuda_uuid(device.index or 0) if device.type == "cuda" else ""
            named = devices[device] = (str(device), uuid)
        metas.append(TensorMeta(tuple(t.shape), metadata.dtype_name(t.dtype), named[0], nbytes, offset, kind, named[1]))
    ready = _ready_events({d.index or 0 for d in devices if d.type == "cuda"})
    return runtime_agent().register(tensors, tuple(metas), packed_nbytes, ready=ready)


def _ready_events(cuda_devices: set[int]) -> list[Any]:
    """One CUDA event per device index, recorded on its current stream after the work queued so far."""
    events = []
    for index in sorted(cuda_devices):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        events.append((index, event))
    return events
