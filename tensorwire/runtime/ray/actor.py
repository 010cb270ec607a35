"""``tw.remote`` and ``tw.method``: Ray actors and tasks whose tensors travel by reference.

``@tw.remote(**ray_options)`` on a class makes a Ray actor class. A method marked
``@tw.method`` is Ray's ``@ray.method(tensor_transport="tensorwire")``: its value stays in
the actor and the caller gets Ray's ``ObjectRef`` of it at once (Ray Direct Transport through
Ray's public extension point, :mod:`.transport`): ``ray.get`` reads it, and passed to
another call it is read by the callee, one-sided, over tensorwire's selector.

What ``tw.remote`` adds, in the caller (Ray's invocation decorator of each method) and in the
callee (the method's wrapper):

* references nested in arguments (lists, tuples, dicts; also keyword arguments) resolve like
  top-level positional ones: the caller lifts Ray's ``ObjectRef``s out to trailing positional
  arguments, where Ray transfers them, and the callee puts the values back in place;
  ``tw.Ref``s (``tw.put``) are fetched concurrently by the callee;
* per-call ``transport=`` / ``device=`` for those arguments (``.options`` on the method);
* ``@tw.method(transport=, snapshot=, resolve=)``: a default transport for readers, a copy at
  return, arguments handed over unresolved;
* at its first call, the actor moves the objects it has then to the garbage collector's
  permanent generation, so that full collections stay short (:mod:`.heap`);
* on a function, a Ray task with the same argument resolution, whose result goes through Ray's
  object store (the worker that ran the task may be reused or exit). A task takes a direct
  transport's reference boxed and reads it itself (Ray transfers to actors only).

Ray is imported only when an actor or task is created or called.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.ray.arguments import direct_references, lift, passthrough, resolve_arguments, wait_for_producers
from tensorwire.runtime.ray.env import configure_process, configured, mark_async_actor
from tensorwire.runtime.ray.handles import (
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
from tensorwire.runtime.ray.heap import freeze_at_first_call
from tensorwire.runtime.ray.hooks import HOOK_GROUP, HOOK_GROUP_THREADS, HOOK_METHOD, run_hook
from tensorwire.runtime.ray.transport_options import note_readers_transport, read_options
from tensorwire.runtime.ray.worker_transports import with_registrations
from tensorwire.runtime.refs import values
from tensorwire.runtime.refs.ref import Ref

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


def method(
    fn: Callable[..., Any] | None = None, *, transport: str = "", resolve: bool = True, snapshot: bool = False
) -> Any:
    """Mark an actor method to return its value by reference (``@tw.method`` or
    ``@tw.method(...)``): Ray's ``@ray.method(tensor_transport="tensorwire")`` plus
    ``transport`` (the readers' default transport, "" for automatic), ``resolve`` (False: the
    method gets its reference arguments unresolved) and ``snapshot``.

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


# ---------------------------------------------------------------------- inside the actor / task


def _returned(result: Any, options: MethodOptions, call: dict[str, Any]) -> Any:
    """Producer: what a by-reference call returns to Ray (copied for ``snapshot``), with the
    readers' default transport noted for the registered transport."""
    if options.snapshot:
        skeleton, tensors, _ = values.flatten(result)
        result = values.unflatten(skeleton, [t.clone() for t in tensors])
    transport = call.get("ref_transport", options.transport)
    if transport:
        note_readers_transport(result, transport)
    return result


def _by_ref(options: MethodOptions, call: dict[str, Any]) -> bool:
    """Whether this call returns by reference (``@tw.method``, or ``.options(tensor_transport=)``)."""
    return options.by_ref or "ref_transport" in call


def _decorate_invocation(options: MethodOptions, invocation: Callable[..., Any]) -> Callable[..., Any]:
    """Ray's invocation decorator of every method of a tensorwire actor (``__ray_invocation_decorator__``):
    runs in the *caller*, whatever handle it holds (``Actor.remote()``, ``ray.get_actor``, one
    passed through a task). Lifts references out of the arguments; the call's ``transport``
    reaches the reads Ray starts from here (so a call given one waits for the producers of its
    direct-transport arguments first). Returns Ray's reference as it is."""

    def invoke(args: Any, kwargs: Any) -> Any:
        kwargs = dict(kwargs or {})
        call = dict(kwargs.pop(_CALL_KWARG, None) or {})
        args, kwargs, count = lift(tuple(args or ()), kwargs, task=False, resolve=options.resolve)
        if count:
            call["lifted"] = count
        if call:
            kwargs[_CALL_KWARG] = call
        transport = call.get("transport", "")
        if transport:  # Ray starts a transfer from this thread only once its producer is done
            wait_for_producers(direct_references(args))
        with read_options(transport=transport):
            return invocation(args, kwargs)

    return invoke


