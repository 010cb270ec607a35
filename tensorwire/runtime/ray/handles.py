"""Handles and methods of tensorwire actors, in the caller: ``handle.method.options(...).remote()``.

A tensorwire handle is also a ``ray.actor.ActorHandle``; what a call returns is decided by the
method itself (a ``@tw.method`` is Ray's ``@ray.method(tensor_transport="tensorwire")``) and
its arguments are lifted by Ray's invocation decorator of the method (``actor.py``), so Ray's
own handles of the same actor (``ray.get_actor``) work the same. What this module adds:
per-call options (``transport``, ``device``, RDT's ``tensor_transport`` with tensorwire's
transport names), checked when given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CALL_KWARG",
    "PLAIN",
    "ActorHandle",
    "ActorMethod",
    "MethodOptions",
    "call_options",
    "check_transport",
    "get_actor",
    "make_handle",
]

CALL_KWARG = "__tw_call__"


@dataclass(frozen=True)
class MethodOptions:
    """Options of a method, from ``@tw.method(...)`` (or defaults for plain methods).

    Attributes:
        by_ref: The method returns its value by reference (``@tw.method``).
        transport: Default transport for consumers of the returned reference ("" = auto).
        resolve: Resolve ``Ref`` arguments before the method runs.
        snapshot: Copy the returned tensors, so later in-place changes in the actor do not
            show in what consumers fetch.
    """

    by_ref: bool = False
    transport: str = ""
    resolve: bool = True
    snapshot: bool = False


PLAIN = MethodOptions()


def check_transport(name: Any, what: str) -> str | None:
    """A transport name as given to ``@tw.method`` or ``.options``, checked now rather than at
    fetch time: "" for automatic ("", "auto" or "tensorwire"), None for Ray's "object_store" (not by
    reference), else a registered name (Ray's upper-case spellings accepted).

    Raises:
        TypeError: Not a string. ValueError: Not a registered transport.
    """
    if not isinstance(name, str):
        raise TypeError(f"{what}: a transport name is a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key in ("", "auto", "tensorwire"):
        return ""
    if key == "object_store":
        return None
    from tensorwire.transport import registry

    known = registry.registered_transports()
    if key not in known:
        raise ValueError(
            f"{what}: {name!r} is not a tensorwire transport; available: {', '.join(known)}, 'auto' "
            "(or 'object_store' for a plain return through Ray)"
        )
    return key


def call_options(transport: str | None, device: Any) -> dict[str, Any]:
    """The call options a callee reads (``__tw_call__``): how its reference arguments are fetched."""
    call: dict[str, Any] = {}
    if transport:
        name = check_transport(transport, ".options(transport=...)")
        if name is None:
            raise ValueError(".options(transport='object_store'): Ref arguments are always fetched directly")
        if name:
            call["transport"] = name
    if device is not None:
        call["device"] = str(device)
    return call


def _by_reference(tensor_transport: str, options: MethodOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """``.options(tensor_transport=)`` of one call: (call options, Ray options). A transport
    name (or "auto"/"tensorwire") makes the call return through the registered transport with
    that name as its readers' default; "object_store" leaves a plain method plain.

    Raises:
        ValueError: An unknown name, or "object_store" on a ``@tw.method`` (Ray cannot switch a
            decorated method's transport off per call).
    """
    name = check_transport(tensor_transport, ".options(tensor_transport=...)")
    if name is None:
        if options.by_ref:
            raise ValueError(
                ".options(tensor_transport='object_store') on a @tw.method: Ray cannot switch a method's tensor "
                "transport off per call; call a plain method for a value through Ray's object store"
            )
        return {}, {}
    from tensorwire.runtime.ray import transport as ray_transport

    return {"ref_transport": name}, {"tensor_transport": ray_transport.NAME}


class ActorMethod:
    """``handle.method``: call it with ``.remote(...)``; ``.options(transport=, device=,
    tensor_transport=, **ray)``."""

    def __init__(
        self, handle: Any, name: str, options: MethodOptions, call: dict[str, Any], ray_options: dict[str, Any]
    ):
        self._handle = handle
        self._name = name
        self._options = options
        self._call = call
        self._ray_options = ray_options

    def options(
        self,
        *,
        transport: str | None = None,
        device: Any = None,
        tensor_transport: str | None = None,
        **ray_options: Any,
    ) -> ActorMethod:
        """Per-call options: ``transport``/``device`` for fetching this call's Ref arguments;
        ``tensor_transport`` (Ray direct transport's spelling) makes this call return by
        reference (a transport name or "auto"), or through Ray ("object_store"); the rest goes
        to Ray's ``.options``.

        Raises:
            ValueError: An unknown transport name.
        """
        call = {**self._call, **call_options(transport, device)}
        if tensor_transport is not None:
            by_ref, ray_extra = _by_reference(tensor_transport, self._options)
            call, ray_options = {**call, **by_ref}, {**ray_options, **ray_extra}
        return ActorMethod(self._handle, self._name, self._options, call, {**self._ray_options, **ray_options})

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method; Ray's ``ObjectRef`` of its result (by reference for a
        ``@tw.method`` or with ``tensor_transport``). Ray's invocation decorator of the method
        lifts reference arguments (``actor._decorate_invocation``)."""
        if self._call:
            kwargs[CALL_KWARG] = self._call
        ray_method = getattr(self._handle, self._name)
        if self._ray_options:
            ray_method = ray_method.options(**self._ray_options)
        return ray_method.remote(*args, **kwargs)


class ActorHandle:
    """A tensorwire actor: ``handle.method.remote(...)``. Also a ``ray.actor.ActorHandle``
    (``ray.kill(handle)``); ``handle.ray_handle`` is Ray's own handle. Picklable: pass it to
    other actors and tasks. Handles Ray gives directly (``ray.get_actor``) work the same,
    except for ``.options(transport=, device=, tensor_transport=)``: wrap them with
    ``tw.get_actor`` for those."""

    ray_handle: Any
    _methods: dict[str, MethodOptions] | None

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__
        if "ray_handle" not in state or name.startswith("_ray") or name.startswith("__"):
            if name.startswith("__ray") and "ray_handle" in state:
                return getattr(state["ray_handle"], name)  # __ray_terminate__, __ray_ready__
            raise AttributeError(name)
        methods = state.get("_methods")
        if methods is not None and name not in methods:
            raise AttributeError(f"actor has no method {name!r}; methods: {sorted(methods)}")
        getattr(state["ray_handle"], name)  # Ray's AttributeError for unknown methods
        return ActorMethod(state["ray_handle"], name, (methods or {}).get(name, PLAIN), {}, {})

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (make_handle, (self.ray_handle, self._methods))

    def __repr__(self) -> str:
        return f"tw.ActorHandle({self.ray_handle!r})"


def make_handle(ray_handle: Any, methods: dict[str, MethodOptions] | None = None) -> ActorHandle:
    """A tensorwire handle over Ray's ``ray_handle`` that is also a ``ray.actor.ActorHandle``:
    it shares the Ray handle's state and holds the Ray handle itself (so Ray's count of
    handles to the actor is that one's; this copy is marked as not counting)."""
    from tensorwire.runtime.ray import surface as ray_surface

    if isinstance(ray_handle, ActorHandle):
        ray_handle = ray_handle.ray_handle
    cls = _handle_class()
    handle = cls.__new__(cls)
    ray_surface.share_handle_state(handle, ray_handle)
    handle.__dict__.update(ray_handle=ray_handle, _methods=methods)
    return handle


_joined: type | None = None


def _handle_class() -> type:
    """:class:`ActorHandle` joined with ``ray.actor.ActorHandle`` (made on first use, so that
    importing tensorwire does not import Ray)."""
    global _joined
    if _joined is None:
        import ray

        _joined = type("ActorHandle", (ActorHandle, ray.actor.ActorHandle), {"__module__": ActorHandle.__module__})
    return _joined


def get_actor(name: str, namespace: str | None = None) -> ActorHandle:
    """``ray.get_actor`` returning a tensorwire handle (with ``.options(transport=, device=,
    tensor_transport=)``).

    Raises:
        ValueError: No actor of that name (Ray's error).
    """
    import ray

    return make_handle(ray.get_actor(name, namespace=namespace))
