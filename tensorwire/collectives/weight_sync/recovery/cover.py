"""A cover: the lost trainer's share read from the others while the try that lost it runs.

When a trainer dies or stalls in an all-or-none push assembled aside (the default), the try
goes on: its other streams keep running, and the driver at once starts a *cover*
(:func:`start`): the trainers left serve, on a channel of their own and in their hook group
(beside the try's ``send``), every piece the lost trainer was to send, planned over them as a
failover would (:func:`.failover.replan_without`); each receiver that gets some of it reads it
into the same shadows (:func:`..members.receiver.cover_read`). A receiver of the try that lost
the trainer waits, once its other streams are in, for the cover (:mod:`.covered`), then votes;
the version commits in the one try, and the lost trainer is out of the sync from then on. No
second try, and no wait for the try's healthy streams to end before the missing bytes move.

A cover is one per try. A second loss, a cover that fails, or a plan with no other source for
some byte aborts the try as before; the driver then fails over between two tries
(:mod:`.failover`), and what the cover delivered counts as arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from tensorwire.collectives.weight_sync.members import receiver, trainer
from tensorwire.collectives.weight_sync.planning import subsets
from tensorwire.collectives.weight_sync.planning.layout import ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import Arrived, Plan
from tensorwire.collectives.weight_sync.planning.subsets import Subset
from tensorwire.collectives.weight_sync.protocol.assign import SyncSettings, member_specs
from tensorwire.collectives.weight_sync.recovery.failover import replan_without
from tensorwire.runtime.ray.hooks import call_hook_concurrently

__all__ = ["COVER_STREAMS", "Cover", "not_from", "start"]

logger = logging.getLogger(__name__)

COVER_STREAMS = 1 << 20  # a cover's stream ids start here: its staging is apart from the try's


class Cover(NamedTuple):
    """A running cover of the try's trainer ``lost`` (its position): its calls (call -> who),
    the channel, and the survivors' positions in channel-rank order."""

    lost: int
    why: str
    calls: dict[Any, str]
    channel: str
    survivors: tuple[int, ...]


class _Survivors:
    """The sync as a cover's setup sees it: the trainers but ``lost``, planned over them."""

    def __init__(self, sync: SyncSettings, lost: int, plan: Plan) -> None:
        self._sync = sync
        keep = [i for i in range(len(sync.trainers)) if i != lost]
        self.trainers = tuple(sync.trainers[i] for i in keep)
        self.trainer_layouts = [sync.trainer_layouts[i] for i in keep]
        self.trainer_descriptions = [sync.trainer_descriptions[i] for i in keep]
        self.plan = plan

    def __getattr__(self, name: str) -> Any:  # every other setting is the sync's
        return getattr(self._sync, name)


def start(
    sync: SyncSettings,
    live: tuple[int, ...],
    version: int,
    lost: int,
    why: str,
    *,
    actors: Mapping[int, Any],
    channel: str,
    of_try: str,
    have: Mapping[int, Arrived] | None,
    only: Subset | None,
) -> Cover | None:
    """Start the cover of trainer ``lost`` (its position in the try) for the ``live``
    receivers (``actors``: by id) of push ``version`` (``have``: what the try leaves out
    already; ``only``: a subset push's receiver parameters), on ``channel``; None when the
    others do not hold all of its bytes (the try, on channel ``of_try``, is then aborted as
    before)."""
    layouts: dict[int, tuple[ParamPiece, ...]] = {r: sync.receiver_layouts[r] for r in live}
    plan, reason = replan_without(lost, sync.trainer_layouts, sync.plan.mapping, layouts)
    if plan is None:
        logger.info("weight sync %s: no cover for trainer %d: %s", sync.name, lost, reason)
        return None
    held = subsets.merged(not_from(sync.plan, lost, live), have)
    if only is not None:  # (what a subset push leaves out is not read either)
        held = subsets.merged(held, subsets.left_out(sync.plan, only))
    view: Any = _Survivors(sync, lost, plan)
    blobs, roles, _buckets = member_specs(view, live, held, in_place=False, only=only, first_stream=COVER_STREAMS)
    m = len(view.trainers)
    survivors = tuple(i for i in range(len(sync.trainers)) if i != lost)
    calls: dict[Any, str] = {}
    for j, position in enumerate(survivors):
        if roles[j]:
            ref = call_hook_concurrently(sync.trainers[position], trainer.send, blobs[j], version, channel)
            calls[ref] = f"the cover send of trainer {position}"
    for i, rid in enumerate(live):
        if roles[m + i]:
            ref = call_hook_concurrently(
                actors[rid], receiver.cover_read, blobs[m + i], version, channel, of_try, (lost,)
            )
            calls[ref] = f"the cover read of receiver {rid}"
    logger.warning("weight sync %s: %s; its share is read from the others while the push runs", sync.name, why)
    return Cover(lost, why, calls, channel, survivors)


def not_from(plan: Plan, lost: int, live: tuple[int, ...]) -> dict[int, Arrived]:
    """Per live receiver, the pieces ``plan`` has other trainers than ``lost`` send (as pieces it
    holds: the cover reads the rest)."""
    return subsets.held_where(plan, live, lambda _r, t: t.trainer != lost)
