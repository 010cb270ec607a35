"""The one error hierarchy of tensorwire.

Every error a user can trigger derives from :class:`TensorwireError` (or is a plain
``TypeError``/``ValueError`` for bad input). Messages say what failed, the values seen and
how to fix it.
"""

from __future__ import annotations

__all__ = [
    "DeviceUnavailableError",
    "InvalidRequestError",
    "LargeReferenceWarning",
    "NoTransportError",
    "ObjectFreedError",
    "OwnerDiedError",
    "PeerLostError",
    "PermissionDeniedError",
    "TensorwireError",
    "TrainerLost",
    "TransferAbortedError",
    "TransferTimeoutError",
    "TransportContractError",
    "TransportError",
    "TransportUnavailableError",
    "UnknownConnectionError",
    "UnresolvedRefError",
]


class TensorwireError(Exception):
    """Base class of every tensorwire error."""


class DeviceUnavailableError(TensorwireError, ValueError):
    """A device asked for (``device="cuda:3"``) is not one this process can use; also a
    ``ValueError``, as bad input for this machine."""


class TransportError(TensorwireError):
    """A transfer could not be carried out."""


class NoTransportError(TransportError):
    """No transport can serve this transfer (or a forced one cannot)."""


class TransportUnavailableError(TransportError):
    """A transport is not usable in this process (missing library, device or resource)."""


class TransportContractError(TensorwireError, TypeError):
    """A transport class lacks a method that one of its capabilities requires (raised when it
    is registered or first loaded; the message names the method and the capability)."""


class TransferTimeoutError(TransportError):
    """A transfer or control call did not finish within its deadline."""


class TransferAbortedError(TransportError):
    """A transfer was aborted by either side."""


class PeerLostError(TransportError):
    """The peer process stopped answering (it may have died or the network failed)."""


class InvalidRequestError(TransportError):
    """A peer's control service refused a request as malformed or not servable there (a
    transport it does not run, a bad parameter block)."""


class UnknownConnectionError(TransportError):
    """The producer no longer knows the connection a two-sided transfer named (it dropped
    it after a failure, or restarted its transport); the consumer reconnects."""


class ObjectFreedError(TensorwireError):
    """The object was freed (explicitly or because no holder remained)."""


class OwnerDiedError(TensorwireError):
    """The process that owned the object has exited; its tensors are gone."""


class PermissionDeniedError(TensorwireError):
    """A request presented a wrong capability token or cluster token."""


class TrainerLost(TensorwireError):
    """A weight-sync trainer died or stalled during a push.

    Raised in a receiver that reads from it (``rank``: its channel rank, which is its position
    among the trainers; -1 when not known), and by ``WeightSync.push()`` when no other trainer
    holds its bytes (``rank``: its position; ``why``: what happened, with "no failover" and why;
    ``report``: what the receivers did). Where the others hold them, the push replaces it
    instead (``report.replaced``).
    """

    def __init__(self, rank: int, why: str, *, report: object = None) -> None:
        super().__init__(why)
        self.rank = rank
        self.why = why
        self.report = report

    def __reduce__(self) -> tuple[object, ...]:  # (raised in an actor, it travels pickled)
        return (type(self), (self.rank, self.why), {"report": self.report})


class LargeReferenceWarning(UserWarning):
    """A value's non-tensor part makes its reference large (``TENSORWIRE_REF_WARN_NBYTES``):
    it is pickled into every copy of the reference instead of moving by reference."""


class UnresolvedRefError(TensorwireError, TypeError, AttributeError):
    """A tensorwire reference reached code that used it as its value (fetch it with ``tw.get``).
    Also an ``AttributeError`` (so ``hasattr`` probes stay quiet) and a ``TypeError``."""
