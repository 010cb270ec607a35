"""Failover: a push whose trainer died completes from the trainers that are left.

When a trainer dies mid-push, the receivers abort that attempt (all-or-none: every one keeps the
version it had; best effort: some hold part of it). If the surviving trainers still hold every
byte of every receiver's plan (data-parallel replicas, HSDP groups), the driver plans again over
them and pushes the same version once more, so the push completes exact; the dead trainer is
out of the sync from then on. Only when some range has no live source does the push fail (the
receivers stay where they were).
"""

from __future__ import annotations

from collections.abc import Mapping as MappingABC
from collections.abc import Sequence

from tensorwire.collectives.layout import HeldParam
from tensorwire.collectives.plan import Mapping, Plan

__all__ = ["replan_without"]


def replan_without(
    dead: int,
    trainer_layouts: Sequence[Sequence[HeldParam]],
    mapping: Mapping,
    receiver_layouts: MappingABC[int, Sequence[HeldParam]],
) -> tuple[Plan | None, str]:
    """The plan over every trainer but ``dead`` for the same receivers, or (None, why) when
    some receiver's bytes are held by no other trainer."""
    survivors = [layout for i, layout in enumerate(trainer_layouts) if i != dead]
    if not survivors:
        return None, "it was the only trainer"
    plan = Plan(survivors, mapping)
    try:
        for rid, layout in receiver_layouts.items():
            plan.add_receiver(rid, layout)
    except ValueError as e:  # a gap: the dead trainer held bytes no other does
        return None, f"no other trainer holds all of it ({e})"
    return plan, ""
