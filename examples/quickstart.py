"""Quickstart: a trainer actor hands its weights to a rollout actor by reference.

Only a small reference travels through Ray; the bytes move once, directly from the trainer's
process to the rollout's (shared memory on one node, a direct stream across nodes, CUDA
paths when GPUs are present). Runs on a CPU-only machine: ``python examples/quickstart.py``.
"""

from __future__ import annotations

import hashlib
import os
import time

import ray
import torch

import tensorwire as tw

USE_GPU = torch.cuda.is_available()
DEVICE = "cuda" if USE_GPU else "cpu"


def checksum(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(16)]  # about 64 MiB of float32 weights
    return torch.nn.Sequential(*layers).to(DEVICE)


@tw.remote(num_cpus=0, num_gpus=0.5 if USE_GPU else 0)
class Trainer:
    def __init__(self) -> None:
        self.model = build_model()

    def train_step(self) -> str:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        return checksum(self.model.state_dict())

    @tw.method
    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


@tw.remote(num_cpus=0, num_gpus=0.5 if USE_GPU else 0)
class Rollout:
    def __init__(self) -> None:
        self.model = build_model()
        torch.nn.init.zeros_(self.model[0].weight)

    def load(self, state_dict: dict[str, torch.Tensor]) -> str:
        self.model.load_state_dict(state_dict)  # the Ref arrived as tensors on this actor's device
        return tw.stats()["recent"][-1].transport

    def checksum(self) -> str:
        return checksum(self.model.state_dict())


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tw.init(include_dashboard=False)
    trainer, rollout = Trainer.remote(), Rollout.remote()
    expected = ray.get(trainer.train_step.remote())

    ray.get(rollout.load.remote(trainer.weights.remote()))  # warm-up: both workers' agents start
    start = time.perf_counter()
    ref = trainer.weights.remote()  # Ray's ObjectRef: only metadata goes through Ray
    transport = ray.get(rollout.load.remote(ref))  # bytes move trainer -> rollout directly
    elapsed_ms = (time.perf_counter() - start) * 1e3
    received = ray.get(rollout.checksum.remote())

    print(f"transport: {transport}; call + transfer + load_state_dict: {elapsed_ms:.1f} ms")
    print(f"checksum trainer {expected} rollout {received}: {'OK' if expected == received else 'MISMATCH'}")
    if expected != received:
        raise SystemExit(1)
    driver_copy = ray.get(ref)  # the driver can fetch it too: Ray's own ray.get, bytes moved directly
    nbytes = sum(t.numel() * t.element_size() for t in driver_copy.values())
    print(f"state dict: {len(driver_copy)} tensors, {nbytes / 2**20:.1f} MiB on {DEVICE}")
    print(f"driver fetched {len(driver_copy)} tensors via {tw.stats()['recent'][-1].transport}")
    ray.shutdown()


if __name__ == "__main__":
    main()
