"""Members of a group of actors and the messages they send each other.

A :class:`Channel` carries small messages between the members of one group over the
agents' authenticated control service (``Rendezvous`` calls): each message is pushed into
the receiver's table under a key and taken from there once. Tensors never travel here:
a member *publishes* tensors as an object of its agent and sends the others an
*announcement* (descriptor, capability token and export handles, protobuf-encoded; nothing
is unpickled); they fetch it over the transport the selector picks for their pair (shm
from one segment for every same-node member, cuda_ipc on one GPU, ucx/gloo across nodes).

Every wait has a deadline and looks every 20 ms (:data:`MEMBER_ALIVE_CHECK_EVERY_S`: a look at ``/proc``)
whether the member it waits for still runs, so a dead member fails the wait at once on one
machine (by the deadline on another machine).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tensorwire.errors import OwnerDiedError, PeerLostError, TransferTimeoutError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.api import register_tensors
from tensorwire.runtime.ray.hooks import actor_hook
from tensorwire.runtime.refs.placement import target_device
from tensorwire.transport.agent.wire import decode_announcement, encode_announcement, peer_from_bytes, peer_to_bytes
from tensorwire.transport.contract import ObjectDescriptor, PeerInfo
from tensorwire.transport.waiting import wait_until

__all__ = ["MEMBER_ALIVE_CHECK_EVERY_S", "Channel", "Fetched", "Member", "describe_self", "member_from"]


MEMBER_ALIVE_CHECK_EVERY_S = 0.02  # how often a member's wait looks whether the member it waits for still runs


class Fetched(NamedTuple):
    """What :meth:`Channel.fetch` got: the tensors, the transport, and the time spent copying."""

    tensors: list[torch.Tensor]
    transport: str
    copy_s: float


@dataclass(frozen=True)
class Member:
    """One member of a group as the others know it."""

    rank: int
    peer: PeerInfo
    cuda_devices: int

    @property
    def node_id(self) -> str:
        return self.peer.node_id


@actor_hook
def describe_self(_actor: object) -> tuple[bytes, int]:
    """Hook: this actor's agent (``Peer`` message bytes) and how many GPUs it sees."""
    peer = runtime_agent().peer
    return peer_to_bytes(peer), torch.cuda.device_count() if torch.cuda.is_available() else 0


def member_from(rank: int, description: tuple[bytes, int]) -> Member:
    """The :class:`Member` that :func:`describe_self` described."""
    return Member(rank, peer_from_bytes(description[0]), int(description[1]))


