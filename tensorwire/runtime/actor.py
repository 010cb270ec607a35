"""``tw.remote`` and ``tw.method``: Ray actors and tasks whose tensors travel by reference.

``@tw.remote(**ray_options)`` on a class makes a Ray actor class whose every method first
resolves :class:`~tensorwire.runtime.ref.Ref` arguments (top level, or nested in lists,
tuples and dicts) into tensors on the actor's device, fetching several concurrently. A
method marked ``@tw.method`` returns its value *by reference*: the tensors stay in the actor;
the caller gets a pending ``Ref`` at once, and only metadata goes through Ray.

On a function, ``@tw.remote`` makes a Ray task with the same argument resolution. A task's
result is *staged* in Ray's object store: the worker process that ran the task may be reused
or exit, so its tensors cannot stay with it. References the task created itself are
materialized into the result for the same reason.

Ray is imported only when an actor or task is created or called.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

from tensorwire.runtime import values
from tensorwire.runtime.handles import (
    CALL_KWARG,
    PLAIN,
    ActorHandle,
    ActorMethod,
    MethodOptions,
    call_options,
    check_transport,
    get_actor,
    make_handle,
)
from tensorwire.runtime.hooks import HOOK_METHOD, run_hook
from tensorwire.runtime.pending import pending_ref
from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.runtime.ray_env import configure_process, configured, mark_async_actor
from tensorwire.runtime.ref import Ref
from tensorwire.runtime.registrations import with_registrations

__all__ = [
    "HOOK_METHOD",
    "ActorClass",
    "ActorHandle",
    "ActorMethod",
    "MethodOptions",
    "RemoteFunction",
    "check_transport",
    "get_actor",
    "make_handle",
    "method",
    "passthrough",
    "remote",
]

_METHOD_ATTR = "__tensorwire_method__"
_CALL_KWARG = CALL_KWARG
_LIFTED_PREFIX = "__tw_lifted_"


class _Lifted:
    """Stands in an argument for a pending reference whose Ray ``ObjectRef`` was lifted to a
    top-level keyword argument, so that Ray waits for the producing call and delivers its
    state with the call (no extra round trip in the callee)."""

    __slots__ = ("index", "pin_id", "transport")

    def __init__(self, index: int, pin_id: bytes, transport: str) -> None:
        self.index, self.pin_id, self.transport = index, pin_id, transport

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Lifted, (self.index, self.pin_id, self.transport))


def _lift_pending(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Caller: replace pending references in the arguments by :class:`_Lifted` markers and add
    their ``ObjectRef``s as top-level keyword arguments (Ray resolves only top-level ones)."""
    lifted: list[Any] = []

    def leaf(item: Any, _path: str) -> Any:
        if isinstance(item, passthrough):
            wrapped = passthrough.__new__(passthrough)
            wrapped.ref = leaf(item.ref, _path)  # may become a _Lifted marker
            return wrapped
        if not isinstance(item, Ref):
            return values.DESCEND
        pending = item.pending
        if item.state is not None or pending is None or pending.staged:
            return _as_plain(item)
        reduced = pending.reduce()  # a new transit pin, announced when this process resolves
        if reduced is None:
            return item  # resolved meanwhile: travels as a direct reference
        object_ref, _staged, pin_id, transport = reduced[1]
        lifted.append(object_ref)
        return _Lifted(len(lifted) - 1, pin_id, transport)

    new_args, new_kwargs = values.transform((args, kwargs), leaf)
    for index, object_ref in enumerate(lifted):
        new_kwargs[f"{_LIFTED_PREFIX}{index}"] = object_ref
    return new_args, new_kwargs


def _as_plain(ref: Ref) -> Ref:
    """``ref`` as an argument that pickles as a tensorwire reference: a resolved result of a
    Ray call is also a ``ray.ObjectRef``, which Ray would pass by its id instead. (No hold of
    its own: the copy lives only while the call's arguments are pickled.)"""
    if type(ref) is Ref or ref.state is None:
        return ref  # staged results do go by their id: Ray delivers the value
    return ref.plain_copy()


