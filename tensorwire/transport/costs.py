"""Where a transport serves and what it costs there: memory kinds, placements, cost models.

A transport declares its default :class:`CostModel` (``cost_model``); the selector ranks by it
until ``tensorwire bench --calibrate`` measured this machine. :mod:`tensorwire.transport.contract`
re-exports every name here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["CostEstimate", "CostModel", "MemoryKind", "Placement"]


class MemoryKind(enum.Enum):
    """Where the bytes of a tensor live."""

    HOST = "host"
    CUDA = "cuda"


class Placement(enum.Enum):
    """Where the consumer is, seen from the producer."""

    SAME_PROCESS = "same process"
    SAME_NODE = "same node"
    CROSS_NODE = "cross node"


@dataclass(frozen=True)
class CostEstimate:
    """Fixed cost per transfer and sustained bandwidth of one transport."""

    fixed_us: float
    bandwidth_gbps: float  # GB/s (1e9 bytes per second)

    def seconds(self, nbytes: int) -> float:
        return self.fixed_us * 1e-6 + nbytes / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class CostModel:
    """A transport's default costs: fixed µs and GB/s per placement and memory kind.

    ``entries`` are (placement, memory kind, cost); :meth:`estimate` looks up the placement
    and the object's memory kinds (the slowest of them), falling back to the placement's
    entry for any memory kind (staged transports), then to ``default``. Calibrated numbers
    (``tensorwire bench --calibrate``) replace the whole model of a transport.
    """

    default: CostEstimate
    entries: tuple[tuple[Placement, MemoryKind, CostEstimate], ...] = ()

    @classmethod
    def uniform(cls, fixed_us: float, bandwidth_gbps: float) -> CostModel:
        """The same cost wherever the transport serves."""
        return cls(CostEstimate(fixed_us, bandwidth_gbps))

    def estimate(self, placement: Placement, memory: frozenset[MemoryKind]) -> CostEstimate:
        """The cost of moving an object of ``memory`` kinds to a consumer at ``placement``."""
        found = []
        for kind in sorted(memory, key=lambda m: m.value) or [MemoryKind.HOST]:
            exact = [c for p, m, c in self.entries if p is placement and m is kind]
            any_kind = [c for p, _m, c in self.entries if p is placement]
            found.append((exact or any_kind or [self.default])[0])
        return max(found, key=lambda c: (c.fixed_us, -c.bandwidth_gbps)) if len(found) > 1 else found[0]
