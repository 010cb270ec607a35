"""Failover: a push whose trainer died or stalled completes from the trainers that are left.

When a trainer dies mid-push, or *stalls* (a receiver waited ``stall_s`` for its next bucket:
progress, not a total timeout), the receivers abort that attempt (all-or-none: every one keeps
the version it had; best effort: some hold part of it). If the surviving trainers still hold
every byte of every receiver's plan (data-parallel replicas, HSDP groups), the driver plans
again over them and pushes the same version once more, leaving out the pieces each receiver
already has (:func:`arrived`: they stay where the first try put them, in the shadows or the
tensors; :mod:`.arrivals`), so only the missing ranges are read again and the push completes
exact (:func:`fail_over`: the driver's step between two tries). The trainer that failed is out
of the sync from then on. Only when some range has no live source does the push fail (the
receivers stay where they were). :func:`two_sources` says whether any one trainer can be lost
so (what an in-place push needs).

A stalled trainer's call is left running (Ray cannot interrupt it); whatever it does later goes
to a push that is over and is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tensorwire.collectives.weight_sync.commit.state import PushState
from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import NameMap, Plan
from tensorwire.collectives.weight_sync.recovery.arrivals import arrived_hook
from tensorwire.errors import TrainerLost
from tensorwire.runtime.ray import calls
from tensorwire.runtime.ray.actor import ActorHandle
from tensorwire.runtime.ray.hooks import call_hook

__all__ = [
    "FailingOver",
    "arrived",
    "common_to_replicas",
    "count_lost",
    "drop_covered",
    "fail_over",
    "leave_out_unresponsive",
    "replan_without",
    "two_sources",
]

logger = logging.getLogger(__name__)


class FailingOver(Protocol):
    """What a failover reads and changes of its :class:`..sync.WeightSync`."""

    name: str
    plan: Plan
    state: PushState
    trainers: tuple[Any, ...]
    trainer_layouts: list[tuple[ParamPiece, ...]]

    @property
    def receiver_layouts(self) -> dict[int, tuple[ParamPiece, ...]]: ...

    def trainer_name(self, position: int) -> str: ...

    def drop_trainer(self, position: int, plan: Plan) -> None: ...

    def trainer_responds(self, position: int) -> bool: ...


def two_sources(sync: FailingOver, live: tuple[int, ...]) -> bool:
    """Whether every byte the ``live`` receivers get has a second trainer holding it: losing any
    one trainer leaves a plan (:func:`replan_without`), so an in-place version can always be
    completed."""
    receivers = {rid: sync.receiver_layouts[rid] for rid in live}
    return len(sync.trainers) > 1 and all(
        replan_without(i, sync.trainer_layouts, sync.plan.mapping, receivers)[0] is not None
        for i in range(len(sync.trainers))
    )


def fail_over(
    sync: FailingOver, error: TrainerLost, replaced: dict[str, str], lost: dict[tuple[str, str], int]
) -> TrainerLost | None:
    """Drop the trainer ``error`` names and plan over the others: None when they hold every
    live receiver's bytes (the caller tries again; ``replaced`` and ``lost`` say so); else the
    error to raise, saying why there is no failover."""
    dead = error.rank
    receivers = {rid: layout for rid, layout in sync.receiver_layouts.items() if rid not in sync.state.dead}
    plan, why = replan_without(dead, sync.trainer_layouts, sync.plan.mapping, receivers)
    if plan is None:
        kept = "the receivers keep the version they had"
        if sync.state.promised:
            kept = "receivers that wrote part of it are torn (-1) till the next push"
        return TrainerLost(dead, f"{error.why}; no failover: {why}; {kept}", report=error.report)
    logger.warning("weight sync %s: %s; pushing the rest from the others", sync.name, error.why)
    _drop(sync, dead, plan, error.why, replaced=replaced, lost=lost)
    return None


def drop_covered(
    sync: FailingOver, name: str, why: str, replaced: dict[str, str], lost: dict[tuple[str, str], int]
) -> None:
    """After a try that a cover completed (:mod:`.cover`): trainer ``name`` is out of the sync,
    as after a failover (``replaced`` and ``lost`` say so)."""
    dead = [sync.trainer_name(i) for i in range(len(sync.trainers))].index(name)
    receivers = {rid: layout for rid, layout in sync.receiver_layouts.items() if rid not in sync.state.dead}
    plan, _why = replan_without(dead, sync.trainer_layouts, sync.plan.mapping, receivers)
    replaced[name] = why
    if plan is not None:  # (else the next push's look drops it, or says why it cannot)
        _drop(sync, dead, plan, why, replaced=replaced, lost=lost)


def _drop(
    sync: FailingOver, dead: int, plan: Plan, why: str, *, replaced: dict[str, str], lost: dict[tuple[str, str], int]
) -> None:
    name = sync.trainer_name(dead)
    replaced[name] = why
    count_lost(lost, sync.plan, dead, name)
    sync.drop_trainer(dead, plan)  # staging and shadows stay: the next try reuses them


def replan_without(
    dead: int,
    trainer_layouts: Sequence[Sequence[ParamPiece]],
    mapping: NameMap,
    receiver_layouts: Mapping[int, Sequence[ParamPiece]],
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
    receivers: Mapping[int, ActorHandle],
    layouts: Mapping[int, Sequence[ParamPiece]],
    *,
    timeout_s: float,
) -> dict[int, dict[tuple[str, str], list[Box]]]:
    """Per receiver, the pieces of ``version`` it already holds (asked all at once; a receiver
    that does not answer in time gets everything again). Receivers of one layout (replicas)
    get what all of them hold, so that they read the rest together, as one stream, again."""
    refs = {rid: call_hook(actor, arrived_hook, sync_id, version) for rid, actor in receivers.items()}
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
    return common_to_replicas(held, layouts)


def common_to_replicas(
    held: Mapping[int, set[tuple]], layouts: Mapping[int, Sequence[ParamPiece]]
) -> dict[int, dict[tuple[str, str], list[Box]]]:
    """Per receiver, the pieces it can skip: of those it holds (``held``: (parameter, wire
    dtype, offsets, sizes)), the ones every receiver of its layout holds too (replicas read
    the rest together, as one stream)."""
    by_layout: dict[tuple[ParamPiece, ...], set[tuple]] = {}
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


def leave_out_unresponsive(
    sync: FailingOver, version: int, replaced: dict[str, str], lost: dict[tuple[str, str], int]
) -> TrainerLost | None:
    """Before a push: leave out every trainer that died or stopped since the last one (a look
    at each, not a failed first try), when the others hold its bytes; else the error to raise."""
    while True:
        gone = next((i for i in range(len(sync.trainers)) if not sync.trainer_responds(i)), None)
        if gone is None:
            return None
        who = f"{sync.trainer_name(gone)} ({sync.trainers[gone]!r})"
        why = f"weight sync v{version}: {who} was dead or stopped when the push began"
        refused = fail_over(sync, TrainerLost(gone, why), replaced, lost)
        if refused is not None:
            return refused
