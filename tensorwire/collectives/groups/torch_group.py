"""The ``gloo`` and ``nccl`` backends of groups: a standalone ``torch.distributed`` process
group per group (never the default process group, so a process may be in several groups and
user code keeps its own); its c10d store is the agents' control service
(:class:`~tensorwire.transport.process_groups.ControlStore`), and every wait checks that the
members still run."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.collectives.groups.channel import Member
from tensorwire.collectives.groups.group import Backend, Group, ReduceOp
from tensorwire.errors import PeerLostError, TensorwireError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.transport.process_groups import ControlStore, GlooWorks, NcclWorks, abort_group
from tensorwire.transport.shutdown import run_bounded

__all__ = ["TorchGroup"]


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
