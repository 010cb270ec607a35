"""Where a version is assembled aside in a receiver, kept across pushes.

*Shadows*: a copy of each receiver tensor that a push with ``spec.shadow`` (``atomic``, or the
all-or-none default) writes into, published by one local copy inside the fence
(:func:`..commit.receiver.commit`), or by the two trading memory (:func:`swap_in`,
``publish="swap"``). Beside the tensor, on its device, or (``aside="host"``,
``spec.shadow_on_host``) in host memory, pinned where CUDA is, so that a GPU receiver holds
one copy of its weights on the GPU; publishing is then one host-to-device copy per tensor.
*Float8 staging*: a tensor of the wire dtype per float8
parameter, quantised into the parameter (or its shadow) with a per-tensor scale
(:func:`quantise`). Both are dropped by :func:`release`.
"""

from __future__ import annotations

import torch

from tensorwire.collectives.weight_sync.protocol.spec import PushSpec

__all__ = ["aside_nbytes", "destinations", "quantise", "release", "shadow_device", "shadow_of", "swap_in"]

_shadows: dict[tuple[str, int], torch.Tensor] = {}  # (sync id, param) -> shadow, or (sync id, -1 - param) fp8 staging


def release(sync_id: str) -> None:
    """Drop the shadows and float8 staging of sync ``sync_id`` in this process."""
    for key in [key for key in _shadows if key[0] == sync_id]:
        del _shadows[key]


def aside_nbytes(sync_id: str) -> int:
    """Bytes this receiver keeps aside for sync ``sync_id``: shadows and float8 staging."""
    return sum(t.numel() * t.element_size() for key, t in list(_shadows.items()) if key[0] == sync_id)


def _kept(
    key: tuple[str, int], shape: torch.Size, dtype: torch.dtype, device: torch.device, *, pinned: bool = False
) -> torch.Tensor:
    kept = _shadows.get(key)
    if kept is None or kept.shape != shape or kept.dtype != dtype or kept.device != device:
        kept = _shadows[key] = torch.empty(shape, dtype=dtype, device=device, pin_memory=pinned)
    return kept


def shadow_device(spec: PushSpec, target: torch.device) -> tuple[torch.device, bool]:
    """Where the shadow of a tensor on ``target`` goes, and whether pinned: beside it, or in
    host memory (``aside="host"``, pinned for a CUDA tensor; also for a loader's layout given
    as meta tensors, which have no memory)."""
    if not spec.shadow_on_host and target.type != "meta":
        return target, False
    return torch.device("cpu"), target.type == "cuda" and torch.cuda.is_available()


def _shadow(spec: PushSpec, i: int, target: torch.Tensor) -> torch.Tensor:
    """Target ``i``'s shadow (:func:`shadow_device`), kept between pushes."""
    device, pinned = shadow_device(spec, target.device)
    return _kept((spec.sync_id, i), target.shape, target.dtype, device, pinned=pinned)


def destinations(spec: PushSpec, targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Where each parameter's pieces land: the target itself, its shadow (assembled aside),
    or (float8) a staging tensor of the wire dtype. Kept between pushes."""
    wire = {r.param: r.wire_dtype for role in spec.roles for bucket in role.buckets for r in bucket}
    fp8 = {p for p, _scale in spec.scales}
    result = []
    for i, target in enumerate(targets):
        staged = _shadows.get((spec.sync_id, -1 - i))  # (a failover's next try may read none of it: kept)
        if i in fp8 and i in wire:
            result.append(_kept((spec.sync_id, -1 - i), target.shape, getattr(torch, wire[i]), target.device))
        elif i in fp8 and staged is not None:
            result.append(staged)
        elif spec.shadow:
            result.append(_shadow(spec, i, target))
        else:
            result.append(target)
    return result


def shadow_of(spec: PushSpec, targets: list[torch.Tensor], i: int) -> torch.Tensor:
    if not spec.shadow:
        return targets[i]
    return _shadow(spec, i, targets[i])


def quantise(spec: PushSpec, targets: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    """Float8 parameters: scale = amax of the piece / the dtype's max; write both (only those
    assembled in a staging tensor of the wire dtype)."""
    for param, scale_param in spec.scales:
        if dsts[param] is not _shadows.get((spec.sync_id, -1 - param)):
            continue
        out = shadow_of(spec, targets, param)
        high = dsts[param].float()
        top = torch.finfo(out.dtype).max
        scale = (high.abs().max() / top).clamp(min=1e-12)
        out.copy_((high / scale).clamp(-top, top).to(out.dtype))
        shadow_of(spec, targets, scale_param).fill_(scale.item())


def swap_in(spec: PushSpec, targets: list[torch.Tensor], i: int) -> None:
    """Publish target ``i`` by trading memory with its shadow (``publish="swap"``): the tensor
    object stays (a module's parameter stays the same ``Parameter``) and now holds the shadow's
    memory, which has the new version; the shadow takes the old memory, for the next push to
    fill. No bytes are copied. Views taken of the target before see the old memory."""
    target, shadow = targets[i], shadow_of(spec, targets, i)
    with torch.no_grad():
        old = target.data  # holds the target's memory while the two trade
        target.set_(shadow.untyped_storage(), shadow.storage_offset(), shadow.size(), shadow.stride())
        shadow.set_(old.untyped_storage(), old.storage_offset(), old.size(), old.stride())
