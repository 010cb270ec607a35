"""What ``tensorwire bench`` measures: its scenarios and options."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SCENARIOS", "Options"]

SCENARIOS = ("p2p-processes", "many-tensors", "concurrent", "nixl-compare", "p2p-actors", "one-to-n", "sharded-sync")


@dataclass
class Options:
    """What to measure (see ``tensorwire bench --help``)."""

    min_bytes: int = 4 << 10
    max_bytes: int = 16 << 20
    factor: float = 16.0
    iterations: int = 20
    warmups: int = 3
    transports: list[str] | None = None  # None: every usable one
    peers: int = 2
    check: bool = False
    scenarios: tuple[str, ...] = SCENARIOS
    progress: bool = False
    sizes: list[int] = field(default_factory=list)
    timeline: str = ""  # where sharded-sync draws its last push's per-pair timeline (PNG), if anywhere
