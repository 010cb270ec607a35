"""The transport contract: the :class:`Transport` ABC, its capability flags and metadata.

A transport moves the bytes of one registered object (a list of contiguous tensors) from the
process that owns it (the *producer*) into buffers of the process that asked for it (the
*consumer*). Transports are either one-sided (the producer exports a handle when a reference
leaves its process; the consumer pulls with no work on the producer) or two-sided (the
consumer asks the producer's agent over the control service and both sides take part).

Which methods a transport must implement follows from its :class:`Capabilities`
(:data:`REQUIRED_METHODS`; the registry checks it when a transport is registered or loaded):

=======================  ==========================================================
capability               methods
=======================  ==========================================================
every transport          ``fetch`` (consumer), ``release`` (producer, may be a no-op);
                         optionally ``repeater`` (consumer: the same fetch again, cheaper)
``needs_export``         ``export`` (producer)
``export_per_consumer``  ``export`` (producer, once per consumer process, on its request)
``one_sided=False``      ``serve`` (producer, on an agent service thread); transports
                         built on :class:`~tensorwire.transport.two_sided.TwoSidedTransport`
                         implement its connection and post hooks instead
``zero_copy_view``       ``view`` (consumer)
``peer_setup``           ``connection_info`` (any process) and ``load_peer``
                         (consumer, once per producer, before its first fetch from it)
``carries_value``        ``export`` (producer; the handle holds the bytes themselves)
``staging_rings``        ``staging_ring`` (writer) and ``ring_reader`` (readers);
                         optionally ``reads_in_place`` (writer)
=======================  ==========================================================

A transport also declares its default :class:`CostModel` (``cost_model``); the selector ranks
by it until ``tensorwire bench --calibrate`` measured this machine. This module imports neither
torch nor Ray at import time.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tensorwire.errors import TransportUnavailableError
from tensorwire.transport.costs import CostEstimate, CostModel, MemoryKind, Placement
from tensorwire.transport.metadata import (
    DeviceInfo,
    FetchRequest,
    ObjectDescriptor,
    PeerInfo,
    StoredObject,
    TensorKind,
    TensorMeta,
)

if TYPE_CHECKING:
    import torch

    from tensorwire.transport.config import Config

__all__ = [
    "REQUIRED_METHODS",
    "Capabilities",
    "CostEstimate",
    "CostModel",
    "DeviceInfo",
    "Diagnosis",
    "FetchRequest",
    "Health",
    "MemoryKind",
    "ObjectDescriptor",
    "PeerInfo",
    "Placement",
    "StoredObject",
    "TensorKind",
    "TensorMeta",
    "Transport",
    "TransportContext",
]


class Health(enum.Enum):
    """How a check of ``tensorwire doctor`` came out."""

    OK = "ok"
    WARN = "warn"  # works, slower or with less than it could (no RDMA, no direct reads)
    FAIL = "fail"


@dataclass(frozen=True)
class Diagnosis:
    """One line a transport reports about itself for ``tensorwire doctor``."""

    check: str  # what was checked, e.g. "shm direct reads"
    health: Health
    detail: str


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; the selector decides from these flags alone.

    Attributes:
        one_sided: The consumer pulls without work on the producer's side.
        same_process: Usable when producer and consumer are one process.
        same_node: Usable between processes of one node.
        cross_node: Usable between nodes.
        memory: Memory kinds it reads and writes directly (others are staged by the caller).
        needs_export: The producer must export a handle before a consumer can fetch.
        zero_copy_view: The consumer can map the producer's bytes without copying.
        can_abort: A transfer in flight can be aborted and both sides stay usable.
        staged: Memory of other kinds is staged through host memory (by ``serve`` on the
            producer, by the agent on the consumer), so any object can be served.
        needs_device_access: The consumer process must see every GPU the object lives on
            (compared by UUID), e.g. to open CUDA IPC handles.
        distinct_devices: Producer and consumer must use different GPUs, and the consumer
            must receive into GPU memory (NCCL refuses two ranks on one GPU).
        torch_memory_only: Reads only CUDA memory that torch's allocator owns (not memory a
            cupy or other DLPack producer allocated), e.g. CUDA IPC through torch.
        export_per_consumer: Nothing is exported when a reference leaves the producer; each
            consumer process asks the owner for its own handle (``export`` runs once per
            consumer, through ``TransportContext.request_export``), e.g. because a handle may
            be opened only once (CUDA IPC reference counts).
        peer_setup: A one-sided transport that needs per-peer state before its first fetch
            from a producer (e.g. NIXL's agent metadata): every process publishes
            ``connection_info()`` in its ``PeerInfo.transport_info``; a consumer calls
            ``load_peer`` once per producer, on first use (the agent caches it).
        carries_value: The export handle holds the object's bytes (``inline``): no other
            handle is exported, the reference needs no pin or holder at the owner, and it is
            the last resort when the owner no longer has the object. The handle's size is
            limited by ``Config.inline_max_nbytes`` (the most bytes a reference carries).
        registers_buffers: The consumer's receive buffers are registered with the transport
            (NIXL): fetches from another node land in pooled host memory, so a buffer reused
            for a later value is registered once.
        staging_rings: Offers reusable same-node staging rings (``staging_ring`` on the
            writer, ``ring_reader`` on the readers): a weight-sync server packs buckets into
            slots its node's readers keep mapped.
    """

    one_sided: bool
    same_process: bool
    same_node: bool
    cross_node: bool
    memory: frozenset[MemoryKind] = frozenset({MemoryKind.HOST})
    needs_export: bool = False
    zero_copy_view: bool = False
    can_abort: bool = False
    staged: bool = False
    needs_device_access: bool = False
    distinct_devices: bool = False
    export_per_consumer: bool = False
    torch_memory_only: bool = False
    peer_setup: bool = False
    carries_value: bool = False
    staging_rings: bool = False
    registers_buffers: bool = False


