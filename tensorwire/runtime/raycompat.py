"""Ray's own API on tensorwire objects, through Ray's public classes and hooks only.

* **Results.** A ``@tw.method`` call or a ``tw.remote`` task returns a :class:`Ref` that is
  also a ``ray.ObjectRef`` (a class derived from both, made on first use so that importing
  tensorwire does not import Ray): ``ray.get``, ``ray.wait``, ``ray.cancel`` and ``await``
  accept it, and Ray resolves it when it is a top-level argument of any Ray call.
* **What a ``@tw.method`` returns through Ray** is a :class:`Published` state. Where it is
  unpickled decides what it becomes (:func:`arrive`): inside tensorwire's own waits (raw
  mode) the :class:`RefState`; inside a user's ``ray.get`` the *value*, its bytes fetched
  directly from the producer (as ``ray.get`` of a Ray direct-transport reference); anywhere
  else (Ray resolving a top-level argument of a call) an :class:`Arrived` reference, which
  tensorwire methods resolve and plain code can pass to ``tw.get``.
* **Handles.** A tensorwire actor handle is also a ``ray.actor.ActorHandle`` (``ray.kill``,
  ``isinstance`` checks); handles Ray itself gives (``ray.get_actor``, ``get_if_exists``, a
  handle passed to a task) call through Ray's invocation decorators (set by ``actor.py``) and
  so return references too.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Iterator
from typing import Any

from tensorwire.runtime.ref import Ref, RefState

__all__ = ["Arrived", "Published", "arrive", "handle_class", "raw_states", "ray_ref", "state_of"]

_raw = threading.local()
_ray_get_code: Any = None
_ref_class: Any = None
_handle_class: Any = None
_STACK_DEPTH = 48  # frames searched for ``ray.get`` (its deserialization sits about 8 below it)


@contextlib.contextmanager
def raw_states() -> Iterator[None]:
    """Within this block, states unpickled in this thread stay states (tensorwire's own waits)."""
    depth = getattr(_raw, "depth", 0)
    _raw.depth = depth + 1
    try:
        yield
    finally:
        _raw.depth = depth


def _inside_ray_get() -> bool:
    """Whether ``ray.get`` is on this thread's stack (a user asked Ray for the value)."""
    global _ray_get_code
    if _ray_get_code is None:
        import ray

        _ray_get_code = inspect.unwrap(ray.get).__code__
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        if frame.f_code is _ray_get_code:
            return True
        frame = frame.f_back
    return False


def arrive(state_bytes: bytes) -> Any:
    """Unpickling a :class:`Published`: the state, the fetched value, or an :class:`Arrived`
    reference (see above)."""
    state = RefState.from_bytes(state_bytes)
    if getattr(_raw, "depth", 0):
        return state
    if _inside_ray_get():
        return _fetch_for_ray_get(state)
    return Arrived(state)


def _fetch_for_ray_get(state: RefState) -> Any:
    """The value for a user's ``ray.get``. A failed fetch is handed back as Ray's task error
    around tensorwire's (``ray.get`` raises it as both: ``except tw.OwnerDiedError`` works);
    raised here, Ray would wrap it into a ``RaySystemError`` instead."""
    import traceback

    from tensorwire.errors import TensorwireError
    from tensorwire.runtime import reading

    try:
        return reading.get_ref(
            Ref(state._replace(pin_id=b""))
        )  # a hold while it is fetched; the sender's pins cover the gap
    except TensorwireError as e:
        import ray

        return ray.exceptions.RayTaskError("tensorwire fetch", traceback.format_exc(), e)


class Arrived:
    """A reference state Ray handed to a call as a resolved top-level argument. It touches
    nothing while Ray unpickles it (the agent may not run yet, and starting it there can wait
    on Ray itself); tensorwire methods resolve it, ``tw.get`` fetches it, and any other use
    raises :class:`~tensorwire.errors.UnresolvedRefError` naming ``tw.get``."""

    __slots__ = ("state",)

    def __init__(self, state: RefState) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (arrive, (self.state.to_bytes(),))

    def __getattr__(self, name: str) -> Any:
        from tensorwire.errors import UnresolvedRefError

        if name.startswith("__"):
            raise AttributeError(name)
        raise UnresolvedRefError(
            f"{name!r} was asked of a tensorwire reference that Ray passed to this call, not of its value: "
            "fetch the value with tw.get(value), or make this actor or task @tw.remote so its arguments resolve"
        )

    def __repr__(self) -> str:
        return f"tw.Ref(arrived, id={self.state.desc.object_id.hex()[:12]})"


class Published:
    """What a ``@tw.method`` returns through Ray: its reference state, unpickled by :func:`arrive`."""

    __slots__ = ("state_bytes",)

    def __init__(self, state_bytes: bytes) -> None:
        self.state_bytes = state_bytes

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (arrive, (self.state_bytes,))


def state_of(value: Any) -> RefState:
    """The state in what tensorwire's raw wait read from Ray (a state; a direct Ref when Ray
    unpickled it on one of its own threads; bytes from an older producer)."""
    if isinstance(value, RefState):
        return value
    if isinstance(value, Arrived):
        return value.state
    if isinstance(value, Ref) and value.state is not None:
        return value.state
    if isinstance(value, bytes):
        return RefState.from_bytes(value)
    raise TypeError(f"a @tw.method call returned {type(value).__name__}, not a tensorwire reference state")


def ray_ref(object_ref: Any, pending: Any) -> Ref:
    """A pending (or staged) :class:`Ref` of ``object_ref`` that is also a ``ray.ObjectRef``."""
    global _ref_class
    if _ref_class is None:
        import ray

        class CallRef(Ref, ray.ObjectRef):  # type: ignore[misc]
            """A ``tw.Ref`` of a Ray call's result, and an ``ObjectRef`` of that result."""

            __init__ = Ref.__init__
            __reduce__ = Ref.__reduce__
            __repr__ = Ref.__repr__
            __await__ = Ref.__await__

        CallRef.__name__ = CallRef.__qualname__ = "Ref"
        CallRef.__module__ = Ref.__module__
        _ref_class = CallRef
    import ray

    ref = _ref_class.__new__(_ref_class, object_ref.binary(), object_ref.owner_address(), object_ref.call_site())
    ray.ObjectRef.__init__(ref, object_ref.binary(), object_ref.owner_address(), object_ref.call_site())
    Ref.__init__(ref, pending=pending)
    return ref


def handle_class(base: type) -> type:
    """``base`` (tensorwire's handle) joined with ``ray.actor.ActorHandle``."""
    global _handle_class
    if _handle_class is None:
        import ray

        _handle_class = type("ActorHandle", (base, ray.actor.ActorHandle), {"__module__": base.__module__})
    return _handle_class
