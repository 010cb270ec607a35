"""Groups of actors and their collective operations (what runs inside the member actors).

``tw.collective.create_group(actors, ...)`` (driver, :mod:`tensorwire.collectives.api`) makes
every actor join; inside an actor ``tw.collective.get_group(name)`` returns its
:class:`Group`, whose methods mirror ``torch.distributed``'s names and semantics: every
member calls the same operations in the same order; tensors are changed in place.

Backends:

* ``gloo`` / ``nccl``: a standalone ``torch.distributed`` process group per group (never the
  default process group, so a process may be in several groups and user code keeps its
  own); its c10d store is the agents' control service.
* ``tensorwire``: our transports (:class:`TensorwireGroup`). A broadcast is one object read
  by every member of the source's node (one shm segment, or cuda_ipc), relayed across nodes
  by one member per node along a binary tree; all-gather, reduce-scatter and all-reduce
  fetch each member's contribution directly. For machines without NCCL, and host tensors.

Every operation has the group's deadline; a member that exits fails the operation on the
others (``PeerLostError``) instead of hanging them, and the group must then be destroyed and
made again.
"""

from __future__ import annotations

import datetime
import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.collectives.channel import Channel, Member, member_from
from tensorwire.errors import PeerLostError, TensorwireError, TransferTimeoutError
from tensorwire.runtime.hooks import actor_hook
from tensorwire.runtime.ray_env import agent as runtime_agent
from tensorwire.transport.backends.gloo import GlooWorks
from tensorwire.transport.backends.nccl import NcclWorks
from tensorwire.transport.process_groups import ControlStore, abort_group
from tensorwire.transport.shutdown import run_bounded

__all__ = ["BACKENDS", "Backend", "Group", "ReduceOp", "TensorwireGroup", "TorchGroup", "get_group", "group_names",
           "join", "leave"]  # fmt: skip


class Backend(str, enum.Enum):
    """How a group's collectives run (see the module doc). Equal to its name as a string."""

    GLOO = "gloo"
    NCCL = "nccl"
    TENSORWIRE = "tensorwire"

    def __str__(self) -> str:
        return self.value


class ReduceOp(str, enum.Enum):
    """The reductions of ``all_reduce`` and ``reduce_scatter``. Equal to its name as a string."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    def __str__(self) -> str:
        return self.value


BACKENDS = tuple(b.value for b in Backend)

_groups: dict[str, Group] = {}
_groups_lock = threading.Lock()


def _reduce_op(op: Any) -> ReduceOp:
    """The :class:`ReduceOp` for ``ReduceOp.SUM``, "sum", ``dist.ReduceOp.SUM``...;
    ``ValueError`` for anything else."""
    if isinstance(op, ReduceOp):
        return op
    name = op.lower() if isinstance(op, str) else str(op).rpartition(".")[2].lower()
    try:
        return ReduceOp(name)
    except ValueError:
        raise ValueError(f"unsupported reduce op {op!r}; use one of {', '.join(o.value for o in ReduceOp)}") from None


def _reduce(tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Elementwise reduction of equally shaped tensors, in rank order."""
    stacked = torch.stack(list(tensors))
    if op is ReduceOp.SUM:
        return stacked.sum(0)
    if op is ReduceOp.AVG:
        return stacked.sum(0) / len(tensors) if stacked.is_floating_point() else stacked.sum(0) // len(tensors)
    if op is ReduceOp.PRODUCT:
        return stacked.prod(0)
    if op is ReduceOp.MIN:
        return stacked.amin(0)
    return stacked.amax(0)


