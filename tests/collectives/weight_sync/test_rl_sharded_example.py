"""examples/rl_sharded_sync.py runs as users run it: 2 trainer halves -> 2 replicas x TP 2,
every replica equal to the trainers' model after every push, the loss going down."""

from __future__ import annotations

import re

from tests.integration.test_examples import run_example


def test_rl_sharded_sync_replicas_match_the_trainers_after_every_push():
    out = run_example("rl_sharded_sync.py", "--steps", "10")
    assert "2 trainer(s) -> 4 receiver(s)" in out
    assert "done: 10 pushes, every replica matched the trainers' model after each" in out
    pushes = re.findall(r"push v\d+: (\d+) KiB \(plan (\d+) KiB\)", out)
    assert pushes and all(moved == plan for moved, plan in pushes)  # exactly the plan's bytes, every push
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[-1] < losses[0] * 0.6, losses
