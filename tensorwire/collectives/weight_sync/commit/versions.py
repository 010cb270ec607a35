"""The versions receivers hold, as the driver sees them (``WeightSync.versions`` and
``wait_version``): asked of each receiver (:func:`versions_hook`), which records a version only
once it is whole (:func:`.receiver.weight_version`)."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping

from tensorwire.collectives.weight_sync.commit.receiver import weight_version
from tensorwire.runtime.ray import calls
from tensorwire.runtime.ray.actor import ActorHandle
from tensorwire.runtime.ray.hooks import actor_hook, call_hook
from tensorwire.transport.config import validate_timeout

__all__ = ["versions", "versions_hook", "wait_version"]


@actor_hook
def versions_hook(_actor: object, name: str) -> int:
    """Hook, receiver: the version of sync ``name`` it holds completely."""
    return weight_version(name)


def versions(receivers: Mapping[int, ActorHandle], name: str) -> list[int]:
    """The version of sync ``name`` each receiver holds completely (0: none yet; -1: unreachable)."""
    result = []
    for actor in receivers.values():
        outcome = calls.settle(call_hook(actor, versions_hook, name), timeout_s=30.0)
        if outcome.failure is calls.CallFailure.FAILED and outcome.error is not None:
            raise outcome.error
        result.append(outcome.value if outcome.ok else -1)
    return result


def wait_version(
    receivers: Mapping[int, ActorHandle], name: str, version: int, *, dead: Collection[int], timeout_s: float
) -> list[int]:
    """Wait until every receiver not in ``dead`` holds ``version`` or a later one; returns what
    each holds (as :func:`versions`).

    Raises:
        TimeoutError: Some did not within ``timeout_s`` (named, with what they hold).
    """
    deadline = time.monotonic() + validate_timeout(timeout_s)
    while True:
        held = versions(receivers, name)
        behind = {rid: v for rid, v in zip(receivers, held, strict=True) if rid not in dead and v < version}
        if not behind:
            return held
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"weight sync {name}: receiver(s) {behind} (id: version held) not at version {version} "
                f"after {timeout_s:g} s"
            )
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
