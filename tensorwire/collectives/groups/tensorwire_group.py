"""The ``tensorwire`` backend of groups: collectives over tensorwire's own transports.

A broadcast is one object read by every member of the source's node (one shm segment, or
cuda_ipc), relayed across nodes by one member per node along a binary tree
(:func:`broadcast_parents`); all-gather, reduce-scatter and all-reduce fetch each member's
contribution directly. For machines without NCCL, and host tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tensorwire.collectives.groups.channel import Channel, Member
from tensorwire.collectives.groups.group import Backend, Group, ReduceOp, reduce

__all__ = ["TensorwireGroup", "broadcast_parents"]


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
            tensor.copy_(self.channel.fetch(announcement, [None], targets=[tensor.device]).tensors[0])

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
        output.copy_(reduce(parts, op))

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._all_gather(gathered, tensor)
        tensor.copy_(reduce(gathered, op))

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
