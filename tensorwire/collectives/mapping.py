"""How trainer parameters become receiver parameters (weight sync; pure metadata): renames,
fused parameters and float8 scales (:class:`Mapping`), and the in-order bucket cut."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field

from tensorwire.transport.packing import InOrderGroups

__all__ = ["Fuse", "Mapping", "bucket_plan"]


def bucket_plan(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices cut in order into buckets of at most ``bucket_bytes`` (a larger item gets a
    bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    groups = InOrderGroups(bucket_bytes)
    buckets = [closed for index, size in enumerate(nbytes) if (closed := groups.add(index, size))]
    if rest := groups.rest():
        buckets.append(rest)
    return buckets


@dataclass(frozen=True)
class Fuse:
    """A receiver parameter made of several trainer parameters along ``dim`` (in order)."""

    parts: tuple[str, ...]
    dim: int = 0


@dataclass(frozen=True)
class Mapping:
    """How trainer parameters become receiver parameters.

    Attributes:
        rename: Trainer name -> receiver name: a dict (names not in it keep theirs) or a
            function (returning None: the parameter is not synced).
        fuse: Receiver name -> :class:`Fuse` (or the part names, fused along dim 0); parts
            are trainer names.
        scales: Receiver float8 parameter -> the receiver tensor that gets its scale.
    """

    rename: MappingABC[str, str] | Callable[[str], str | None] | None = None
    fuse: MappingABC[str, Fuse] = field(default_factory=dict)
    scales: MappingABC[str, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        rename: MappingABC[str, str] | Callable[[str], str | None] | None = None,
        fuse: MappingABC[str, Fuse | Sequence[str]] | None = None,
        scales: MappingABC[str, str] | None = None,
    ) -> Mapping:
        fused = {}
        for name, spec in (fuse or {}).items():
            fused[name] = spec if isinstance(spec, Fuse) else Fuse(tuple(spec))
            if len(set(fused[name].parts)) != len(fused[name].parts):
                raise ValueError(f"fused parameter {name!r} lists a part twice (overlap): {list(fused[name].parts)}")
        return cls(rename, fused, dict(scales or {}))

    def renamed(self, name: str) -> str | None:
        if self.rename is None:
            return name
        if callable(self.rename):
            return self.rename(name)
        return self.rename.get(name, name)