REQUIRED_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("needs_export", ("export",)),
    ("export_per_consumer", ("export",)),
    ("two_sided", ("serve",)),
    ("zero_copy_view", ("view",)),
    ("peer_setup", ("connection_info", "load_peer")),
    ("carries_value", ("export",)),
    ("staging_rings", ("staging_ring", "ring_reader")),
)
"""(capability, methods a transport with it must define); ``two_sided`` is ``one_sided=False``."""


class TransportContext(ABC):
    """What a transport may use of the agent that created it (one per process).

    This is the whole of it: a transport calls nothing else on the agent. The groups: identity
    and settings; objects (the producer's own, in its process); reaching other agents (their
    liveness, exports on request, two-sided streams and connections); the rendezvous mailbox
    (small keyed values agents leave for one another, by *group*, for connection set-up).
    What the agent offers the layers above (registering and fetching objects, references,
    messages) is :class:`tensorwire.transport.agent.AgentServices`.
    """

    @property
    @abstractmethod
    def peer(self) -> PeerInfo:
        """This process's own peer description."""

    @property
    @abstractmethod
    def config(self) -> Config:
        """The agent's settings."""

    @abstractmethod
    def open_stream(self, request: FetchRequest, transport: str, params: bytes) -> Iterator[bytes]:
        """Consumer: ask the owner's agent to run ``transport.serve`` and stream its output.

        Blocks per item until the owner sends it or the request's deadline passes; raises
        the mapped tensorwire error (``PeerLostError``, ``ObjectFreedError``, ...).
        """

    @abstractmethod
    def local_object(self, object_id: bytes, token: bytes) -> StoredObject:
        """Consumer in the owner's own process: the stored object (raises if freed or token wrong)."""

    @abstractmethod
    def peer_may_be_alive(self, peer: PeerInfo) -> bool:
        """False only when ``peer`` ran on this machine and its process has exited."""

    @abstractmethod
    def publish_transport_info(self, transport: str, info: str) -> None:
        """Any process: add ``info`` (short text) for ``transport`` to this process's
        ``PeerInfo`` (references made from now on carry it)."""

    @abstractmethod
    def request_export(self, request: FetchRequest, transport: str) -> bytes:
        """Consumer: ask the owner to run ``transport.export`` for this process now."""

    @abstractmethod
    def connect(
        self, peer: PeerInfo, transport: str, payload: bytes, *, timeout_s: float, concurrently: Callable[[], None]
    ) -> bytes:
        """Consumer: ask ``peer``'s agent to ``accept`` a connection of ``transport``.

        ``concurrently`` runs in this thread while the peer accepts (both sides of a
        rendezvous must run at once); the peer's answer is returned. Raises mapped errors.
        """

    @abstractmethod
    def rendezvous_push(self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float) -> None:
        """Either side of a connection: set ``key`` of ``group`` at ``peer`` (this process's
        own ``peer`` sets it here).

        Blocks until ``peer`` stored it (a dropped connection is retried once); raises the
        mapped tensorwire error.
        """

    @abstractmethod
    def rendezvous_get(self, group: str, key: str, *, timeout_s: float) -> bytes:
        """Either side: the value of ``key`` of ``group`` once set here or pushed by the peer.

        Blocks until then; raises ``TransferTimeoutError`` after ``timeout_s``.
        """

    @abstractmethod
    def rendezvous_forget(self, group: str) -> None:
        """Drop every key of ``group`` (its connection is made or abandoned). Never blocks."""

    @abstractmethod
    def check_owner(self, request: FetchRequest) -> None:
        """Consumer: raise ``OwnerDiedError``/``ObjectFreedError``/... if the object is gone.

        Used when a handle no longer resolves or an operation failed, to name the cause.
        """

    def holds(self, object_id: bytes) -> bool:
        """Consumer: whether this process holds a reference to another agent's object (then
        ``Transport.forget_object`` is called when it no longer does). Transports may keep
        per-object state (mappings, descriptors) only for held objects."""
        return False


