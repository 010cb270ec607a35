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
every transport          ``fetch`` (consumer), ``release`` (producer, may be a no-op)
``needs_export``         ``export`` (producer)
``export_per_consumer``  ``export`` (producer, once per consumer process, on its request)
``one_sided=False``      ``serve`` (producer, on an agent service thread); transports
                         built on :class:`~tensorwire.transport.two_sided.TwoSidedTransport`
                         implement its connection and post hooks instead
``zero_copy_view``       ``view`` (consumer)
``peer_setup``           ``connection_info`` (any process) and ``load_peer``
                         (consumer, once per producer, before its first fetch from it)
``carries_value``        ``export`` (producer; the handle holds the bytes themselves)
=======================  ==========================================================

A transport also declares its default :class:`CostModel` (``cost_model``); the selector ranks
by it until ``tensorwire bench --calibrate`` measured this machine. This module imports neither
torch nor Ray at import time.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tensorwire.errors import TransportUnavailableError
from tensorwire.transport import meta_wire
from tensorwire.transport.costs import CostEstimate, CostModel, MemoryKind, Placement

if TYPE_CHECKING:
    import torch

    from tensorwire.transport.config import Config
    from tensorwire.transport.metrics import TransferRecord

__all__ = [
    "REQUIRED_METHODS",
    "Capabilities",
    "CostEstimate",
    "CostModel",
    "DeviceInfo",
    "FetchRequest",
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


class TensorKind(enum.Enum):
    """Which array type the user gave us, so that the consumer gets the same type back."""

    TORCH = "torch"
    NUMPY = "numpy"
    CUPY = "cupy"  # arrives as a cupy array where cupy is installed (else a torch tensor)
    DLPACK = "dlpack"  # another DLPack producer (JAX, ...): arrives as a torch tensor


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


REQUIRED_METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("needs_export", ("export",)),
    ("export_per_consumer", ("export",)),
    ("two_sided", ("serve",)),
    ("zero_copy_view", ("view",)),
    ("peer_setup", ("connection_info", "load_peer")),
    ("carries_value", ("export",)),
)
"""(capability, methods a transport with it must define); ``two_sided`` is ``one_sided=False``."""


@dataclass(frozen=True)
class DeviceInfo:
    """One device a process can see, identified physically (never only by index)."""

    kind: str  # torch device type: "cpu", "cuda", ...
    index: int
    uuid: str = ""
    pci_bus_id: str = ""


