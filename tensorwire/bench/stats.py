"""Statistics of timed transfers, the way nccl-tests and ucx_perftest report them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Summary",
    "bus_bandwidth",
    "fit_latency_bandwidth",
    "gbps",
    "parse_size",
    "percentile",
    "sizes",
    "summarize",
]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default method). Raises ``ValueError`` for no samples or q outside 0..100."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not between 0 and 100")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    """Seconds per transfer: median, 99th percentile, mean, and how many samples."""

    p50: float
    p99: float
    mean: float
    count: int


def summarize(samples: Sequence[float]) -> Summary:
    return Summary(percentile(samples, 50), percentile(samples, 99), sum(samples) / len(samples), len(samples))


def gbps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes per second), as nccl-tests' ``algbw``."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def bus_bandwidth(operation: str, algbw: float, ranks: int) -> float:
    """nccl-tests' ``busbw``: the algorithm bandwidth scaled so that it compares with the
    hardware's link bandwidth whatever the number of ranks.

    all_reduce: 2(n-1)/n; all_gather and reduce_scatter: (n-1)/n; broadcast, send/recv and
    point-to-point: 1. ``one_to_n`` (one sender, n-1 receivers each getting the whole
    value, as weight sync): n-1, the bytes delivered per second.
    """
    if ranks < 1:
        raise ValueError("ranks must be at least 1")
    factors = {
        "all_reduce": 2 * (ranks - 1) / ranks,
        "all_gather": (ranks - 1) / ranks,
        "reduce_scatter": (ranks - 1) / ranks,
        "broadcast": 1.0,
        "p2p": 1.0,
        "one_to_n": float(ranks - 1),
    }
    if operation not in factors:
        raise ValueError(f"unknown operation {operation!r}; one of {sorted(factors)}")
    return algbw * factors[operation]


def fit_latency_bandwidth(nbytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``seconds = latency + nbytes / bandwidth``: (latency in seconds,
    bandwidth in GB/s). The fixed cost per transfer and the asymptotic rate, separated.
    Needs two distinct sizes; a non-positive slope gives an infinite bandwidth."""
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError("a fit needs times at two or more distinct sizes")
    n = len(nbytes)
    mean_x, mean_y = sum(nbytes) / n, sum(seconds) / n
    sxx = sum((x - mean_x) ** 2 for x in nbytes)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(nbytes, seconds, strict=True))
    slope = sxy / sxx
    latency = mean_y - slope * mean_x
    return latency, (1 / slope / 1e9 if slope > 0 else math.inf)


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"64M"``, ``"1G"``, ``"1000"`` (binary units, as nccl-tests)."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
    number = text[: len(text) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 4K, 64M, 1G)") from None
    if value < 1 or value != int(value):
        raise ValueError(f"size {text!r} must be a whole number of bytes, at least 1")
    return int(value)


def sizes(minimum: int, maximum: int, factor: float) -> list[int]:
    """``minimum``, ``minimum * factor``, ... up to ``maximum`` (included when it falls on the
    series; the last size is always ``maximum``)."""
    if minimum < 1 or maximum < minimum:
        raise ValueError("sizes need 1 <= min <= max")
    if factor <= 1 and minimum != maximum:
        raise ValueError("the size factor must be above 1")
    result = [minimum]
    while result[-1] * factor < maximum:
        result.append(int(result[-1] * factor))
    if result[-1] != maximum:
        result.append(maximum)
    return result
