"""The driver's version state (commit/state.py) and the typed error of a lost trainer."""

from __future__ import annotations

import pickle

import pytest

import tensorwire as tw
from tensorwire.collectives.weight_sync.commit.state import Phase, PushState


def test_a_push_moves_through_its_phases_and_commits_only_when_told():
    state = PushState()
    assert (state.version, state.committed, state.phase) == (0, 0, Phase.IDLE)
    assert state.start() == 1 and state.phase is Phase.PUSHING and not state.promised
    state.promise()
    assert state.promised
    state.first_try()  # a new first try (a catch-up, say) promises nothing yet
    assert not state.promised
    state.finish(committed=True)
    assert (state.version, state.committed, state.phase) == (1, 1, Phase.IDLE)
    assert state.start() == 2
    state.finish(committed=False)  # a failed push: the receivers keep version 1
    assert (state.version, state.committed, state.phase) == (2, 1, Phase.IDLE)


def test_a_lost_trainer_travels_typed_with_its_rank_why_and_report():
    report = {"failed": {0: "not committed"}}
    error = tw.TrainerLost(3, "trainer 3 stalled", report=report)
    assert isinstance(error, tw.TensorwireError) and str(error) == "trainer 3 stalled"
    back = pickle.loads(pickle.dumps(error))  # raised in an actor, it reaches the driver pickled
    assert type(back) is tw.TrainerLost
    assert (back.rank, back.why, back.report) == (3, "trainer 3 stalled", report)
    with pytest.raises(tw.TensorwireError, match="stalled"):
        raise back