class Group(ABC):
    """One member's view of a group. Methods follow ``torch.distributed``'s collectives."""

    def __init__(self, name: str, rank: int, members: Sequence[Member], backend: Backend, timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.members = tuple(members)
        self.backend = Backend(backend)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one operation at a time, so every member sees one order
        self._destroyed = False

    @property
    def world_size(self) -> int:
        return len(self.members)

    def __repr__(self) -> str:
        return f"tw.collective.Group({self.name!r}, rank={self.rank}/{self.world_size}, backend={self.backend!r})"

    def _check_rank(self, rank: int, what: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what} rank {rank!r} is not in group {self.name!r} (ranks 0..{self.world_size - 1})")

    def _run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._destroyed:
                raise RuntimeError(f"group {self.name!r} was destroyed")
            return fn()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Every member's ``tensor`` becomes ``src``'s."""
        self._check_rank(src, "source")
        self._run(lambda: self._broadcast(tensor, src))

    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM) -> None:
        """``tensor`` becomes the reduction (sum by default) of every member's ``tensor``."""
        reduction = _reduce_op(op)
        self._run(lambda: self._all_reduce(tensor, reduction))

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """``tensor_list[r]`` becomes member ``r``'s ``tensor``."""
        if len(tensor_list) != self.world_size:
            raise ValueError(f"all_gather needs {self.world_size} output tensors, got {len(tensor_list)}")
        self._run(lambda: self._all_gather(tensor_list, tensor))

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM) -> None:
        """``output`` on member ``r`` becomes the reduction of every member's ``input_list[r]``."""
        if len(input_list) != self.world_size:
            raise ValueError(f"reduce_scatter needs {self.world_size} input tensors, got {len(input_list)}")
        reduction = _reduce_op(op)
        self._run(lambda: self._reduce_scatter(output, input_list, reduction))

    def barrier(self) -> None:
        """Return once every member called ``barrier``."""
        self._run(self._barrier)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to member ``dst`` (which calls ``recv`` with this rank and tag)."""
        self._check_rank(dst, "destination")
        if dst == self.rank:
            raise ValueError("a member cannot send to itself")
        self._run(lambda: self._send(tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        """Receive into ``tensor`` what member ``src`` sends with ``tag``."""
        self._check_rank(src, "source")
        if src == self.rank:
            raise ValueError("a member cannot receive from itself")
        self._run(lambda: self._recv(tensor, src, tag))

    def destroy(self) -> None:
        """Leave the group (only here; the driver's ``destroy_group`` makes every member leave)."""
        with _groups_lock:
            if _groups.get(self.name) is self:
                del _groups[self.name]
        self._destroyed = True
        self._close()

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None: ...

    @abstractmethod
    def _all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def _reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp) -> None: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None: ...

    @abstractmethod
    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...


# ---------------------------------------------------------------------- torch.distributed backends


class TorchGroup(Group):
    """A standalone gloo or NCCL process group over all members."""

    def __init__(self, name: str, rank: int, members: Sequence[Member], backend: Backend, timeout_s: float) -> None:
        super().__init__(name, rank, members, backend, timeout_s)
        agent = runtime_agent()
        others = [m.peer for m in members if m.rank != rank]
        store_name = f"{name}/store"
        store = ControlStore(agent, others, store_name, timeout_s)
        try:
            if self.backend is Backend.GLOO:
                options = dist.ProcessGroupGloo._Options()
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=agent.config.host)]
                options._timeout = datetime.timedelta(seconds=timeout_s)
                self._pg = dist.ProcessGroupGloo(store, rank, len(members), options)
                self._works: type = GlooWorks
                self._device = torch.device("cpu")
            else:
                if not torch.cuda.is_available() or not dist.is_nccl_available():
                    raise TensorwireError(f"group {name!r}: backend nccl needs a GPU and torch built with NCCL")
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = datetime.timedelta(seconds=timeout_s)
                self._pg = dist.ProcessGroupNCCL(store, rank, len(members), options)
                self._works = NcclWorks
                self._device = torch.device("cuda", torch.cuda.current_device())
        except RuntimeError as e:
            raise PeerLostError(f"group {name!r}: members could not connect: {e}") from None
        finally:
            agent.rendezvous_forget(store_name)

    def _check_members(self) -> None:
        agent = runtime_agent()
        for member in self.members:
            if not agent.peer_may_be_alive(member.peer):
                raise PeerLostError(f"group {self.name!r}: member {member.rank} exited")

    def _wait(self, work: Any, buffers: Sequence[torch.Tensor], what: str) -> None:
        try:
            self._works(self._pg, [work], buffers).wait(
                time.monotonic() + self.timeout_s, self._check_members, f"group {self.name!r} {what}"
            )
        except TensorwireError:
            abort_group(self._pg)  # a member is gone or late: this group cannot be trusted any more
            self._destroyed = True
            raise

    def _post(self, what: str, post: Callable[[], Any], buffers: Sequence[torch.Tensor]) -> None:
        try:
            work = post()
        except RuntimeError as e:
            raise PeerLostError(f"group {self.name!r} {what}: {e}") from None
        self._wait(work, buffers, what)

    def _dist_op(self, op: ReduceOp) -> Any:
        if op is ReduceOp.AVG and self.backend is Backend.GLOO:
            return dist.ReduceOp.SUM  # gloo has no AVG: divided afterwards
        return getattr(dist.ReduceOp, op.name)

    def _finish_avg(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        if op is ReduceOp.AVG and self.backend is Backend.GLOO:
            if tensor.is_floating_point():
                tensor.div_(self.world_size)
            else:
                tensor.floor_divide_(self.world_size)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self._post("broadcast", lambda: self._pg.broadcast([tensor], options), [tensor])

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = self._dist_op(op)
        self._post("all_reduce", lambda: self._pg.allreduce([tensor], options), [tensor])
        self._finish_avg(tensor, op)

    def _all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self._post("all_gather", lambda: self._pg.allgather([tensor_list], [tensor]), [tensor, *tensor_list])

    def _reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp) -> None:
        options = dist.ReduceScatterOptions()
        options.reduceOp = self._dist_op(op)
        post = lambda: self._pg.reduce_scatter([output], [input_list], options)  # noqa: E731
        self._post("reduce_scatter", post, [output, *input_list])
        self._finish_avg(output, op)

    def _barrier(self) -> None:
        token = torch.zeros(1, device=self._device)
        self._all_reduce(token, ReduceOp.SUM)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._post("send", lambda: self._pg.send([tensor], dst, tag), [tensor])

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self._post("recv", lambda: self._pg.recv([tensor], src, tag), [tensor])

    def _close(self) -> None:
        # Bounded: an NCCL or gloo abort that blocks is left behind with a warning.
        run_bounded(lambda: abort_group(self._pg), what=f"aborting the process group of {self.name!r}")


