"""Waiting for actor calls, for the layers above the runtime (collectives, bench, CLI).

Those layers start calls on tensorwire actors (:func:`tensorwire.runtime.ray.hooks.call_hook`)
and wait for them here, so that the library imports Ray in the runtime only. Every wait is bounded.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorwire.transport.config import validate_timeout

__all__ = [
    "CallFailure",
    "Outcome",
    "gather",
    "is_initialized",
    "on_every_node",
    "same_actor",
    "settle",
    "shutdown",
    "wait_all",
]


class CallFailure(enum.Enum):
    """Why a call gave no result."""

    ACTOR_DIED = "actor died"
    FAILED = "failed"  # the call raised; ``Outcome.error`` is Ray's error carrying it
    TIMED_OUT = "timed out"


@dataclass(frozen=True)
class Outcome:
    """A call's result, or why there is none (``failure``, with Ray's ``error``)."""

    value: Any = None
    failure: CallFailure | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def reason(self) -> str:
        """The first line of what went wrong (the call's own exception for ``FAILED``)."""
        if self.error is None:
            return ""
        cause = getattr(self.error, "cause", None) if self.failure is CallFailure.FAILED else None
        text = str(cause if cause is not None else self.error)
        return text.splitlines()[0] if text else ""


def gather(refs: Sequence[Any], *, timeout_s: float) -> list[Any]:
    """Every call's result, in order (raises the first failure as Ray raises it)."""
    import ray

    return list(ray.get(list(refs), timeout=validate_timeout(timeout_s)))


def settle(ref: Any, *, timeout_s: float) -> Outcome:
    """One call's :class:`Outcome`; never raises for the call's own failure."""
    import ray

    try:
        return Outcome(ray.get(ref, timeout=validate_timeout(timeout_s)))
    except ray.exceptions.RayActorError as e:
        return Outcome(failure=CallFailure.ACTOR_DIED, error=e)
    except ray.exceptions.GetTimeoutError as e:
        return Outcome(failure=CallFailure.TIMED_OUT, error=e)
    except ray.exceptions.RayError as e:  # the call raised (RayTaskError), or its result was lost
        return Outcome(failure=CallFailure.FAILED, error=e)


def wait_all(refs: Sequence[Any], *, timeout_s: float) -> tuple[list[Any], list[Any]]:
    """Wait up to ``timeout_s`` (0: just look) for every call; returns (done, not done)."""
    import ray

    refs = list(refs)
    if not refs:
        return [], []
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, float(timeout_s)))
    return list(done), list(pending)


def same_actor(a: Any, b: Any) -> bool:
    """Whether two tensorwire actor handles name the same actor (Ray's handles compare by actor)."""
    return bool(a.ray_handle == b.ray_handle)


def is_initialized() -> bool:
    """Whether this process is connected to Ray."""
    import ray

    return ray.is_initialized()


def shutdown() -> None:
    """Disconnect from Ray (stopping the local Ray this process started)."""
    import ray

    ray.shutdown()


def on_every_node(fn: Callable[[], Any], *, timeout_s: float) -> list[Any]:
    """``fn()`` once on every alive node of the Ray cluster (a short task pinned to each)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(fn)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    return list(ray.get(refs, timeout=validate_timeout(timeout_s)))
