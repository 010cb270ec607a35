"""Ray's own idioms on tensorwire actors: the code you write for Ray, tensors by reference.

A named trainer found with ``ray.get_actor``, ``ray.get`` / ``ray.wait`` on references,
Ray direct transport's per-call ``tensor_transport`` option, a producer waiting until its
consumers let go of a buffer before overwriting it, and ``ray.kill``. Runs on a CPU-only
machine: ``python examples/ray_idioms.py``.
"""

from __future__ import annotations

import os

import ray
import torch

import tensorwire as tw


@tw.remote(num_cpus=0, max_concurrency=2)
class Trainer:
    def __init__(self) -> None:
        self.buffer = torch.zeros(1 << 20)  # 4 MiB, reused every step

    @tw.method  # returns by reference (Ray direct transport: @ray.method(tensor_transport=...))
    def step(self, value: float) -> torch.Tensor:
        tw.wait_tensor_freed(self.buffer, timeout_s=60)  # nobody still reads the last step's buffer
        self.buffer.fill_(value)
        return self.buffer

    def stats(self) -> dict[str, float]:  # a plain method: by reference only when asked per call
        return {"mean": float(self.buffer.mean()), "norm": float(self.buffer.norm())}


@tw.remote(num_cpus=0)
class Rollout:
    def total(self, weights: torch.Tensor) -> float:  # the reference arrives as a tensor
        return float(weights.sum())


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tw.init(include_dashboard=False)
    owner = Trainer.options(name="trainer", get_if_exists=True).remote()  # keep it: the actor lives while it does
    trainer = ray.get_actor("trainer")  # Ray's own handle: @tw.method calls still return by reference
    rollout = Rollout.remote()

    ref = trainer.step.remote(1.0)
    print(f"Ray's own reference, tensor transport {ref.tensor_transport()}")
    ready, _ = ray.wait([ref], timeout=60)
    print(f"rollout saw sum {ray.get(rollout.total.remote(ref)):.0f}")
    value = ray.get(ref)  # the bytes move straight into the driver
    print(f"driver got {value.numel()} floats via {tw.stats()['recent'][-1].transport}; ready: {ready == [ref]}")
    del ref, ready, value  # let go of step 1 (every copy of the reference): the next step may overwrite the buffer

    ref = trainer.step.remote(2.0)
    print(f"step 2 sum {ray.get(rollout.total.remote(ref)):.0f}")
    stats = tw.get(tw.get_actor("trainer").stats.options(tensor_transport="auto").remote())
    print(f"stats by reference: mean {stats['mean']:.1f}")
    ray.kill(owner)
    ray.shutdown()


if __name__ == "__main__":
    main()
