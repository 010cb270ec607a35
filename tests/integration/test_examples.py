"""The examples run as users run them (separate processes, their own Ray instance)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TENSORWIRE_HOST": "127.0.0.1"}
    for key in ("TENSORWIRE_NODE_ID", "TENSORWIRE_CLUSTER_TOKEN", "RAY_ADDRESS"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_quickstart():
    out = run_example("quickstart.py")
    assert "checksum trainer" in out and ": OK" in out
    assert "transport: shm" in out


def test_standalone():
    out = run_example("standalone.py")
    assert "via shm" in out and "sum matches" in out


def test_rl_weight_sync_learns_and_syncs_every_iteration():
    out = run_example("rl_weight_sync.py", "--iterations", "12", "--verify")
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 6]
    assert [int(r[0]) for r in rows] == list(range(1, 13))
    rewards = [float(r[1]) for r in rows]
    assert sum(rewards[-3:]) > 2 * sum(rewards[:3]), rewards  # the policy learns
    # 18 KiB, read in place (small enough to travel inside the bucket's message: inline) or, where
    # this machine's process_vm_readv is slow, from the learner's staging ring (shm)
    assert all(r[5] in ("inline", "shm") for r in rows), rows
    assert "hold weight version [13, 13]" in out  # the first push, then one per iteration


def test_rl_fleet_fails_over_takes_a_late_joiner_and_tags_rollouts_with_the_committed_version():
    out = run_example("rl_fleet.py")
    assert "push v2: on every replica" in out and "trainer 2 died mid-push" in out  # failover
    assert "completed from its replica" in out and "from trainer 0, trainer 1, trainer 3" in out
    assert "a new replica joined at v2, copied from receiver" in out  # from a peer, not the trainers
    assert "rollouts (version, score): (v3," in out and out.count("(v3,") == 4
    assert "done: every replica at v3 = the trainers' model" in out


def test_ray_idioms():
    out = run_example("ray_idioms.py")
    assert "Ray's own reference, tensor transport TENSORWIRE" in out
    assert "rollout saw sum 1048576" in out and "step 2 sum 2097152" in out  # the buffer was reused after release
    assert "driver got 1048576 floats via shm; ready: True" in out and "stats by reference: mean 2.0" in out


def test_ray_transport():
    out = run_example("ray_transport.py")
    assert "rollout loaded the trainer's weights: True" in out
    assert "moved by: shm (same node" in out  # 4 MiB between two processes of one node
    assert "driver got 4 tensors; first (1024, 1024)" in out and "reference transport: TENSORWIRE" in out


def test_overlap_training_pushes_each_version_while_the_next_step_trains():
    out = run_example("overlap_training.py", "--iterations", "3")
    assert "step with a push in flight:" in out and "the push overlapped with the next step:" in out
    assert "done: 6 versions, each on every server as the learner had it after its step" in out


def test_lora_sync_moves_the_adapters_only_and_every_server_matches():
    out = run_example("lora_sync.py", "--steps", "5")
    assert "v1, everything: 32.53 MiB" in out  # base and adapters, 2 servers
    assert out.count("adapters only: 512 KiB") == 2  # steps 1 and 5: 256 KiB of adapters to each server
    assert "done: 5 adapter versions, swapped in whole on every server" in out