def _materialize(result: Any) -> Any:
    """A task's result with references owned by this process replaced by their values."""
    from tensorwire.runtime.api import get

    me = runtime_agent().peer.agent_id

    def leaf(item: Any, _path: str) -> Any:
        if isinstance(item, Ref) and item.state.desc.owner.agent_id == me:
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
            freeze_at_first_call()
            args, kwargs = await loop.run_in_executor(None, resolve_arguments, args, kwargs, call, options.resolve)
            result = await fn(self, *args, **kwargs)
            return _returned(result, options, call) if _by_ref(options, call) else result

        wrapper: Callable[..., Any] = async_wrapper
    else:

        def sync_wrapper(self: Any, *args: Any, __tw_call__: dict[str, Any] | None = None, **kwargs: Any) -> Any:
            if async_actor:
                mark_async_actor()
            call = __tw_call__ or {}
            configure_process()  # before user code: its ray.get of a reference fetches, and the agent needs these
            freeze_at_first_call()
            args, kwargs = resolve_arguments(args, kwargs, call, options.resolve)
            result = fn(self, *args, **kwargs)
            return _returned(result, options, call) if _by_ref(options, call) else result

        wrapper = sync_wrapper
    _copy_identity(wrapper, fn)
    for key, value in vars(fn).items():
        if key.startswith("__ray"):
            setattr(wrapper, key, value)  # keep @ray.method(...) options
    wrapper.__ray_invocation_decorator__ = functools.partial(_decorate_invocation, options)  # type: ignore[attr-defined]
    if options.by_ref:
        import ray

        from tensorwire.runtime.ray import transport as ray_transport

        wrapper = ray.method(tensor_transport=ray_transport.NAME)(wrapper)
    return wrapper


def _tw_hook(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
    """Hidden method of every tensorwire actor: run registered hook ``key`` on this actor
    (:mod:`tensorwire.runtime.ray.hooks`; collectives join groups and sync weights through it)."""
    freeze_at_first_call()
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


def _with_hook_group(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the actor's concurrency group for hooks that run beside its methods
    (:data:`.hooks.HOOK_GROUP`) added to the user's groups."""
    groups = dict(options.get("concurrency_groups") or {})
    groups.setdefault(HOOK_GROUP, HOOK_GROUP_THREADS)
    return {**options, "concurrency_groups": groups}


class ActorClass:
    """``@tw.remote`` on a class. ``.remote(*args)`` creates the actor; ``.options(**ray)``."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self._cls = cls
        self._options = options
        self._methods = _method_table(cls)
        self._ray_class: Any = None
        functools.update_wrapper(self, cls, updated=())

    def options(self, **options: Any) -> ActorClass:
        """A copy with more Ray actor options (``num_gpus``, ``max_concurrency``, ``name``,
        ``get_if_exists``...)."""
        return ActorClass(self._cls, {**self._options, **options})

    def _ray_actor_class(self) -> Any:
        """Ray's actor class (made on first use: marking methods with the registered transport
        imports Ray). Receivers need ``enable_tensor_transport``: on unless the user said no."""
        if self._ray_class is None:
            from tensorwire.runtime.ray import transport as ray_transport

            ray_transport.register()
            cls = self._cls
            async_actor = any(inspect.iscoroutinefunction(getattr(cls, name)) for name in self._methods)
            namespace = {
                name: _wrap_method(getattr(cls, name), opts, async_actor) for name, opts in self._methods.items()
            }
            namespace[HOOK_METHOD] = _tw_hook
            namespace["__module__"] = cls.__module__
            namespace["__qualname__"] = cls.__qualname__
            wrapped = type(cls.__name__, (cls,), namespace)
            self._ray_class = _ray_remote(wrapped, _with_hook_group({"enable_tensor_transport": True, **self._options}))
        return self._ray_class

    def remote(self, *args: Any, **kwargs: Any) -> ActorHandle:
        ray_class = self._ray_actor_class()
        options = with_registrations(self._options)  # run-time transport registrations
        if options is not self._options and "concurrency_groups" in options:
            options = _with_hook_group(options)
        ray_class = ray_class if options is self._options else ray_class.options(**options)
        return make_handle(ray_class.remote(*args, **kwargs), self._methods)


class RemoteFunction:
    """``@tw.remote`` on a function: a Ray task whose result goes through Ray's object store."""

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
                args, kwargs = resolve_arguments(args, kwargs, __tw_call__ or {}, True)
                return _materialize(fn(*args, **kwargs))

            _copy_identity(task, fn)
            self._ray_function = _ray_remote(task, self._options)
        return self._ray_function

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task; returns Ray's ``ObjectRef`` of its result (in Ray's object store:
        ``ray.get`` or ``tw.get``, which also takes ``device=`` / ``out=``)."""
        args, kwargs, _lifted = lift(args, kwargs, task=True, resolve=True)  # a task's are boxed, never lifted
        if self._call:
            kwargs[_CALL_KWARG] = self._call
        task, options = self._task(), with_registrations(self._options)  # run-time transport registrations
        task = task if options is self._options else task.options(**options)
        return task.remote(*args, **kwargs)

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
