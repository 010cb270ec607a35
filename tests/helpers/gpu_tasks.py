"""Functions run in spawned workers by the GPU tests (importable without a GPU)."""

from __future__ import annotations

from typing import Any

import torch

import tensorwire as tw
from tests.helpers.tasks import digest

_kept: dict[str, Any] = {}


def cuda_state(seed: int = 0, count: int = 40) -> dict[str, torch.Tensor]:
    """A state dict on cuda:0: many tensors of mixed dtypes and sizes (several in one block)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    state = {}
    for i in range(count):
        n = 17 * (i + 1) if i % 4 else (1 << 18) + i
        dtype = (torch.float32, torch.bfloat16, torch.int64, torch.float16)[i % 4]
        base = torch.randn(n, generator=gen, device="cuda") * 100
        state[f"t{i}"] = base.to(dtype)
    state["empty"] = torch.empty(0, device="cuda")
    return state


def put_cuda_state(seed: int = 0) -> tuple[tw.Ref, str]:
    state = cuda_state(seed)
    _kept["state"] = state
    return tw.put(state), digest(state)


def put_cuda_filled(nbytes: int, fill: int = 7) -> tw.Ref:
    value = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda")
    _kept["filled"] = value
    return tw.put(value)


def put_cuda_pattern(nbytes: int) -> tw.Ref:
    """The benchmarks' byte pattern (``tensorwire.bench.ops.pattern``) on cuda:0."""
    from tensorwire.bench.ops import pattern

    value = pattern(nbytes, device="cuda")
    _kept.setdefault("patterns", []).append(value)
    return tw.put(value)


def put_after_slow_kernel(nbytes: int, fill: int) -> tw.Ref:
    """Queue a slow kernel then a fill on a side stream, and put without synchronising."""
    value = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(2e9))  # about a second of GPU time before the fill runs
        value.fill_(fill)
        ref = tw.put(value)  # the ready event is recorded on this stream
    _kept["slow"] = value
    return ref


def read_first(name: str) -> int:
    torch.cuda.synchronize()
    value = _kept[name]
    return int(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else int(next(iter(value.values()))[0])


def get_on_device(ref: tw.Ref, **kwargs: Any) -> dict[str, Any]:
    value = tw.get(ref, **kwargs)
    record = tw.stats()["recent"][-1]
    tensors = list(value.values()) if isinstance(value, dict) else [value]
    return {"digest": digest(value), "transport": record.transport, "devices": sorted({str(t.device) for t in tensors})}


def get_view_and_write(ref: tw.Ref) -> dict[str, Any]:
    view = tw.get(ref, view=True, transport="cuda_ipc")
    record = tw.stats()["recent"][-1]
    first = int(view[0])
    view[0] = 99
    torch.cuda.synchronize()
    return {"zero_copy": record.zero_copy, "first": first, "device": str(view.device)}


def put_cuda_unkept(nbytes: int) -> tw.Ref:
    """A CUDA value held only by tensorwire (freed when no process holds a reference)."""
    return tw.put(torch.full((nbytes,), 4, dtype=torch.uint8, device="cuda"))


def owned_and_allocated() -> tuple[int, int]:
    import gc

    gc.collect()
    torch.cuda.synchronize()
    return tw.stats()["objects_owned"], torch.cuda.memory_allocated()


def put_cupy(n: int) -> tuple[tw.Ref, str]:
    import cupy

    array = cupy.arange(n, dtype=cupy.float32)
    _kept["cupy"] = array
    return tw.put({"c": array}), digest({"c": torch.from_dlpack(array)})
