"""A Ray actor restarted after a crash gets a fresh agent: old refs fail cleanly, new ones work."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

import tensorwire as tw
from tests.helpers.tasks import digest
from tests.integration.actors import Consumer, Restartable


def test_restarted_actor_old_refs_fail_new_refs_work(ray_local):
    actor = Restartable.remote()
    consumer = Consumer.remote()
    pid, agent_id = ray.get(actor.identity.remote())
    old = actor.tensor.remote(1 << 20, 1)
    assert digest(tw.get(old)) == digest(torch.full((1 << 20,), 1, dtype=torch.uint8))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        try:
            new_pid, new_agent = ray.get(actor.identity.remote(), timeout=10)
            break
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert new_pid != pid and new_agent != agent_id
    with pytest.raises(tw.OwnerDiedError):
        tw.get(old, timeout_s=20)
    assert ray.get(consumer.fetch_error.remote({"ref": tw.passthrough(old)})) == "OwnerDiedError"
    new = actor.tensor.remote(1 << 20, 2)
    expected = digest(torch.full((1 << 20,), 2, dtype=torch.uint8))
    assert digest(tw.get(new)) == expected
    assert ray.get(consumer.digest.remote(new)) == expected
