"""What the per-process agent offers the layers above the transports (runtime, collectives, CLI).

Transports see the agent through :class:`~tensorwire.transport.contract.TransportContext`;
everything else sees it through :class:`AgentServices`, and calls nothing else on it. The
groups: identity; objects this process owns (register, export, free); fetching another
process's objects; references (the holder protocol's local side); messages between agents
(the rendezvous mailbox); the transports loaded here; statistics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tensorwire.transport.agent.metrics import TransferRecord
    from tensorwire.transport.agent.repeat import Repeat
    from tensorwire.transport.config import Config
    from tensorwire.transport.contract import Capabilities, Diagnosis, Transport
    from tensorwire.transport.metadata import ObjectDescriptor, PeerInfo, StoredObject, TensorMeta

__all__ = ["AgentServices"]


class AgentServices(ABC):
    """The agent as the runtime and collectives use it (every method: any thread)."""

    # ------------------------------------------------------------------ identity

    @property
    @abstractmethod
    def peer(self) -> PeerInfo:
        """This process's own peer description."""

    @property
    @abstractmethod
    def config(self) -> Config:
        """The agent's settings."""

    @abstractmethod
    def peer_may_be_alive(self, peer: PeerInfo) -> bool:
        """False only when ``peer`` ran on this machine and its process has exited."""

    @abstractmethod
    def peer_responds(self, peer: PeerInfo, *, timeout_s: float) -> bool:
        """Whether ``peer``'s process can act now: on this machine, alive and not stopped
        (``SIGSTOP``, a debugger); elsewhere, its agent answers within ``timeout_s``. Blocks at
        most ``timeout_s``."""

    # ------------------------------------------------------------------ objects this process owns

    @abstractmethod
    def register(
        self,
        tensors: list[torch.Tensor],
        metas: tuple[TensorMeta, ...],
        packed_nbytes: int,
        ready: list[Any] | None = None,
    ) -> ObjectDescriptor:
        """Producer: keep ``tensors`` (contiguous) as one new object; returns its descriptor.

        ``ready``: (CUDA device, event) pairs recorded after the work that produced them.
        """

    @abstractmethod
    def export_handles(self, desc: ObjectDescriptor, *, across_nodes: bool = True) -> dict[str, bytes]:
        """Producer, for an object it owns: the one-sided transports' handles, made on the
        first call (may block while a transport copies) and cached; ``{}`` if not owned here.
        ``across_nodes=False``: only for readers on this node (see ``ObjectStore.export_handles``)."""

    @abstractmethod
    def described_now(self, desc: ObjectDescriptor) -> ObjectDescriptor:
        """Producer: ``desc`` naming this process as it is now (with the connection info its
        transports published since the object was registered)."""

    @abstractmethod
    def export_nbytes(self, desc: ObjectDescriptor) -> int:
        """Producer: the bytes the transports hold for the object's exports beyond its tensors."""

    @abstractmethod
    def free(self, desc: ObjectDescriptor, *, timeout_s: float | None = None) -> None:
        """Any process: free the object now at its owner. Idempotent; a dead owner is a
        no-op. Blocks for the owner's answer (at most ``timeout_s``)."""

    @abstractmethod
    def owned_objects(self) -> int:
        """How many objects this process owns right now."""

    @abstractmethod
    def local_object(self, object_id: bytes, token: bytes) -> StoredObject:
        """Producer: one object this process owns as stored (raises if freed or the token is
        wrong); for measuring a transport's ``export`` of it directly."""

    @abstractmethod
    def owned_sharing(self, storage_ptrs: frozenset[int]) -> int:
        """How many owned objects hold a tensor stored at one of ``storage_ptrs``."""

    # ------------------------------------------------------------------ fetching

    @abstractmethod
    def fetch(
        self,
        desc: ObjectDescriptor,
        handles: dict[str, bytes],
        *,
        dst: Sequence[torch.Tensor | None] | None,
        targets: Sequence[torch.device] | None = None,
        transport: str = "",
        view: bool = False,
        pooled: bool = False,
        timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], TransferRecord]:
        """Consumer: the object's tensors, each where it was asked for, and the record of how
        they came. Blocks until every byte arrived or ``timeout_s`` passed; the transport is
        the selector's choice (or ``transport``), falling back on failure.

        Args:
            desc: The object's descriptor.
            handles: Export handles carried by the reference.
            dst: The caller's buffers (matching ``desc.metas``; None entries, or None, for
                none). A buffer the transport can write (contiguous, host or, for CUDA-capable
                transports, CUDA) is filled directly; any other is copied into at the end.
            targets: Where each tensor without a buffer should land (default: the host);
                transports that write CUDA memory receive straight onto a CUDA target, others
                land on the host and are moved (:mod:`.destinations`).
            transport: Forced transport name; "" uses ``TENSORWIRE_TRANSPORT`` or the selector.
            view: Prefer zero-copy views (same process: the producer's tensors; shm: a
                copy-on-write mapping) over a private copy.
            pooled: Land host tensors in pooled memory already faulted in (values of the same
                size come again, e.g. an actor's arguments).
            timeout_s: Deadline of the whole fetch (default ``Config.timeout_s``).
        """

    @abstractmethod
    def fetch_repeatable(
        self,
        desc: ObjectDescriptor,
        handles: dict[str, bytes],
        *,
        dst: Sequence[torch.Tensor],
        targets: Sequence[torch.device] | None = None,
        transport: str = "",
        timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], TransferRecord, Repeat | None]:
        """Consumer: :meth:`fetch` into the caller's buffers ``dst`` (one for every tensor),
        and the same fetch ready to run again into them
        (:class:`~tensorwire.transport.agent.repeat.Repeat`), or None where it cannot be (a
        fallback happened, a buffer the transport could not fill itself)."""

    # ------------------------------------------------------------------ references

    @abstractmethod
    def ref_attached(self, desc: ObjectDescriptor, pin_id: bytes = b"") -> None:
        """A reference object was created here (by ``put``, or unpickled under ``pin_id``)."""

    @abstractmethod
    def ref_detached(self, desc: ObjectDescriptor) -> None:
        """A local reference object was garbage-collected (a finalizer; never raises)."""

    @abstractmethod
    def ref_pickled(self, desc: ObjectDescriptor) -> bytes:
        """A reference is leaving this process: pin its object; returns the pin id."""

    @abstractmethod
    def announce_pin(self, desc: ObjectDescriptor, pin_id: bytes) -> None:
        """Pin ``desc``'s object under ``pin_id`` (a reference travels under it)."""

    @abstractmethod
    def consume_pin(self, desc: ObjectDescriptor, pin_id: bytes) -> None:
        """Drop the transit pin ``pin_id`` without registering as a holder."""

    @abstractmethod
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued holder message was sent; False on timeout."""

    # ------------------------------------------------------------------ messages between agents

    @abstractmethod
    def rendezvous_push(self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float) -> None:
        """Set ``key`` of ``group`` at ``peer`` (may be this process); blocks until stored."""

    @abstractmethod
    def rendezvous_push_async(
        self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float
    ) -> Callable[[], None]:
        """Start :meth:`rendezvous_push`; the returned function blocks until it is done and
        raises its error (a sender tells several peers at once)."""

    @abstractmethod
    def rendezvous_get(self, group: str, key: str, *, timeout_s: float) -> bytes:
        """The value of ``key`` of ``group`` once here, left in place (a store's key).

        Raises ``TransferTimeoutError`` after ``timeout_s``."""

    @abstractmethod
    def rendezvous_take(self, group: str, key: str, *, timeout_s: float) -> bytes:
        """The value of ``key`` of ``group`` once here, removed (a message consumed once).

        Raises ``TransferTimeoutError`` after ``timeout_s``."""

    @abstractmethod
    def rendezvous_take_any(self, group: str, keys: Sequence[str], *, timeout_s: float) -> tuple[int, bytes]:
        """The first of ``keys`` of ``group`` here (the earliest in ``keys`` among those here),
        removed: its index and value. Raises ``TransferTimeoutError`` after ``timeout_s``."""

    @abstractmethod
    def rendezvous_forget(self, group: str) -> None:
        """Drop every key of ``group``. Never blocks."""

    # ------------------------------------------------------------------ transports, statistics

    @abstractmethod
    def transports(self) -> dict[str, Transport]:
        """The transports usable in this process, by registry name (a copy)."""

    @abstractmethod
    def unusable_transports(self) -> dict[str, str]:
        """Registered transports that cannot run here, with the reason."""

    @abstractmethod
    def capabilities(self) -> dict[str, Capabilities]:
        """Every registered transport's capabilities, by name (usable here or not)."""

    @abstractmethod
    def diagnose(self) -> dict[str, list[Diagnosis]]:
        """What each usable transport reports about its library and hardware (``doctor``)."""

    @abstractmethod
    def staging(self) -> Transport | None:
        """The first usable transport that offers same-node staging rings
        (``Capabilities.staging_rings``), or None."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Objects owned and held, and transfers by transport with recent records."""