# ---------------------------------------------------------------------- tensorwire backend


def broadcast_parents(members: Sequence[Member], src: int) -> dict[int, int]:
    """Member rank -> the rank it fetches a broadcast from (the source has none).

    Members on the source's node read the source's object directly (one shm segment or
    cuda_ipc mapping for all of them). On every other node the lowest rank is its node's
    *leader*: leaders form a binary tree under the source (so no member serves more than
    two other nodes), and the rest of a node reads from its leader, over same-node memory.
    """
    by_node: dict[str, list[int]] = {}
    for member in members:
        by_node.setdefault(member.node_id, []).append(member.rank)
    src_node = members[src].node_id
    parents = {rank: src for rank in by_node[src_node] if rank != src}
    leaders = [src] + [ranks[0] for node, ranks in by_node.items() if node != src_node]
    for index, leader in enumerate(leaders[1:], start=1):
        parents[leader] = leaders[(index - 1) // 2]
    for node, ranks in by_node.items():
        if node != src_node:
            for rank in ranks[1:]:
                parents[rank] = ranks[0]
    return parents


class TensorwireGroup(Group):
    """Collectives over tensorwire's own transports (see the module's documentation)."""

    def __init__(self, name: str, rank: int, members: Sequence[Member], backend: Backend, timeout_s: float) -> None:
        super().__init__(name, rank, members, backend, timeout_s)
        self.channel = Channel(name, rank, members, timeout_s)
        self._sequence = 0
        self._p2p: dict[tuple[int, int, int], int] = {}  # (src, dst, tag) -> messages so far

    def _next(self) -> str:
        self._sequence += 1
        return f"c{self._sequence}"

    def _fetch_into(self, announcement: bytes, tensor: torch.Tensor) -> None:
        if tensor.is_contiguous():
            self.channel.fetch(announcement, [tensor])
        else:
            tensor.copy_(self.channel.fetch(announcement, [None]).tensors[0])

    def _serve(self, tensors: Sequence[torch.Tensor], readers: Sequence[int], key: str) -> None:
        """Publish ``tensors``, announce them to ``readers`` and keep them until each acked."""
        if not readers:
            return
        desc, announcement, _ = self.channel.publish([t.contiguous() for t in tensors])
        try:
            for reader in readers:
                self.channel.send(reader, key, announcement)
            for reader in readers:
                self.channel.recv(reader, f"{key}/ack")
        finally:
            self.channel.unpublish(desc)

    def _read(self, owner: int, key: str, into: torch.Tensor) -> None:
        """Fetch what ``owner`` announced under ``key`` into ``into`` and acknowledge."""
        self._fetch_into(self.channel.recv(owner, key), into)
        self.channel.send(owner, f"{key}/ack", b"")

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        key = self._next()
        parents = broadcast_parents(self.members, src)
        children = [rank for rank, parent in parents.items() if parent == self.rank]
        if self.rank != src:
            self._read(parents[self.rank], key, tensor)
        self._serve([tensor], children, key)

    def _exchange(self, key: str, mine: Callable[[int], torch.Tensor], into: Callable[[int], torch.Tensor]) -> None:
        """Every member sends ``mine(r)`` to member ``r`` and receives into ``into(r)``:
        each publishes all its contributions before it reads, so no member waits on another."""
        others = [r for r in range(self.world_size) if r != self.rank]
        objects = []
        try:
            for reader in others:  # publish all first, so no member waits on another's reads
                desc, announcement, _ = self.channel.publish([mine(reader).contiguous()])
                objects.append(desc)
                self.channel.send(reader, f"{key}/{self.rank}", announcement)
            for owner in others:
                self._fetch_into(self.channel.recv(owner, f"{key}/{owner}"), into(owner))
                self.channel.send(owner, f"{key}/{owner}/ack", b"")
            for reader in others:
                self.channel.recv(reader, f"{key}/{self.rank}/ack")
        finally:
            for desc in objects:
                self.channel.unpublish(desc)

    def _all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self._exchange(self._next(), lambda _r: tensor, lambda r: tensor_list[r])
        tensor_list[self.rank].copy_(tensor)

    def _reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp) -> None:
        parts = [torch.empty_like(input_list[r]) for r in range(self.world_size)]
        parts[self.rank] = input_list[self.rank]
        self._exchange(self._next(), lambda r: input_list[r], lambda r: parts[r])
        output.copy_(_reduce(parts, op))

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._all_gather(gathered, tensor)
        tensor.copy_(_reduce(gathered, op))

    def _barrier(self) -> None:
        key = self._next()
        others = [r for r in range(self.world_size) if r != self.rank]
        for rank in others:
            self.channel.send(rank, f"{key}/{self.rank}", b"")
        for rank in others:
            self.channel.recv(rank, f"{key}/{rank}")

    def _p2p_key(self, src: int, dst: int, tag: int) -> str:
        count = self._p2p.get((src, dst, tag), 0)
        self._p2p[(src, dst, tag)] = count + 1
        return f"p{src}>{dst}/{tag}/{count}"

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._serve([tensor], [dst], self._p2p_key(self.rank, dst, tag))

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self._read(src, self._p2p_key(src, self.rank, tag), tensor)

    def _close(self) -> None:
        self.channel.close()


