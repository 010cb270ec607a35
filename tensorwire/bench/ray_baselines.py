"""Ray's own ways of moving tensors, for the benchmarks that compare tensorwire with them: the
object store (``put`` once, ``take`` in each consumer) and Ray's direct transport over a
collective group (plain Ray actor classes with ``@ray.method(tensor_transport=...)``). Bench
only: nothing in the library reads a value this way. Ray is imported lazily, in each function.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

from tensorwire.transport.config import validate_timeout

__all__ = ["cluster_gpus", "create_rdt_group", "kill", "put", "rdt_actor_class", "take"]


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