class Channel:
    """Messages between the members of one group, seen from member ``rank``."""

    def __init__(self, name: str, rank: int, members: Sequence[Member], timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.members = tuple(members)
        self.timeout_s = timeout_s
        self._agent = runtime_agent()

    def send(self, rank: int, key: str, value: bytes) -> None:
        """Put ``value`` under ``key`` in member ``rank``'s table."""
        self.post(rank, key, value)()

    def post(self, rank: int, key: str, value: bytes) -> Callable[[], None]:
        """Start :meth:`send`; the returned function waits for it (``PeerLostError`` if the
        member is gone). Several posts travel at once."""
        peer = self.members[rank].peer
        # keys are per sender, so that several members may send one key to the same member
        wait = self._agent.rendezvous_push_async(peer, self.name, f"{self.rank}:{key}", value, timeout_s=self.timeout_s)

        def done() -> None:
            try:
                wait()
            except (PeerLostError, OwnerDiedError, TransferTimeoutError) as e:
                state = "exited" if not self.alive(rank) else "did not take a message"
                raise PeerLostError(f"group {self.name}: member {rank} {state}: {e}") from None

        return done

    def recv(
        self, rank: int, key: str, timeout_s: float | None = None, *, check: Callable[[], None] | None = None
    ) -> bytes:
        """Take the value member ``rank`` sent under ``key``, waiting for it.

        ``check`` runs with the liveness check (every :data:`MEMBER_ALIVE_CHECK_EVERY_S`) and may raise to
        stop waiting (a weight-sync receiver looks whether the driver aborted the push).

        Raises:
            PeerLostError: Member ``rank`` exited before sending.
            TransferTimeoutError: Nothing came before the deadline.
        """

        def take(slice_s: float) -> bytes | None:
            try:
                return self._agent.rendezvous_take(self.name, f"{rank}:{key}", timeout_s=slice_s)
            except TransferTimeoutError:
                return None

        def alive_and_wanted() -> None:
            if not self.alive(rank):
                raise PeerLostError(f"group {self.name}: member {rank} exited (waiting for {key!r})")
            if check is not None:
                check()

        return wait_until(
            take,
            deadline=time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s),
            what=f"group {self.name}: {key!r} from member {rank}",
            check=alive_and_wanted,
            check_every_s=MEMBER_ALIVE_CHECK_EVERY_S,
        )

    def recv_any(
        self, wanted: Sequence[tuple[int, str]], *, timeout_s: float, check: Callable[[], None] | None = None
    ) -> tuple[int, bytes]:
        """Take the first value to come of ``wanted`` ((member rank, key) pairs; of those here
        at once, the earliest in ``wanted``): its index in ``wanted`` and the value. ``check``
        runs every :data:`MEMBER_ALIVE_CHECK_EVERY_S` and may raise to stop waiting (it looks
        whether the members are alive: this does not).

        Raises:
            TransferTimeoutError: Nothing came within ``timeout_s``.
        """
        keys = [f"{rank}:{key}" for rank, key in wanted]

        def take(slice_s: float) -> tuple[int, bytes] | None:
            try:
                return self._agent.rendezvous_take_any(self.name, keys, timeout_s=slice_s)
            except TransferTimeoutError:
                return None

        return wait_until(
            take,
            deadline=time.monotonic() + timeout_s,
            what=f"group {self.name}: any of {len(keys)} message(s)",
            check=check,
            check_every_s=MEMBER_ALIVE_CHECK_EVERY_S,
        )

    def alive(self, rank: int) -> bool:
        """False once member ``rank``'s process is known to have exited."""
        return self._agent.peer_may_be_alive(self.members[rank].peer)

    def responds(self, rank: int, *, timeout_s: float = 2.0) -> bool:
        """Whether member ``rank``'s process can act now: on this machine, alive and not stopped
        (``SIGSTOP``, a debugger); on another, its agent answers within ``timeout_s``."""
        return self._agent.peer_responds(self.members[rank].peer, timeout_s=timeout_s)

    def publish(
        self, tensors: Sequence[torch.Tensor], *, export: bool = True, across_nodes: bool = True
    ) -> tuple[ObjectDescriptor, bytes, int]:
        """Register ``tensors`` (contiguous) as an object of this member, to be read by others.

        Returns its descriptor, the announcement to send, and the bytes the one-sided exports
        hold beyond the tensors (a segment copy). ``export``: make one-sided exports now (a
        shared-memory segment, for readers on this node); without it readers that need one ask
        for it. ``across_nodes=False``: every reader is on this node (exports for other nodes
        are not made). Free with :meth:`unpublish`.
        """
        desc = register_tensors(list(tensors))
        handles = self._agent.export_handles(desc, across_nodes=across_nodes) if export else {}
        desc = self._agent.described_now(desc)  # the connection info the exports published
        return desc, encode_announcement(desc, handles), self._agent.export_nbytes(desc)

    def exports_across_nodes(self) -> bool:
        """Whether a one-sided transport usable here exports handles that readers on other
        nodes can use (e.g. nixl): then publishing for such readers should export."""
        return any(
            c.cross_node and c.needs_export and not c.export_per_consumer
            for c in (t.capabilities for t in self._agent.transports().values())
        )

    def unpublish(self, desc: ObjectDescriptor) -> None:
        self._agent.free(desc)

    def fetch(
        self,
        announcement: bytes,
        dst: Sequence[torch.Tensor | None],
        *,
        transport: str = "",
        targets: Sequence[torch.device] | None = None,
        timeout_s: float | None = None,
    ) -> Fetched:
        """Fetch an announced object into ``dst`` (contiguous tensors, or None to allocate).

        ``targets``: where each tensor without a buffer lands (default: each given buffer's
        device, else the device the producer had, mapped here). ``Fetched.tensors`` are ``dst``'s
        own where given; ``copy_s`` is the time spent putting them in place after the transfer
        (copying into ``dst`` where a transport could not write it, moving to a target device).
        """
        desc, handles = decode_announcement(announcement)
        if len(desc.metas) != len(dst):
            raise ValueError(f"group {self.name}: announced {len(desc.metas)} tensors, expected {len(dst)}")
        if targets is None:
            targets = [
                t.device if t is not None else target_device(m, None) for t, m in zip(dst, desc.metas, strict=True)
            ]
        tensors, record = self._agent.fetch(
            desc,
            handles,
            dst=list(dst),
            targets=targets,
            transport=transport,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
        )
        return Fetched(tensors, record.transport, record.placed_s)

    def close(self) -> None:
        """Drop messages not taken yet."""
        self._agent.rendezvous_forget(self.name)