# ---------------------------------------------------------------------- membership (hooks)


@actor_hook
def join(  # noqa: PLR0917 - a hook: called positionally through Ray
    _actor: object,
    name: str,
    channel: str,
    rank: int,
    descriptions: list[tuple[bytes, int]],
    backend: Backend,
    timeout_s: float,
) -> Backend:
    """Hook: become member ``rank`` of group ``name`` (every member joins at once)."""
    members = [member_from(r, d) for r, d in enumerate(descriptions)]
    with _groups_lock:
        if name in _groups:
            raise ValueError(f"this process is already in a group named {name!r}; destroy it first")
    backend = Backend(backend)
    kind = TensorwireGroup if backend is Backend.TENSORWIRE else TorchGroup
    try:
        group = kind(channel, rank, members, backend, timeout_s)
    except TransferTimeoutError as e:
        raise TransferTimeoutError(f"group {name!r}: not every member joined in time: {e}") from None
    group.name = name
    with _groups_lock:
        _groups[name] = group
    return backend


@actor_hook
def leave(_actor: object, name: str) -> bool:
    """Hook: leave group ``name``; False if this process was not in it."""
    with _groups_lock:
        group = _groups.get(name)
    if group is None:
        return False
    group.destroy()
    return True


def get_group(name: str = "default") -> Group:
    """This process's membership of group ``name`` (inside a member actor)."""
    with _groups_lock:
        group = _groups.get(name)
        if group is None:
            known = sorted(_groups) or "none"
            raise ValueError(f"this process is not in a group named {name!r} (its groups: {known})")
        return group


def group_names() -> list[str]:
    """The groups this process is a member of."""
    with _groups_lock:
        return sorted(_groups)
