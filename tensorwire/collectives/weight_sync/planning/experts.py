"""Experts placed by the inference engine's own map.

Engines place mixture-of-experts weights by an expert map (expert-parallel load balancing,
redundant experts on several ranks), not in the trainer's contiguous blocks. A receiver
describes such a tensor with :meth:`.layout.Sharded.experts`: its local tensor holds, in slot
``s`` along dim 0, the global expert ``experts[s]`` (any order; an expert may sit on several
ranks). The plan then reads, for each run of slots holding consecutive experts, exactly those
experts' bytes from whichever trainers hold them (their own pieces, contiguous blocks or
not): every byte read once per slot that holds it, nothing gathered first (:func:`needs`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece

__all__ = ["needs", "runs"]


def runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first slot, first expert, length)`` of each run of slots holding consecutive experts."""
    result: list[tuple[int, int, int]] = []
    for slot, expert in enumerate(rows):
        if result and result[-1][1] + result[-1][2] == expert and result[-1][0] + result[-1][2] == slot:
            first_slot, first_expert, length = result[-1]
            result[-1] = (first_slot, first_expert, length + 1)
        else:
            result.append((slot, expert, 1))
    return result


def needs(part: str, held: ParamPiece) -> list[tuple[str, Box, tuple[int, ...]]]:
    """(part, the experts of one run as a box of the global tensor, where they land locally)
    for a piece placed by an expert map (``held.rows``)."""
    rest = tuple(held.global_shape[1:])
    zeros = (0,) * len(rest)
    return [
        (part, Box((expert, *zeros), (length, *rest)), (slot, *zeros)) for slot, expert, length in runs(held.rows or ())
    ]
