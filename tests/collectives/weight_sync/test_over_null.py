"""Collectives with no real transport under them: a ``tensorwire``-backend group whose two
members are threads of this one process, every fetch forced through the test-only ``null``
transport. What is checked is the collectives' own work: the message protocol, publishing and
reading, the reductions. (Two members: messages are keyed by their sender in the receiving
process's mailbox, and here every member's mailbox is this process's.)"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from tensorwire.collectives.groups.channel import Member
from tensorwire.collectives.groups.group import Backend
from tensorwire.collectives.groups.tensorwire_group import TensorwireGroup

WORLD = 2


def _in_every_member(over_null, name: str, op: Callable[[TensorwireGroup], object]) -> list[object]:
    members = [Member(rank, over_null.peer, 0) for rank in range(WORLD)]
    groups = [TensorwireGroup(name, rank, members, Backend.TENSORWIRE, 30.0) for rank in range(WORLD)]
    results: list[object] = [None] * WORLD
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = op(groups[rank])
        except BaseException as e:  # re-raised in the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for group in groups:
        group.destroy()
    assert not any(t.is_alive() for t in threads), "a member is still waiting"
    if errors:
        raise errors[0]
    return results


def test_broadcast_all_reduce_and_all_gather(over_null):
    def ops(group: TensorwireGroup) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        mine = torch.full((4,), float(group.rank + 1))
        source = torch.arange(6.0) if group.rank == 1 else torch.zeros(6)
        group.broadcast(source, src=1)
        group.all_reduce(mine)
        gathered = [torch.zeros(2) for _ in range(WORLD)]
        group.all_gather(gathered, torch.full((2,), float(group.rank)))
        return source, mine, gathered

    for source, total, gathered in _in_every_member(over_null, "null-collectives", ops):
        assert torch.equal(source, torch.arange(6.0))
        assert torch.equal(total, torch.full((4,), 3.0))  # 1 + 2
        assert [int(g[0]) for g in gathered] == [0, 1]


def test_send_and_recv_in_order(over_null):
    def ops(group: TensorwireGroup) -> list[float]:
        if group.rank == 0:
            for value in (1.0, 2.0):
                group.send(torch.full((3,), value), dst=1)
            return []
        if group.rank == 1:
            got = []
            for _ in range(2):
                buffer = torch.zeros(3)
                group.recv(buffer, src=0)
                got.append(float(buffer[0]))
            return got
        return []

    assert _in_every_member(over_null, "null-p2p", ops)[1] == [1.0, 2.0]
