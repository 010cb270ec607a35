"""References in a call's arguments: lifted out in the caller, put back in the callee.

Ray transfers direct-transport references (``@tw.method`` results) out of band only when they
are top-level positional arguments of an actor call. In the caller (Ray's invocation
decorator of each ``@tw.remote`` method, :func:`lift`), every such ``ObjectRef`` in the
arguments moves to a trailing positional argument and a :class:`_LiftedArgument` marks its place; in the callee (the
method's wrapper, :func:`resolve_arguments`) the values Ray delivered are put back and
``tw.Ref``s are fetched. References that must reach the method unresolved
(``tw.passthrough``, ``@tw.method(resolve=False)``) and a task's direct-transport references
(Ray transfers to actors only) are boxed instead.
"""

from __future__ import annotations

import time
from typing import Any

from tensorwire.runtime.api import is_object_ref as _is_object_ref
from tensorwire.runtime.refs import values
from tensorwire.runtime.refs.reading import place_value
from tensorwire.runtime.refs.ref import Ref
from tensorwire.transport.waiting import backoff

__all__ = ["direct_references", "lift", "passthrough", "resolve_arguments", "wait_for_producers"]

_PRODUCER_WAIT_S = 600.0  # a boxed direct-transport reference waits this long for its producer
_POLLS_BEFORE_ERROR_CHECK = 20  # about 0.6 s of polls for the metadata before looking for a failed call


class _LiftedArgument:
    """Stands in an argument for a Ray ``ObjectRef`` lifted to trailing positional argument
    ``index`` (Ray resolves, and transfers out of band, top-level positional ones only)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_LiftedArgument, (self.index,))


class _Unlifted:
    """A direct-transport ``ObjectRef`` handed over nested: to a task, which reads it itself
    (``tw.get``; Ray transfers to actors only), or to a method that takes it unresolved."""

    __slots__ = ("object_ref",)

    def __init__(self, object_ref: Any) -> None:
        self.object_ref = object_ref

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Unlifted, (self.object_ref,))


def _is_direct(object_ref: Any) -> bool:
    """Whether ``object_ref`` is a Ray direct-transport reference (tensorwire's or another)."""
    return bool(object_ref.tensor_transport())


def direct_references(args: tuple[Any, ...]) -> list[Any]:
    """The direct-transport ``ObjectRef``s among top-level ``args``."""
    return [a for a in args if _is_object_ref(a) and _is_direct(a)]


def wait_for_producers(object_refs: list[Any], *, timeout_s: float = _PRODUCER_WAIT_S) -> None:
    """Ray lends a direct-transport reference nested in a value only once its owner has the
    metadata (Ray #59644), which reaches the owner after the call ends, on its own path: wait
    for the producing calls, then until Ray takes the references nested. A call that failed
    has no metadata: its error is raised here.

    Raises:
        TransferTimeoutError: A producing call has not finished within ``timeout_s``.
        The producing call's own error (Ray's ``RayTaskError``, ``RayActorError``).
    """
    if not object_refs:
        return
    import ray

    from tensorwire.errors import TransferTimeoutError

    deadline = time.monotonic() + timeout_s
    _ready, waiting = ray.wait(object_refs, num_returns=len(object_refs), timeout=timeout_s, fetch_local=False)
    pause, polls, checked = backoff(0.001, 0.05), 0, False
    while not waiting:
        try:
            ray.put(list(object_refs))  # what the call's arguments will do: nest them
            return
        except NotImplementedError:  # the metadata is on its way, or the call failed
            if time.monotonic() >= deadline:
                break
            if not checked and polls >= _POLLS_BEFORE_ERROR_CHECK:
                checked = True
                ray.get(list(object_refs), timeout=max(0.0, deadline - time.monotonic()))  # a failed call raises
            time.sleep(pause(polls, 0.0))
            polls += 1
    raise TransferTimeoutError(
        f"producing call(s) of references passed unresolved have not finished within {timeout_s:.0f} s"
    )


def lift(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, task: bool, resolve: bool
) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """Caller: direct-transport ``ObjectRef``s (``@tw.method`` results) in the arguments move
    to trailing positional arguments (a :class:`_LiftedArgument` marks each place), where Ray transfers
    them out of band (it does so for top-level positional arguments only). A task's, and
    those an actor method takes unresolved (``resolve=False``), are boxed instead
    (:class:`_Unlifted`); those and the ones under ``tw.passthrough`` wait for their producers
    first (Ray #59644). Object-store ``ObjectRef``s follow Ray's rules, untouched.
    Returns the arguments and the number lifted."""
    lifted: list[Any] = []
    producers: list[Any] = []

    def leaf(item: Any, _path: str) -> Any:
        if isinstance(item, passthrough):
            if _is_object_ref(item.ref) and _is_direct(item.ref):
                producers.append(item.ref)
            return item  # Ray hands the callee the nested reference itself
        if not _is_object_ref(item):
            return values.DESCEND
        if not _is_direct(item):
            return item  # Ray's object store: Ray's rules (resolved at top level, nested left as it is)
        if task or not resolve:
            producers.append(item)
            return _Unlifted(item)
        lifted.append(item)
        return _LiftedArgument(len(lifted) - 1)

    new_args = values.transform(args, leaf)  # top-level ones too: the callee then knows which came by reference
    new_kwargs = values.transform(kwargs, leaf)
    wait_for_producers(producers)
    return new_args + tuple(lifted), new_kwargs, len(lifted)


class passthrough:
    """Wrap an argument so that its reference (a ``tw.Ref`` or a Ray ``ObjectRef``) reaches
    the method unresolved. A direct-transport ``ObjectRef`` waits for its producer first (Ray
    lends such a nested reference only then)."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        if not isinstance(ref, Ref) and not _is_object_ref(ref):
            raise TypeError(f"tw.passthrough wraps a Ref or a Ray ObjectRef, got {type(ref).__name__}")
        self.ref = ref


def _actor_device() -> Any:
    """The device Ref arguments land on in this process: its first visible GPU, if Ray gave it one."""
    import ray
    import torch

    if torch.cuda.is_available() and ray.get_gpu_ids():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def resolve_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], call: dict[str, Any], resolve: bool) -> Any:
    """``args``/``kwargs`` as the method takes them: lifted references put back (as Ray
    resolved them), ``tw.Ref``s and boxed references fetched (concurrently), unless
    ``resolve`` is False."""
    from tensorwire.runtime.api import get_arguments

    count = int(call.get("lifted", 0))
    lifted, args = (args[len(args) - count :], args[: len(args) - count]) if count else ((), args)
    device = call.get("device") or (_actor_device() if count else None)
    found: list[Any] = []

    def leaf(item: Any, _path: str) -> Any:
        if isinstance(item, passthrough):
            return item.ref
        if isinstance(item, _LiftedArgument):
            return place_value(lifted[item.index], device, None)
        if isinstance(item, _Unlifted):
            item = item.object_ref
        elif not isinstance(item, Ref):
            return values.DESCEND
        if not resolve:
            return item
        found.append(item)
        return values.Slot(len(found) - 1)

    skeleton = values.transform((args, kwargs), leaf)
    if not found:
        return skeleton
    # Arguments are inputs the method consumes (often copying them into its own parameters):
    # host values come by one copy into pooled memory that the next call's arguments reuse,
    # GPU values as zero-copy views where the transport allows.
    fetched = get_arguments(found, device=device or _actor_device(), transport=call.get("transport", ""))
    return values.unflatten(skeleton, fetched)
