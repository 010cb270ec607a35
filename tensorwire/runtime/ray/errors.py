"""tensorwire's errors as a Ray user catches them.

A reader of a value whose producing actor died gets :class:`ProducerDiedError`: it is
tensorwire's :class:`~tensorwire.errors.OwnerDiedError` and Ray's ``ActorDiedError`` at once, so
code written for Ray's own tensor transports (``except ray.exceptions.ActorDiedError``) and code
written for tensorwire (``except tw.OwnerDiedError``) both catch it, raised bare in the driver or
inside Ray's ``RayTaskError`` when a task's argument could not be read.
"""

from __future__ import annotations

from typing import Any

import ray.exceptions

from tensorwire.errors import OwnerDiedError

__all__ = ["ProducerDiedError"]


class ProducerDiedError(OwnerDiedError, ray.exceptions.ActorDiedError):
    """The actor that produced (or was producing) a value died; its tensors are gone."""

    def __init__(self, message: str, actor_id: str | None = None) -> None:
        OwnerDiedError.__init__(self, message)
        ray.exceptions.RayActorError.__init__(self, actor_id, message)

    def __str__(self) -> str:
        return self.error_msg

    def __reduce__(self) -> tuple[Any, tuple[str, str | None]]:
        return type(self), (self.error_msg, self.actor_id)
