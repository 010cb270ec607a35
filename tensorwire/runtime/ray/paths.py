"""Reading Ray's references for ``tw.get``: a direct-transport reference (Ray reads it, with
tensorwire's read options for its own), an object-store value, and waiting for calls without
fetching their values. (Ray's own ways of moving tensors, for the benchmarks that compare with
them, are in :mod:`tensorwire.bench.ray_baselines`.)
"""

from __future__ import annotations

from typing import Any

from tensorwire.errors import OwnerDiedError, TransferTimeoutError
from tensorwire.transport.config import validate_timeout

__all__ = ["get_direct", "object_store_value", "wait_calls"]


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
    apply to this read only (:func:`.transport_options.read_options`); for another transport's,
    ``out`` and ``device`` go through Ray's ``set_target_for_ref`` /
    ``set_target_device_for_ref``, which stay set on the reference.

    Raises:
        ValueError: ``view=``, which Ray's reads do not take; ``transport=`` for another
            transport's reference; an ``out`` that is not a tensor or a list of tensors.
        OwnerDiedError: The producing actor died. TransferTimeoutError: past ``timeout_s``.
    """
    import ray
    import torch

    from tensorwire.runtime.ray import transport as ray_transport
    from tensorwire.runtime.ray.transport_options import read_options

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
    """``ray.get`` of one reference (of the object store: :func:`.env.ray_result`, which
    does not block an async actor's event loop; of a direct transport: ``ray.get`` itself, as
    Ray's ``await`` and futures do not read those in Ray 2.60, and in an async actor Ray logs
    a one-time warning about it).

    Raises:
        OwnerDiedError: The producing actor died. TransferTimeoutError: past ``timeout_s``.
    """
    import ray

    from tensorwire.runtime.ray.env import ray_result

    timeout = None if timeout_s is None else validate_timeout(timeout_s)
    try:
        if direct:
            return ray.get(object_ref, timeout=timeout)
        return ray_result(object_ref, timeout)
    except (TimeoutError, ray.exceptions.GetTimeoutError):
        raise TransferTimeoutError(f"the Ray call has not finished within {timeout_s} s") from None
    except ray.exceptions.ObjectFetchTimedOutError as e:
        raise TransferTimeoutError(f"Ray gave up reading the value: {e}") from e
    except ray.exceptions.ActorDiedError as e:
        from tensorwire.runtime.ray.errors import ProducerDiedError

        raise ProducerDiedError(
            f"the actor that was producing this value died before returning it: {e}", e.actor_id
        ) from e
    except ray.exceptions.RayActorError as e:  # (not known to have died: unavailable, for one)
        raise OwnerDiedError(f"the actor producing this value cannot be reached: {e}") from e


def wait_calls(object_refs: list[Any], *, num_returns: int, timeout_s: float | None) -> list[Any]:
    """Those of ``object_refs`` whose calls have finished (at least ``num_returns`` unless
    ``timeout_s`` passes), without fetching their values."""
    import ray

    ready, _waiting = ray.wait(list(object_refs), num_returns=num_returns, timeout=timeout_s, fetch_local=False)
    return list(ready)
