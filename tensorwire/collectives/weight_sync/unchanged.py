"""``skip_unchanged=True``: buckets whose bytes did not change since the last version every
receiver committed are not sent again.

Before each whole push the trainers checksum every bucket they would serve
(:func:`..members.trainer.bucket_checksums`: one pass over their bytes, the same checksum as
``verify``). A bucket whose checksum equals the one it had in the last version that every live
receiver committed, in the same buckets (the same receivers and plan: :attr:`Record.key`), is
planned as pieces the receivers hold already (the ``have`` of a failover's try), so nothing of
it moves: what a receiver holds for it is that version's bytes (its shadow, published by copy,
or its tensors in place). The record is kept only after a push every live receiver committed;
any other outcome, and ``publish="swap"`` (whose shadows hold the version before), push all.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from tensorwire.collectives.weight_sync.members import trainer
from tensorwire.collectives.weight_sync.planning.layout import Box
from tensorwire.collectives.weight_sync.planning.plan import Arrived
from tensorwire.runtime.ray import calls
from tensorwire.runtime.ray.hooks import call_hook, call_hook_concurrently

__all__ = ["Record", "checksums", "held_pieces"]

logger = logging.getLogger(__name__)

Sums = dict[tuple[int, int, int], int]  # (trainer rank, stream, bucket level) -> checksum


class Record(NamedTuple):
    """The bucket checksums of the last version every live receiver committed."""

    key: Any  # the setup they are of (the receivers, the plan, the trainers)
    sums: Sums


def checksums(sync: Any, prepared: Any, version: int) -> Sums | None:
    """Every trainer's bucket checksums for this push; None when one could not say (the push
    then sends everything, and fails over or fails as it would)."""
    call = call_hook_concurrently if sync.overlapped else call_hook
    refs = [call(t, trainer.bucket_checksums, prepared.blobs[i], version) for i, t in enumerate(sync.trainers)]
    sums: Sums = {}
    for rank, ref in enumerate(refs):
        outcome = calls.settle(ref, timeout_s=sync.timeout_s)
        if not outcome.ok:
            logger.info(
                "weight sync %s: no checksums from trainer %d (%s): pushing all", sync.name, rank, outcome.reason
            )
            return None
        sums.update({(rank, stream, k): value for (stream, k), value in outcome.value.items()})
    return sums


def held_pieces(
    sync: Any, live: tuple[int, ...], prepared: Any, sums: Sums | None, *, record: Record | None, key: Any
) -> dict[int, Arrived] | None:
    """Per live receiver, the pieces of the buckets that did not change since ``record`` (None:
    nothing to skip); ``key``: this push's setup (its receivers, plan and trainers)."""
    if sums is None or record is None or record.key != key:
        return None
    same = {(stream, k) for (_rank, stream, k), value in sums.items() if record.sums.get((_rank, stream, k)) == value}
    if not same:
        return None
    m, have = len(sync.trainers), {}
    for j, rid in enumerate(live):
        layout = sync.receiver_layouts[rid]
        held: dict[tuple[str, str], list[Box]] = {}
        for role in prepared.roles[m + j]:
            for k, bucket in enumerate(role.buckets):
                if (role.stream, k) in same:
                    for region in bucket:
                        held.setdefault((layout[region.param].name, region.wire_dtype), []).append(region.box)
        have[rid] = held
    return have