def method(
    fn: Callable[..., Any] | None = None, *, transport: str = "", resolve: bool = True, snapshot: bool = False
) -> Any:
    """Mark an actor method to return its value by reference (``@tw.method`` or ``@tw.method(...)``).

    The returned tensors are kept by reference, like a Python object: if the actor changes
    them in place before a consumer fetches, the consumer sees the change. Use
    ``snapshot=True`` to hand out a copy taken when the method returns.
    """
    name = check_transport(transport, "@tw.method(transport=...)")
    if name is None:
        raise ValueError("@tw.method(transport='object_store') is a plain method: leave out @tw.method")
    options = MethodOptions(by_ref=True, transport=name, resolve=resolve, snapshot=snapshot)

    def mark(target: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(target):
            raise TypeError(f"@tw.method decorates methods, got {type(target).__name__}")
        setattr(target, _METHOD_ATTR, options)
        return target

    return mark(fn) if fn is not None else mark


class passthrough:
    """Wrap an argument so that its ``Ref`` reaches the method unresolved."""

    __slots__ = ("ref",)

    def __init__(self, ref: Ref) -> None:
        if not isinstance(ref, Ref):
            raise TypeError(f"tw.passthrough wraps a Ref, got {type(ref).__name__}")
        self.ref = ref


# ---------------------------------------------------------------------- inside the actor / task


def _actor_device() -> Any:
    """The device Ref arguments land on in this process: its first visible GPU, if Ray gave it one."""
    import ray
    import torch

    if torch.cuda.is_available() and ray.get_gpu_ids():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _resolve_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], call: dict[str, Any], resolve: bool) -> Any:
    """``args``/``kwargs`` with Refs replaced by their values (fetched concurrently)."""
    from tensorwire.runtime.api import get_arguments
    from tensorwire.runtime.raycompat import Arrived, state_of

    states = {int(k[len(_LIFTED_PREFIX) :]): kwargs.pop(k) for k in list(kwargs) if k.startswith(_LIFTED_PREFIX)}
    found: list[Ref] = []

    def as_ref(item: Any) -> Any:
        if not isinstance(item, _Lifted):
            return item
        state = state_of(states[item.index])  # Ray delivered the call's state with this call
        return Ref(state._replace(pin_id=item.pin_id, transport=item.transport or state.transport))

    def leaf(item: Any, _path: str) -> Any:
        if isinstance(item, passthrough):
            return as_ref(item.ref)
        item = as_ref(item)
        if isinstance(item, Arrived):  # a reference Ray resolved as a top-level argument
            item = Ref(item.state._replace(pin_id=b""))
        if isinstance(item, Ref):
            if not resolve:
                return item
            found.append(item)
            return values.Slot(len(found) - 1)
        return values.DESCEND

    skeleton = values.transform((args, kwargs), leaf)
    if not found:
        return skeleton
    device = call.get("device") or _actor_device()
    # Arguments are inputs the method consumes (often copying them into its own parameters):
    # host values come by one copy into pooled memory that the next call's arguments reuse,
    # GPU values as zero-copy views where the transport allows.
    fetched = get_arguments(found, device=device, transport=call.get("transport", ""))
    return values.unflatten(skeleton, fetched)


def _publish(result: Any, transport: str, snapshot: bool) -> Any:
    """Producer: register the method's value and return the state that travels through Ray."""
    from tensorwire.runtime.api import put
    from tensorwire.runtime.raycompat import Published

    if snapshot:
        skeleton, tensors, _ = values.flatten(result)
        result = values.unflatten(skeleton, [t.clone() for t in tensors])
    state = put(result).outgoing_state()  # pinned until the caller registers
    return Published(state._replace(transport=transport).to_bytes())


def _returns_by_ref(options: MethodOptions, call: dict[str, Any]) -> tuple[bool, str]:
    """Whether this call returns by reference (the method's mark, or ``.options(tensor_transport=)``)."""
    return call.get("by_ref", options.by_ref), call.get("ref_transport", options.transport)