@dataclass(frozen=True)
class PeerInfo:
    """Everything another process needs to know to reach an agent.

    ``node_id`` decides "same node" for transport selection and can be overridden with
    ``TENSORWIRE_NODE_ID`` (tests use it to force cross-node paths on one machine);
    ``machine_id`` (host name + boot id) is never overridden and decides whether process
    liveness can be checked by pid.
    """

    agent_id: str
    node_id: str
    machine_id: str
    hostname: str
    pid: int
    start_time: int
    unix_address: str = ""
    tcp_address: str = ""
    transports: tuple[str, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    gpu_links: tuple[tuple[str, str, str], ...] = ()  # (uuid, uuid, "nvlink" | "pcie" | "none")
    transport_info: tuple[tuple[str, str], ...] = ()  # (transport, facts), e.g. ("ucx", "cma,posix,tcp")

    def gpu_link(self, a: str, b: str) -> str:
        """How this process's GPUs ``a`` and ``b`` (UUIDs) reach each other: "same",
        "nvlink", "pcie", "none", or "" when unknown."""
        if a == b:
            return "same"
        for x, y, kind in self.gpu_links:
            if {x, y} == {a, b}:
                return kind
        return ""

    def same_process(self, other: PeerInfo) -> bool:
        return self.agent_id == other.agent_id

    def same_node(self, other: PeerInfo) -> bool:
        return self.node_id == other.node_id

    def same_machine(self, other: PeerInfo) -> bool:
        return self.machine_id == other.machine_id


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and placement of one tensor of an object, and its place in the pack.

    ``offset`` is the byte offset of the tensor in the object's packed layout (tensors laid
    end to end, each aligned); one-sided transports use one buffer per object.
    """

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    device: str  # device as the producer saw it, e.g. "cpu" or "cuda:0"
    nbytes: int
    offset: int
    kind: TensorKind = TensorKind.TORCH
    device_uuid: str = ""

    @property
    def memory(self) -> MemoryKind:
        return MemoryKind.CUDA if self.device.startswith("cuda") else MemoryKind.HOST


@dataclass(frozen=True)
class ObjectDescriptor:
    """What a reference carries about its object (never the bytes, except inline handles)."""

    object_id: bytes
    token: bytes  # the capability: whoever presents it may read the object
    owner: PeerInfo
    metas: tuple[TensorMeta, ...]
    packed_nbytes: int
    __reduce__ = meta_wire.reduce_descriptor  # pickled with the metadata as plain rows, memoised

    @property
    def nbytes(self) -> int:
        return meta_wire.facts(self.metas).nbytes

    def __repr__(self) -> str:  # never show the token
        return f"ObjectDescriptor(id={self.object_id.hex()}, owner={self.owner.agent_id}, tensors={len(self.metas)})"


@dataclass
class StoredObject:
    """Producer side: one registered object as its owner's agent keeps it.

    Transports may keep per-object state in ``transport_state`` (keyed by transport name);
    they must free it in ``release``.
    """

    object_id: bytes
    token: bytes
    tensors: list[torch.Tensor]
    metas: tuple[TensorMeta, ...]
    packed_nbytes: int
    transport_state: dict[str, object] = field(default_factory=dict)
    ready: list[tuple[int, Any]] = field(default_factory=list)  # (CUDA device, event) recorded at put

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def wait_ready(self) -> None:
        """Make the calling thread's current CUDA streams wait for the work that produced the
        tensors (recorded when the object was put); no host synchronisation."""
        if not self.ready:
            return
        import torch

        for device, event in self.ready:
            torch.cuda.current_stream(device).wait_event(event)


@dataclass(frozen=True)
class FetchRequest:
    """Consumer side: what one fetch needs to know about the object it pulls."""

    object_id: bytes
    token: bytes
    owner: PeerInfo
    metas: tuple[TensorMeta, ...]
    packed_nbytes: int
    handle: bytes | None
    deadline: float  # time.monotonic() value

    def __repr__(self) -> str:  # never show the token
        return f"FetchRequest(id={self.object_id.hex()}, owner={self.owner.agent_id}, tensors={len(self.metas)})"

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class TransportContext(ABC):
    """What the per-process agent offers to the transports it creates and to collectives.

    This is the whole contract: transports and collectives call nothing else on the agent.
    The groups of methods: identity and settings; objects (producer and consumer); reaching
    other agents; the rendezvous mailbox (small keyed values agents leave for one another,
    by *group*: connection set-up, collective message channels and stores).
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
    def rendezvous_set(self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float) -> None:
        """Either side of a connection: publish ``key`` of ``group`` here and at ``peer``.

        Blocks until ``peer`` stored it (a dropped connection is retried once); raises the
        mapped tensorwire error.
        """

    @abstractmethod
    def rendezvous_push(self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float) -> None:
        """Set ``key`` of ``group`` at ``peer`` only (a member of a larger group telling another).

        Blocks like :meth:`rendezvous_set`; ``peer`` may be this process.
        """

    @abstractmethod
    def rendezvous_push_async(
        self, peer: PeerInfo, group: str, key: str, value: bytes, *, timeout_s: float
    ) -> Callable[[], None]:
        """Start :meth:`rendezvous_push` and return at once; the returned function blocks
        until it is done and raises its error (a sender tells several peers at once)."""

    @abstractmethod
    def rendezvous_get(self, group: str, key: str, *, timeout_s: float) -> bytes:
        """Either side: the value of ``key`` of ``group`` once set here or pushed by the peer.

        Blocks until then; raises ``TransferTimeoutError`` after ``timeout_s``.
        """

    @abstractmethod
    def rendezvous_take(self, group: str, key: str, *, timeout_s: float) -> bytes:
        """Like :meth:`rendezvous_get`, and remove the key (a message consumed once)."""

    @abstractmethod
    def rendezvous_forget(self, group: str) -> None:
        """Drop every key of ``group`` (its connection is made or abandoned). Never blocks."""

    @abstractmethod
    def export_handles(self, desc: ObjectDescriptor) -> dict[str, bytes]:
        """Producer, for an object it owns: the one-sided transports' handles, made on the
        first call (may block while a transport copies) and cached; ``{}`` if not owned here."""

    @abstractmethod
    def free(self, desc: ObjectDescriptor, *, timeout_s: float | None = None) -> None:
        """Any process: free the object now at its owner. Idempotent; a dead owner is a
        no-op. Blocks for the owner's answer (at most ``timeout_s``)."""

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
        timeout_s: float | None = None,
    ) -> tuple[list[torch.Tensor], TransferRecord]:
        """Consumer: the object's tensors and the record of how they came, through the
        transport the selector picks (or ``transport``), falling back on failure.

        Blocks until every byte arrived or ``timeout_s`` passed; ``Agent.fetch`` documents
        the arguments.
        """

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

    def view(self, request: FetchRequest) -> list[torch.Tensor]:
        """Consumer: tensors that map the producer's bytes without a copy.

        Only for ``zero_copy_view``. Host mappings (shm) are copy-on-write: writing to them
        never changes the producer's data. GPU mappings (cuda_ipc) share the producer's
        memory: treat them as read-only.
        """
        raise TransportUnavailableError(f"transport {self.name!r} has no zero-copy view")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Any process, at agent shutdown: release process-wide resources."""
