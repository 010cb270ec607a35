"""A cover's bookkeeping without Ray: what the try's reading waits for (the lost trainers'
shares read by a cover), what ends that wait (a failed cover, the driver's abort, the deadline),
and which pieces a cover leaves to the try (those other trainers send)."""

from __future__ import annotations

import threading
import time

import pytest

from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece
from tensorwire.collectives.weight_sync.planning.plan import Plan
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec
from tensorwire.collectives.weight_sync.recovery import covered
from tensorwire.collectives.weight_sync.recovery.cover import not_from
from tensorwire.errors import TrainerLost


def _spec(version: int, channel: str = "try-1", sync_id: str = "cover-test") -> PushSpec:
    return PushSpec(sync_id, "cover-test", version, channel, (), 0, None, (), (), False, "", 1.0)


def _never_aborted() -> None:
    return None


@pytest.fixture(autouse=True)
def _forget():
    yield
    covered.release("cover-test")


def test_the_wait_ends_once_every_lost_trainer_is_covered():
    spec = _spec(3)
    lost = {1: TrainerLost(1, "died"), 2: TrainerLost(2, "stalled")}
    covered.began("cover-test", spec.channel, (1,))
    covered.ended("cover-test", spec.channel, (1,))
    covered.began("cover-test", spec.channel, (2,))
    with pytest.raises(TrainerLost, match="no cover read its share in time"):  # trainer 2's still reads
        covered.wait(spec, lost, aborted=_never_aborted, deadline=time.monotonic() + 0.05)
    ended = threading.Thread(target=covered.ended, args=("cover-test", spec.channel, (2,)))
    ended.start()
    covered.wait(spec, lost, aborted=_never_aborted, deadline=time.monotonic() + 60)
    ended.join()


def test_a_failed_cover_a_driver_abort_or_the_deadline_end_the_wait_with_the_loss():
    spec = _spec(4)
    lost = {1: TrainerLost(1, "trainer member 1 died")}
    covered.began("cover-test", spec.channel, (1,))
    with pytest.raises(TrainerLost, match="no cover read its share in time") as late:
        covered.wait(spec, lost, aborted=_never_aborted, deadline=time.monotonic() + 0.05)
    assert late.value.rank == 1

    def aborted() -> None:
        raise RuntimeError("the push was aborted")

    with pytest.raises(TrainerLost, match="trainer member 1 died"):
        covered.wait(spec, lost, aborted=aborted, deadline=time.monotonic() + 30)
    covered.ended("cover-test", spec.channel, (1,), "TrainerLost: trainer member 0 died too")
    with pytest.raises(TrainerLost, match="reading its share from the others failed: TrainerLost: trainer member 0"):
        covered.wait(spec, lost, aborted=_never_aborted, deadline=time.monotonic() + 30)


def test_only_a_trainer_being_covered_stops_the_waits_on_it_and_only_in_its_try():
    first = _spec(5, channel="try-1")
    covered.began("cover-test", "try-1", (1,))
    with pytest.raises(TrainerLost, match="the others read its share"):
        covered.check(first, 1)
    covered.check(first, 0)  # another trainer: go on waiting for it
    # the failover's next try of the same version numbers the trainers left anew: its rank 1 is
    # another trainer, and the first try's cover (ended) says nothing about it
    covered.ended("cover-test", "try-1", (1,))
    second = _spec(5, channel="try-2")
    covered.check(second, 1)
    with pytest.raises(TrainerLost, match="no cover read its share in time"):
        covered.wait(second, {1: TrainerLost(1, "died")}, aborted=_never_aborted, deadline=time.monotonic() + 0.05)
    covered.began("cover-test", "try-2", (0,))  # a later try's cover forgets the earlier's
    covered.check(first, 1)


def test_a_cover_reads_what_the_lost_trainer_was_to_send_and_no_more():
    layout = [ParamPiece(name, (8, 4), "float32", Box.full((8, 4)), None) for name in ("a", "b", "c", "d")]
    plan = Plan([layout, layout])  # replicas
    plan.add_receiver(0, layout)
    plan.add_receiver(1, layout)
    kept = not_from(plan, 1, (0, 1))
    served_by_1 = {(t.target, t.dst) for t in plan.receivers[0] if t.trainer == 1}
    assert served_by_1  # both replicas serve
    survivors = Plan([layout])
    survivors.add_receiver(0, layout)
    survivors.add_receiver(1, layout)
    for r in (0, 1):
        read = {(t.target, t.dst) for s in survivors.streams([r], 1 << 20, kept) for t in s.transfers[r]}
        assert read == served_by_1
