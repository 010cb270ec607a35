"""Reading Ray's references for ``tw.get`` (direct transport and object store), and Ray's
own ways of moving tensors for the benchmarks that compare tensorwire with them (the object
store: ``put`` once, ``get`` in each consumer; Ray's direct transport over a collective
group). Every such Ray call is here, so that Ray is imported in the runtime only.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

from tensorwire.errors import OwnerDiedError, TransferTimeoutError
from tensorwire.transport.config import validate_timeout

__all__ = [
    "cluster_gpus",
    "create_rdt_group",
    "get_direct",
    "kill",
    "object_store_value",
    "put",
    "rdt_actor_class",
    "take",
    "wait_calls",
]


def put(value: Any) -> list[Any]:
    """Put ``value`` in Ray's object store; returns it boxed (a list holding the ``ObjectRef``,
    so that passing it to another call does not resolve it)."""
    import ray

    return [ray.put(value)]


def take(boxed: Sequence[Any], *, timeout_s: float = 600.0) -> Any:
    """The value of a boxed object-store entry (see :func:`put`)."""
    import ray

    return ray.get(boxed[0], timeout=validate_timeout(timeout_s))


def rdt_actor_class(cls: type, methods: dict[str, tuple[Callable[..., Any], str]], **options: Any) -> Any:
    """A plain Ray actor class of ``cls`` with RDT enabled, plus ``methods``: name ->
    (function, the tensor transport its result travels by)."""
    import ray

    namespace: dict[str, Any] = {}
    for name, (fn, transport) in methods.items():
        # a fresh function per method: ray.method marks the function object it is given
        copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        copy.__qualname__ = f"{cls.__qualname__}.{name}"
        namespace[name] = ray.method(tensor_transport=transport)(copy)
    namespace["__module__"] = cls.__module__
    subclass = type(cls.__name__, (cls,), namespace)
    return ray.remote(enable_tensor_transport=True, **options)(subclass)


def create_rdt_group(actors: Sequence[Any], backend: str) -> None:
    """A Ray collective group over plain Ray ``actors`` (RDT's nccl/gloo transports need one)."""
    from ray.experimental.collective import create_collective_group

    create_collective_group(list(actors), backend=backend)


def kill(actor: Any) -> None:
    """End a plain Ray actor (or a tensorwire one, by its Ray handle)."""
    import ray

    ray.kill(getattr(actor, "ray_handle", actor))


def cluster_gpus() -> float:
    """GPUs in the Ray cluster."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def get_direct(
    object_ref: Any,
    *,
    timeout_s: float | None,
    device: Any = None,
    out: Any = None,
    transport: str = "",
    view: bool = False,
) -> Any:
    """``tw.get`` of a reference of Ray's direct transport (``@tw.method``,
    ``tensor_transport="tensorwire"`` or another): Ray reads it. For tensorwire's references
    ``out`` (a tensor, or a list of tensors in the value's order), ``device`` and ``transport``
    apply to this read only (:func:`.ray_transport_options.read_options`); for another transport's,
    ``out`` and ``device`` go through Ray's ``set_target_for_ref`` /
    ``set_target_device_for_ref``, which stay set on the reference.

    Raises:
        ValueError: ``view=``, which Ray's reads do not take; ``transport=`` for another
            transport's reference; an ``out`` that is not a tensor or a list of tensors.
        OwnerDiedError: The producing actor died. TransferTimeoutError: past ``timeout_s``.
    """
    import ray
    import torch

    from tensorwire.runtime import ray_transport
    from tensorwire.runtime.ray_transport_options import read_options

    ours = str(object_ref.tensor_transport()).upper() == ray_transport.NAME
    if view or (transport and not ours):
        raise ValueError(
            "tw.get(ref, view=) (and transport= for another transport's reference): this reference is read by "
            "Ray's direct transport, which returns copies and picks its own path; leave those out"
        )
    buffers = None
    if out is not None:
        buffers = [out] if isinstance(out, torch.Tensor) else out
        if not isinstance(buffers, (list, tuple)) or not all(isinstance(b, torch.Tensor) for b in buffers):
            raise ValueError(
                "tw.get(ref, out=) of a Ray direct-transport reference takes a tensor or a list of tensors in the "
                f"value's order (ray.experimental.set_target_for_ref), got {type(out).__name__}"
            )
    if not ours:  # another transport: Ray's targets (which stay set on the reference)
        if buffers is not None:
            ray.experimental.set_target_for_ref(object_ref, list(buffers))
        elif device is not None:
            ray.experimental.set_target_device_for_ref(object_ref, str(device))
        return _ray_get(object_ref, timeout_s, direct=True)
    ray_transport.register()  # a task's process may not have it yet
    targets = list(buffers) if buffers is not None else None
    with read_options(transport=transport, target_buffers=targets, device=device):
        return _ray_get(object_ref, timeout_s, direct=True)


def object_store_value(object_ref: Any, timeout_s: float | None) -> Any:
    """The value of a Ray ``ObjectRef`` of Ray's object store (a task's result...).

    Raises:
        OwnerDiedError: The producing actor died. TransferTimeoutError: past ``timeout_s``.
    """
    return _ray_get(object_ref, timeout_s, direct=False)


def _ray_get(object_ref: Any, timeout_s: float | None, *, direct: bool) -> Any:
    """``ray.get`` of one reference (of the object store: :func:`ray_env.ray_result`, which
    does not block an async actor's event loop; of a direct transport: ``ray.get`` itself, as
    Ray's ``await`` and futures do not read those in Ray 2.60, and in an async actor Ray logs
    a one-time warning about it).

    Raises:
        OwnerDiedError: The producing actor died. TransferTimeoutError: past ``timeout_s``.
    """
    import ray

    from tensorwire.runtime.ray_env import ray_result

    timeout = None if timeout_s is None else validate_timeout(timeout_s)
    try:
        if direct:
            return ray.get(object_ref, timeout=timeout)
        return ray_result(object_ref, timeout)
    except (TimeoutError, ray.exceptions.GetTimeoutError):
        raise TransferTimeoutError(f"the Ray call has not finished within {timeout_s} s") from None
    except ray.exceptions.ObjectFetchTimedOutError as e:
        raise TransferTimeoutError(f"Ray gave up reading the value: {e}") from e
    except ray.exceptions.RayActorError as e:
        raise OwnerDiedError(f"the actor that was producing this value died before returning it: {e}") from e


def wait_calls(object_refs: list[Any], *, num_returns: int, timeout_s: float | None) -> list[Any]:
    """Those of ``object_refs`` whose calls have finished (at least ``num_returns`` unless
    ``timeout_s`` passes), without fetching their values."""
    import ray

    ready, _waiting = ray.wait(list(object_refs), num_returns=num_returns, timeout=timeout_s, fetch_local=False)
    return list(ready)
