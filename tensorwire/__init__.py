"""tensorwire: direct device-to-device tensor transport.

Facade only; heavy modules (torch, grpc, the agent) load on first use of an attribute.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import TYPE_CHECKING, Any

from tensorwire import errors
from tensorwire.errors import (
    DeviceUnavailableError,
    NoTransportError,
    ObjectFreedError,
    OwnerDiedError,
    PeerLostError,
    PermissionDeniedError,
    TensorwireError,
    TrainerLost,
    TransferAbortedError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
    UnresolvedRefError,
)

if TYPE_CHECKING:
    from tensorwire import collectives as collective
    from tensorwire.collectives import WeightSync
    from tensorwire.runtime.api import free, get, put, stats, wait, wait_tensor_freed
    from tensorwire.runtime.ray.actor import ActorHandle, get_actor, method, passthrough, remote
    from tensorwire.runtime.ray.start import init
    from tensorwire.runtime.refs.ref import Ref

__version__ = "0.1.0"

__all__ = [
    "ActorHandle",
    "DeviceUnavailableError",
    "NoTransportError",
    "ObjectFreedError",
    "OwnerDiedError",
    "PeerLostError",
    "PermissionDeniedError",
    "Ref",
    "TensorwireError",
    "TrainerLost",
    "TransferAbortedError",
    "TransferTimeoutError",
    "TransportError",
    "TransportUnavailableError",
    "UnresolvedRefError",
    "WeightSync",
    "collective",
    "errors",
    "free",
    "get",
    "get_actor",
    "get_async",
    "init",
    "method",
    "passthrough",
    "put",
    "register_ray_transport",
    "remote",
    "stats",
    "wait",
    "wait_tensor_freed",
]

_LAZY = {
    "init": "tensorwire.runtime.ray.start",
    "wait": "tensorwire.runtime.api",
    "get_async": "tensorwire.runtime.api",
    "remote": "tensorwire.runtime.ray.actor",
    "get_actor": "tensorwire.runtime.ray.actor",
    "ActorHandle": "tensorwire.runtime.ray.actor",
    "wait_tensor_freed": "tensorwire.runtime.api",
    "method": "tensorwire.runtime.ray.actor",
    "passthrough": "tensorwire.runtime.ray.actor",
    "put": "tensorwire.runtime.api",
    "get": "tensorwire.runtime.api",
    "free": "tensorwire.runtime.api",
    "stats": "tensorwire.runtime.api",
    "Ref": "tensorwire.runtime.refs.ref",
    "WeightSync": "tensorwire.collectives",
}


def register_ray_transport() -> None:
    """Register tensorwire with Ray as the tensor transport ``"tensorwire"``, so that
    ``@ray.method(tensor_transport="tensorwire")`` and ``ray.put(..., _tensor_transport=
    "tensorwire")`` move tensors through tensorwire. Idempotent.

    Ray checks the name when a class is decorated, and gives the transport to actors created
    after the registration: call this before both, in the process that creates the actors.
    ``tw.init()`` does, and so does ``import tensorwire`` where Ray is imported already.
    """
    try:
        from tensorwire.runtime.ray import transport as ray_transport
    except ImportError as e:
        raise ImportError(
            f"tensor_transport='tensorwire' needs Ray's custom tensor transports "
            f"(ray.experimental.register_tensor_transport; verified on Ray 2.60): {e}"
        ) from e
    ray_transport.register()


def __getattr__(name: str) -> Any:
    if name == "collective":  # tw.collective.create_group(...)
        value = importlib.import_module("tensorwire.collectives")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorwire' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if "ray" in sys.modules:  # Ray checks tensor_transport names when classes are decorated
    # the one thing import does (docs/architecture.md, "Registration with Ray"); a Ray without
    # custom tensor transports is left alone here: tw.register_ray_transport() says what is missing
    with contextlib.suppress(ImportError):
        register_ray_transport()
