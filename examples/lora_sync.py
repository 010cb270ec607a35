"""LoRA: sync the adapters only, swapped in atomically on every inference actor.

* A frozen base model (4 linear layers of 1024 x 1024, 16 MiB) with a rank-8 LoRA adapter
  on each layer (``lora_a`` 8 x 1024, ``lora_b`` 1024 x 8: 256 KiB in all). The learner
  trains the adapters only.
* The first push moves everything (base and adapters); after each step
  ``sync.push(names=adapters)`` moves the adapters only, as a new version of the whole model.
  The sync is all-or-none with ``publish="swap"``: each inference actor assembles the new
  adapters aside and swaps them in inside its fence, so a request sees the old adapters or
  the new ones, never a mix, on every actor.
* After every push each actor's output on a fixed input is checked against the learner's.

Run: ``python examples/lora_sync.py`` (CPU, no downloads; well under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch import nn

import tensorwire as tw

WIDTH, LAYERS, RANK = 1024, 4, 8


class LoraLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, WIDTH) / WIDTH**0.5)
        self.lora_b = nn.Parameter(torch.zeros(WIDTH, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T


def model() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(LoraLinear(), nn.Tanh()) for _ in range(LAYERS)))


@tw.remote(num_cpus=0)
class Learner:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = model()
        self.target = model()
        adapters = [p for n, p in self.model.named_parameters() if "lora_" in n]
        self.optimizer = torch.optim.Adam(adapters, lr=1e-3)

    def adapter_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters() if "lora_" in n]

    def step(self) -> float:
        x = torch.randn(64, WIDTH)
        with torch.no_grad():
            y = self.target(x)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    @torch.no_grad()
    def output(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@tw.remote(num_cpus=0)
class Server:
    def __init__(self) -> None:
        self.model = model()  # random until the first push

    @torch.no_grad()
    def output(self, x: torch.Tensor) -> torch.Tensor:
        with tw.collective.weight_fence("weights"):  # a request sees one version whole
            return self.model(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    tw.init(include_dashboard=False)
    learner, servers = Learner.remote(0), [Server.remote() for _ in range(2)]
    sync = tw.WeightSync(learner, servers, source="model", publish="swap", progress=False)
    adapters = ray.get(learner.adapter_names.remote())
    probe = torch.randn(4, WIDTH)

    def check(version: int) -> None:
        expected = ray.get(learner.output.remote(probe))
        for i, out in enumerate(ray.get([s.output.remote(probe) for s in servers])):
            if not torch.equal(out, expected):
                gap = (out - expected).abs().max()
                raise SystemExit(f"v{version}: server {i} differs from the learner by {gap:.2e}")

    full = sync.push()
    check(full.version)
    print(f"v{full.version}, everything: {full.moved_nbytes / 2**20:.2f} MiB in {full.seconds * 1e3:.1f} ms")
    times = []
    for step in range(1, args.steps + 1):
        loss = ray.get(learner.step.remote())
        report = sync.push(names=adapters)
        check(report.version)
        times.append(report.seconds)
        if step == 1 or step % 5 == 0:
            print(
                f"step {step:3d}  loss {loss:.4f}  v{report.version}, adapters only: "
                f"{report.moved_nbytes / 2**10:.0f} KiB in {report.seconds * 1e3:.1f} ms; servers match the learner"
            )
    again = sync.push()  # for comparison: everything again
    check(again.version)
    print(
        f"adapter push {statistics.median(times) * 1e3:.1f} ms (median) against a full push "
        f"{again.seconds * 1e3:.1f} ms; {again.moved_nbytes // max(1, report.moved_nbytes)}x fewer bytes"
    )
    print(f"done: {args.steps} adapter versions, swapped in whole on every server")
    sync.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