def _decorate_invocation(options: MethodOptions, invocation: Callable[..., Any]) -> Callable[..., Any]:
    """Ray's invocation decorator of every method of a tensorwire actor (``__ray_invocation_decorator__``):
    runs in the *caller*, whatever handle it holds (``Actor.remote()``, ``ray.get_actor``, one
    passed through a task). Lifts pending references out of the arguments and makes the
    result of a by-reference call a pending :class:`Ref`."""

    def invoke(args: Any, kwargs: Any) -> Any:
        kwargs = dict(kwargs or {})
        by_ref, transport = _returns_by_ref(options, kwargs.get(_CALL_KWARG) or {})
        args, kwargs = _lift_pending(tuple(args or ()), kwargs)
        result = invocation(args, kwargs)
        if by_ref:
            import ray

            if isinstance(result, ray.ObjectRef):  # (not with num_returns > 1 or a generator)
                return pending_ref(result, transport=transport)
        return result

    return invoke


def _materialize(result: Any) -> Any:
    """A task's result with references owned by this process replaced by their values."""
    from tensorwire.runtime.api import get

    me = runtime_agent().peer.agent_id

    def leaf(item: Any, _path: str) -> Any:
        if isinstance(item, Ref) and item.state is not None and item.state.desc.owner.agent_id == me:
            return get(item)
        return values.DESCEND

    return values.transform(result, leaf)


def _copy_identity(wrapper: Callable[..., Any], fn: Callable[..., Any]) -> None:
    """Give ``wrapper`` the name and doc of ``fn`` but not ``__wrapped__``: Ray must see the
    wrapper's own signature (which takes the hidden call options), not the user's."""
    for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(wrapper, attribute, getattr(fn, attribute, None))


def _wrap_method(fn: Callable[..., Any], options: MethodOptions, async_actor: bool) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):

        async def async_wrapper(self: Any, *args: Any, __tw_call__: dict[str, Any] | None = None, **kwargs: Any) -> Any:
            mark_async_actor()
            loop = asyncio.get_running_loop()
            call = __tw_call__ or {}
            if not configured():
                await loop.run_in_executor(None, configure_process)
            args, kwargs = await loop.run_in_executor(None, _resolve_arguments, args, kwargs, call, options.resolve)
            result = await fn(self, *args, **kwargs)
            by_ref, transport = _returns_by_ref(options, call)
            if by_ref:
                return await loop.run_in_executor(None, _publish, result, transport, options.snapshot)
            return result

        wrapper: Callable[..., Any] = async_wrapper
    else:

        def sync_wrapper(self: Any, *args: Any, __tw_call__: dict[str, Any] | None = None, **kwargs: Any) -> Any:
            if async_actor:
                mark_async_actor()
            call = __tw_call__ or {}
            configure_process()  # before user code: its ray.get of a Ref fetches, and the agent needs these
            args, kwargs = _resolve_arguments(args, kwargs, call, options.resolve)
            result = fn(self, *args, **kwargs)
            by_ref, transport = _returns_by_ref(options, call)
            return _publish(result, transport, options.snapshot) if by_ref else result

        wrapper = sync_wrapper
    _copy_identity(wrapper, fn)
    for key, value in vars(fn).items():
        if key.startswith("__ray"):
            setattr(wrapper, key, value)  # keep @ray.method(...) options
    wrapper.__ray_invocation_decorator__ = functools.partial(_decorate_invocation, options)  # type: ignore[attr-defined]
    return wrapper


