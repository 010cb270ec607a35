"""Groups of actors and their collective operations (what runs inside the member actors).

``tw.collective.create_group(actors, ...)`` (driver, :mod:`tensorwire.collectives.groups.api`) makes
every actor join; inside an actor ``tw.collective.get_group(name)`` returns its
:class:`Group`, whose methods mirror ``torch.distributed``'s names and semantics: every
member calls the same operations in the same order; tensors are changed in place.

This module holds what every backend shares (the :class:`Group` base, :class:`Backend`,
:class:`ReduceOp`); the backends are :mod:`.torch_group` (``gloo`` / ``nccl``: a standalone
``torch.distributed`` process group) and :mod:`.tensorwire_group` (``tensorwire``: our own
transports); :mod:`.membership` keeps this process's memberships.

Every operation has the group's deadline; a member that exits fails the operation on the
others (``PeerLostError``) instead of hanging them, and the group must then be destroyed and
made again.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorwire.collectives.groups.channel import Member

__all__ = ["BACKENDS", "Backend", "Group", "ReduceOp", "reduce", "reduce_op"]


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


def reduce_op(op: Any) -> ReduceOp:
    """The :class:`ReduceOp` for ``ReduceOp.SUM``, "sum", ``dist.ReduceOp.SUM``...;
    ``ValueError`` for anything else."""
    if isinstance(op, ReduceOp):
        return op
    name = op.lower() if isinstance(op, str) else str(op).rpartition(".")[2].lower()
    try:
        return ReduceOp(name)
    except ValueError:
        raise ValueError(f"unsupported reduce op {op!r}; use one of {', '.join(o.value for o in ReduceOp)}") from None


def reduce(tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
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
        self._destroyed = False  # left, or a failure made the group unusable
        self.left = False  # destroy() was called: the name is free again in this process

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
        reduction = reduce_op(op)
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
        reduction = reduce_op(op)
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
        self._destroyed = self.left = True
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
