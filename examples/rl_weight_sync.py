"""Reinforcement learning with tensorwire: a learner trains a policy, rollout actors play
with the newest weights, pushed to them with ``tw.WeightSync`` after every update.

* Task: cart-pole balancing (the classic-control CartPole-v1 dynamics, written here in numpy,
  many episodes stepped at once per rollout actor). Reward: steps the pole stays up, at most 500.
* Learner: REINFORCE (policy gradient with normalised returns), Adam, a 4-64-64-2 network.
* Rollout actors return their episodes *by reference* (``@tw.method``); the learner's
  ``update`` receives the references and tensorwire moves the bytes.
* After each update ``sync.push()`` copies the learner's parameters into every rollout
  actor's own model, in place; the report says how long it took and over which transport.

Run: ``python examples/rl_weight_sync.py`` (about a minute on 2 CPU cores; uses a GPU when
the Ray cluster has one). The mean reward per iteration rises from about 20.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
from torch import nn

import tensorwire as tw

_MAX_STEPS = 500


class CartPoles:
    """``n`` cart-pole environments stepped together (CartPole-v1's equations and limits)."""

    gravity, cart_mass, pole_mass, half_length, force, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    x_limit, theta_limit = 2.4, 12 * 2 * math.pi / 360

    def __init__(self, n: int, rng: np.random.Generator) -> None:
        self.rng = rng
        self.state = rng.uniform(-0.05, 0.05, size=(n, 4))
        self.done = np.zeros(n, dtype=bool)
        self.steps = np.zeros(n, dtype=np.int64)

    def step(self, actions: np.ndarray) -> None:
        """Advance the environments still running; the others stay as they are."""
        x, x_dot, theta, theta_dot = self.state.T
        force = np.where(actions == 1, self.force, -self.force)
        total_mass = self.cart_mass + self.pole_mass
        polemass_length = self.pole_mass * self.half_length
        cos, sin = np.cos(theta), np.sin(theta)
        temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
        theta_acc = (self.gravity * sin - cos * temp) / (
            self.half_length * (4.0 / 3.0 - self.pole_mass * cos**2 / total_mass)
        )
        x_acc = temp - polemass_length * theta_acc * cos / total_mass
        tau = self.tau
        new = np.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot, theta_dot + tau * theta_acc], 1)
        running = ~self.done
        self.state[running] = new[running]
        self.steps += running
        fallen = (np.abs(self.state[:, 0]) > self.x_limit) | (np.abs(self.state[:, 2]) > self.theta_limit)
        self.done |= fallen | (self.steps >= _MAX_STEPS)


def policy_network() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))


def device_here() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


@tw.remote
class Rollout:
    """Plays episodes with its own copy of the policy (updated in place by WeightSync)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.device = device_here()
        self.model = policy_network().to(self.device)
        self.rng = np.random.default_rng(seed)

    @tw.method
    def collect(self, episodes: int, gamma: float) -> dict[str, torch.Tensor]:
        """Play ``episodes`` episodes; observations, actions and discounted returns of every step."""
        envs = CartPoles(episodes, self.rng)
        observations, actions, alive = [], [], []
        with torch.no_grad():
            while not envs.done.all():
                obs = torch.as_tensor(envs.state, dtype=torch.float32, device=self.device)
                logits = self.model(obs)
                action = torch.distributions.Categorical(logits=logits).sample()
                observations.append(obs)
                actions.append(action)
                alive.append(torch.as_tensor(~envs.done, device=self.device))
                envs.step(action.cpu().numpy())
        mask = torch.stack(alive)  # [steps, episodes]: the step counted (episode not over before it)
        rewards = mask.float()
        returns = torch.zeros_like(rewards)
        running = torch.zeros(episodes, device=self.device)
        for t in range(rewards.shape[0] - 1, -1, -1):
            running = rewards[t] + gamma * running
            returns[t] = running
        return {
            "obs": torch.stack(observations)[mask],
            "actions": torch.stack(actions)[mask],
            "returns": returns[mask],
            "episode_rewards": torch.as_tensor(envs.steps, dtype=torch.float32),
        }


@tw.remote
class Learner:
    """Owns the policy being trained; ``model`` is what WeightSync pushes."""

    def __init__(self, seed: int, lr: float) -> None:
        torch.manual_seed(seed)
        self.device = device_here()
        self.model = policy_network().to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def update(self, *batches: dict[str, torch.Tensor]) -> dict[str, float]:
        """One policy-gradient step on the episodes of every rollout actor (Refs resolved)."""
        obs = torch.cat([b["obs"] for b in batches]).to(self.device)
        actions = torch.cat([b["actions"] for b in batches]).to(self.device)
        returns = torch.cat([b["returns"] for b in batches]).to(self.device)
        rewards = torch.cat([b["episode_rewards"] for b in batches])
        advantage = (returns - returns.mean()) / (returns.std() + 1e-8)
        log_prob = torch.distributions.Categorical(logits=self.model(obs)).log_prob(actions)
        loss = -(log_prob * advantage).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"reward": rewards.mean().item(), "min": rewards.min().item(), "max": rewards.max().item()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--rollouts", type=int, default=2, help="rollout actors")
    parser.add_argument("--episodes", type=int, default=16, help="episodes per rollout actor per iteration")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true", help="checksum every weight sync")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tw.init(include_dashboard=False)
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    share = {"num_gpus": 1 / (args.rollouts + 1), "num_cpus": 0} if gpus >= 1 else {"num_cpus": 0}
    learner = Learner.options(**share).remote(args.seed, args.lr)
    rollouts = [Rollout.options(**share).remote(args.seed + 1 + i) for i in range(args.rollouts)]
    sync = tw.WeightSync(learner, rollouts, source="model", verify=args.verify, progress=False)
    first = sync.push()  # every actor starts from the learner's initial weights
    print(f"policy: {sync.nbytes / 1024:.1f} KiB; first sync: {first}")
    print(f"{'iter':>4} {'reward':>7} {'min':>5} {'max':>5} {'sync ms':>8}  transport")
    rewards = []
    start = time.perf_counter()
    for iteration in range(1, args.iterations + 1):
        batches = [r.collect.remote(args.episodes, args.gamma) for r in rollouts]
        stats = ray.get(learner.update.remote(*batches))
        report = sync.push()
        if not report.ok:
            print(f"weight sync failed: {report.failed}", file=sys.stderr)
            return 1
        transports = sorted({t for r in report.receivers.values() for t in r.transports})
        rewards.append(stats["reward"])
        print(
            f"{iteration:>4} {stats['reward']:>7.1f} {stats['min']:>5.0f} {stats['max']:>5.0f} "
            f"{report.seconds * 1e3:>8.2f}  {','.join(transports)}",
            flush=True,
        )
    elapsed = time.perf_counter() - start
    versions = sync.versions()
    head, tail = np.mean(rewards[: max(1, len(rewards) // 5)]), np.mean(rewards[-max(1, len(rewards) // 5) :])
    print(
        f"done in {elapsed:.1f} s: mean reward {head:.1f} in the first iterations -> {tail:.1f} in the last; "
        f"rollout actors hold weight version {versions}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
