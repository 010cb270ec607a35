"""Failover: a push whose trainer died or stalled completes from the trainers that are left.

When a trainer dies mid-push, or *stalls* (a receiver waited ``stall_s`` for its next bucket:
progress, not a total timeout), the receivers abort that attempt (all-or-none: every one keeps
the version it had; best effort: some hold part of it). If the surviving trainers still hold
every byte of every receiver's plan (data-parallel replicas, HSDP groups), the driver plans
again over them and pushes the same version once more, leaving out the pieces each receiver
already has (:func:`arrived`: they stay where the first try put them, in the shadows or the
tensors), so only the missing ranges are read again and the push completes exact. The trainer
that failed is out of the sync from then on. Only when some range has no live source does the
push fail (the receivers stay where they were).

A stalled trainer's call is left running (Ray cannot interrupt it); whatever it does later goes
to a push that is over and is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping as MappingABC
from collections.abc import Sequence

from tensorwire.collectives import sync_hooks
from tensorwire.collectives.layout import Box, HeldParam
from tensorwire.collectives.plan import Mapping, Plan
from tensorwire.runtime import calls
from tensorwire.runtime.actor import ActorHandle
from tensorwire.runtime.hooks import call_hook

__all__ = ["arrived", "count_lost", "replan_without"]

logger = logging.getLogger(__name__)


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


def arrived(
    sync_id: str,
    version: int,
    receivers: MappingABC[int, ActorHandle],
    layouts: MappingABC[int, Sequence[HeldParam]],
    *,
    timeout_s: float,
) -> dict[int, dict[tuple[str, str], list[Box]]]:
    """Per receiver, the pieces of ``version`` it already holds (asked all at once; a receiver
    that does not answer in time gets everything again). Receivers of one layout (replicas)
    get what all of them hold, so that they read the rest together, as one stream, again."""
    refs = {rid: call_hook(actor, sync_hooks.arrived_hook, sync_id, version) for rid, actor in receivers.items()}
    done, _late = calls.wait_all(list(refs.values()), timeout_s=timeout_s)
    answered = set(done)
    held: dict[int, set[tuple]] = {}
    for rid, ref in refs.items():
        outcome = calls.settle(ref, timeout_s=1.0) if ref in answered else None
        if outcome is None or not outcome.ok:
            logger.warning(
                "weight sync failover: receiver %d did not say what arrived (%s); it reads all again",
                rid,
                "no answer in time" if outcome is None else outcome.reason,
            )
            continue
        held[rid] = {(n, w, tuple(o), tuple(z)) for n, w, o, z in outcome.value}
    by_layout: dict[tuple[HeldParam, ...], set[tuple]] = {}
    for rid, pieces in held.items():
        key = tuple(layouts[rid])
        by_layout[key] = by_layout[key] & pieces if key in by_layout else set(pieces)
    result: dict[int, dict[tuple[str, str], list[Box]]] = {}
    for rid in held:
        boxes: dict[tuple[str, str], list[Box]] = {}
        for name, wire, offsets, sizes in by_layout[tuple(layouts[rid])]:
            boxes.setdefault((name, wire), []).append(Box(offsets, sizes))
        result[rid] = boxes
    return result


def count_lost(lost: dict[tuple[str, str], int], plan: Plan, dead: int, name: str) -> None:
    """One failover more on each (``name``, receiver) pair that ``plan`` had trainer ``dead`` serve."""
    for trainer, receiver in plan.pair_nbytes():
        if trainer == dead:
            key = (name, f"receiver {receiver}")
            lost[key] = lost.get(key, 0) + 1
