"""tensorwire as a Ray tensor transport: Ray's own decorators, one string changed.

A trainer actor returns its state dict with ``@ray.method(tensor_transport="tensorwire")``; a
rollout actor loads it; the driver reads it too. Runs on a CPU-only machine:
``python examples/ray_transport.py``.
"""

from __future__ import annotations

import ray
import torch

import tensorwire as tw  # after ray: registers tensor_transport="tensorwire" with Ray


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 256))

    @ray.method(tensor_transport="tensorwire")  # with Ray's own transports: "nixl" or "gloo"
    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.parameters()))


@ray.remote(num_cpus=0, enable_tensor_transport=True)  # receivers of RDT objects need it (Ray's rule)
class Rollout:
    def __init__(self) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 256))

    def load(self, state_dict: dict[str, torch.Tensor]) -> float:
        self.model.load_state_dict(state_dict)
        return float(sum(p.double().sum() for p in self.model.parameters()))

    def how(self) -> str:
        record = tw.stats()["recent"][-1]
        return f"{record.transport} ({record.reason})"


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False)
    trainer, rollout = Trainer.remote(), Rollout.remote()
    ref = trainer.weights.remote()  # a plain ray.ObjectRef
    expected = ray.get(trainer.checksum.remote())
    loaded = ray.get(rollout.load.remote(ref))
    print(f"rollout loaded the trainer's weights: {abs(loaded - expected) < 1e-6}")
    print(f"moved by: {ray.get(rollout.how.remote())}")
    in_driver = ray.get(ref)
    print(f"driver got {len(in_driver)} tensors; first {tuple(next(iter(in_driver.values())).shape)}")
    print(f"reference transport: {ref.tensor_transport()}")
    ray.shutdown()


if __name__ == "__main__":
    main()