def _tw_hook(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
    """Hidden method of every tensorwire actor: run registered hook ``key`` on this actor
    (:mod:`tensorwire.runtime.hooks`; collectives join groups and sync weights through it)."""
    return run_hook(self, key, *args, **kwargs)


def _method_table(cls: type) -> dict[str, MethodOptions]:
    table: dict[str, MethodOptions] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        static = inspect.getattr_static(cls, name)
        if inspect.isfunction(static):
            table[name] = getattr(static, _METHOD_ATTR, PLAIN)
    return table


# ---------------------------------------------------------------------- in the caller


def _ray_remote(target: Any, options: dict[str, Any]) -> Any:
    import ray

    return ray.remote(**options)(target) if options else ray.remote(target)


class ActorClass:
    """``@tw.remote`` on a class. ``.remote(*args)`` creates the actor; ``.options(**ray)``."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self._cls = cls
        self._options = options
        self._methods = _method_table(cls)
        async_actor = any(inspect.iscoroutinefunction(getattr(cls, name)) for name in self._methods)
        namespace = {name: _wrap_method(getattr(cls, name), opts, async_actor) for name, opts in self._methods.items()}
        namespace[HOOK_METHOD] = _tw_hook
        namespace["__module__"] = cls.__module__
        namespace["__qualname__"] = cls.__qualname__
        self._wrapped = type(cls.__name__, (cls,), namespace)
        self._ray_class: Any = None
        functools.update_wrapper(self, cls, updated=())

    def options(self, **options: Any) -> ActorClass:
        """A copy with more Ray actor options (``num_gpus``, ``max_concurrency``, ``name``,
        ``get_if_exists``...)."""
        return ActorClass(self._cls, {**self._options, **options})

    def remote(self, *args: Any, **kwargs: Any) -> ActorHandle:
        if self._ray_class is None:
            self._ray_class = _ray_remote(self._wrapped, self._options)
        options = with_registrations(self._options)  # run-time transport registrations
        ray_class = self._ray_class if options is self._options else self._ray_class.options(**options)
        return make_handle(ray_class.remote(*args, **kwargs), self._methods)


class RemoteFunction:
    """``@tw.remote`` on a function: a Ray task whose result is staged in the object store."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any], call: dict[str, Any] | None = None):
        self._fn = fn
        self._options = options
        self._call = call or {}
        self._ray_function: Any = None
        functools.update_wrapper(self, fn, updated=())

    def options(self, *, transport: str | None = None, device: Any = None, **ray_options: Any) -> RemoteFunction:
        """Per-call ``transport``/``device`` for this call's Ref arguments; the rest goes to Ray."""
        return RemoteFunction(
            self._fn, {**self._options, **ray_options}, {**self._call, **call_options(transport, device)}
        )

    def _task(self) -> Any:
        if self._ray_function is None:
            fn = self._fn

            def task(*args: Any, __tw_call__: dict[str, Any] | None = None, **kwargs: Any) -> Any:
                args, kwargs = _resolve_arguments(args, kwargs, __tw_call__ or {}, True)
                return _materialize(fn(*args, **kwargs))

            _copy_identity(task, fn)
            self._ray_function = _ray_remote(task, self._options)
        return self._ray_function

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        """Run the task; returns a staged :class:`Ref` to its result."""
        args, kwargs = _lift_pending(args, kwargs)
        if self._call:
            kwargs[_CALL_KWARG] = self._call
        task, options = self._task(), with_registrations(self._options)  # run-time transport registrations
        task = task if options is self._options else task.options(**options)
        return pending_ref(task.remote(*args, **kwargs), staged=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"remote function {self._fn.__name__} must be called with .remote(...)")


def remote(*args: Any, **options: Any) -> Any:
    """``@tw.remote`` / ``@tw.remote(**ray_options)`` on a class (actor) or a function (task)."""
    if args:
        if len(args) != 1 or options or not callable(args[0]):
            raise TypeError("use @tw.remote or @tw.remote(**ray_options) on a class or a function")
        return _make(args[0], {})
    return lambda target: _make(target, options)


def _make(target: Any, options: dict[str, Any]) -> Any:
    if inspect.isclass(target):
        return ActorClass(target, options)
    if callable(target):
        return RemoteFunction(target, options)
    raise TypeError(f"@tw.remote decorates classes and functions, got {type(target).__name__}")