class Transport(ABC):
    """One way of moving an object's bytes. One instance per agent (process).

    Subclasses set ``name`` (the registry name), ``capabilities`` and ``cost_model``; the
    methods that their capabilities call for are listed in this module's docstring.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    cost_model: ClassVar[CostModel | None] = None  # None: ranked last (UNKNOWN_COST)

    def __init__(self, context: TransportContext) -> None:
        self.context = context

    def unavailable_reason(self) -> str | None:
        """Any process: ``None`` if usable here, else why not (called once by the agent)."""
        return None

    def export(self, obj: StoredObject) -> bytes | None:
        """Producer, when a reference to ``obj`` first leaves the process.

        Returns an opaque handle that travels inside the reference and reaches ``fetch`` on
        the consumer, or ``None`` when this object cannot be exported (too large, wrong
        memory). May block while it copies. Called at most once per object.
        """
        raise TransportUnavailableError(f"transport {self.name!r} does not export handles")

    def export_nbytes(self, obj: StoredObject) -> int:
        """Producer: the bytes of memory this transport holds for ``obj``'s export beyond its
        tensors (a copy in a segment), 0 when it reads them in place. Never blocks."""
        return 0

    def release(self, obj: StoredObject) -> None:  # noqa: B027 - optional hook
        """Producer, when ``obj`` is freed: drop every resource tied to it. Must not raise, and
        may run again (an export that raced the free releases once more after it)."""

    def serve(self, obj: StoredObject, params: bytes) -> Iterator[bytes]:
        """Producer, on an agent service thread: answer one consumer's two-sided fetch.

        The items yielded travel to the consumer's ``context.open_stream`` in order.
        """
        raise TransportUnavailableError(f"transport {self.name!r} is not two-sided")

    def accept(self, peer: PeerInfo, payload: bytes) -> bytes:
        """Producer, on an agent service thread: set up a connection ``peer`` asked for with
        ``TransportContext.connect``; returns the answer for the peer. Two-sided only."""
        raise TransportUnavailableError(f"transport {self.name!r} takes no connections")

    def connection_info(self) -> str:
        """Any process, once usable: its connection info (text of a few hundred characters at
        most, binary base64-encoded), published in ``PeerInfo.transport_info`` at start; newer
        info may follow (``publish_transport_info``; see peer_setup.py). Only for ``peer_setup``."""
        raise TransportUnavailableError(f"transport {self.name!r} has no per-peer set-up")

    def load_peer(self, peer: PeerInfo, info: str) -> None:
        """Consumer, once per producer ``peer`` before the first fetch from it (the agent
        caches success): load the ``info`` the peer published (``connection_info`` there).
        Blocks while it loads; raises ``TransportUnavailableError`` when it cannot (the
        fetch then falls back). Only for ``peer_setup``."""
        raise TransportUnavailableError(f"transport {self.name!r} has no per-peer set-up")

    def forget_object(self, object_id: bytes) -> None:  # noqa: B027 - optional hook
        """Consumer: this process no longer holds a reference to ``object_id``; close what
        was kept open for it (mappings). Must not raise."""

    def forget_peer(self, agent_id: str) -> None:  # noqa: B027 - optional hook
        """Any process: the agent learned that ``agent_id`` is gone; drop what is tied to it."""

    @abstractmethod
    def fetch(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> None:
        """Consumer: fill ``dst`` (contiguous host tensors matching ``request.metas``).

        Blocks until every byte arrived or ``request.deadline`` passed
        (``TransferTimeoutError``). Host memory only here; the caller stages other devices.
        """

    def repeater(self, request: FetchRequest, dst: Sequence[torch.Tensor]) -> Callable[[float], bool] | None:
        """Consumer, optional: after ``fetch(request, dst)`` succeeded, a callable that fetches
        the same object into the same buffers again, cheaper, given the deadline
        (``time.monotonic()``). It returns True only when every byte came from the object while
        it was live (read under the capability the first fetch proved); False when it could not
        (the object freed, the deadline too near, another thread running it: the caller then
        calls ``fetch``, which says why; so does any error it raises but
        ``TransferTimeoutError``). Any thread may call it, while ``dst`` are the same live
        buffers. None (the default): nothing cheaper than ``fetch``."""
        return None

    def view(self, request: FetchRequest) -> list[torch.Tensor]:
        """Consumer: tensors that map the producer's bytes without a copy.

        Only for ``zero_copy_view``. Host mappings (shm) are copy-on-write: writing to them
        never changes the producer's data. GPU mappings (cuda_ipc) share the producer's
        memory: treat them as read-only.
        """
        raise TransportUnavailableError(f"transport {self.name!r} has no zero-copy view")

    @classmethod
    def library_status(cls) -> str:
        """Any process, without an instance: the optional library this transport runs on and
        whether it is installed (for ``tensorwire topo``), or "" when it needs none."""
        return ""

    def diagnose(self) -> list[Diagnosis]:
        """Any process, once usable (``tensorwire doctor``): what this transport finds about
        its library and hardware beyond being usable (e.g. which UCX transports are active,
        whether direct reads are allowed). Blocks briefly; never raises."""
        return []

    def staging_ring(self, slot_nbytes: int, slots: int = 2) -> Any:
        """Writer (a weight-sync server): a new ring of ``slots`` reusable buffers of
        ``slot_nbytes`` that readers on this node map: ``.names`` (one per slot),
        ``.nbytes``, ``.arrays`` (flat uint8 numpy views), ``.write(slot, tensors)``,
        ``.close()``. Only for ``staging_rings``."""
        raise TransportUnavailableError(f"transport {self.name!r} offers no staging rings")

    def ring_reader(self) -> Any:
        """Reader on the writer's node: a reader that keeps its mappings of rings' slots:
        ``.mapped(name, slot_nbytes)`` (a flat uint8 numpy array), ``.close()``. Only for
        ``staging_rings``."""
        raise TransportUnavailableError(f"transport {self.name!r} offers no staging rings")

    def reads_in_place(self, readers: int) -> bool:
        """Writer (a weight-sync server): whether ``readers`` readers on this node cost less
        reading an exported host object straight out of the producer's tensors (no copy at
        export) than copying it out of a staging ring the writer packed it into. Then the
        server publishes its tensors' views instead. Only for ``staging_rings``."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Any process, at agent shutdown: release process-wide resources."""
