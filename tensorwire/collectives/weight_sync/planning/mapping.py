"""How trainer parameters become receiver parameters (weight sync; pure metadata): renames,
fused parameters and float8 scales (:class:`NameMap`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Fuse", "NameMap"]


@dataclass(frozen=True)
class Fuse:
    """A receiver parameter made of several trainer parameters along ``dim`` (in order)."""

    parts: tuple[str, ...]
    dim: int = 0


@dataclass(frozen=True)
class NameMap:
    """How trainer parameters become receiver parameters.

    Attributes:
        rename: Trainer name -> receiver name: a dict (names not in it keep theirs) or a
            function (returning None: the parameter is not synced).
        fuse: Receiver name -> :class:`Fuse` (or the part names, fused along dim 0); parts
            are trainer names.
        scales: Receiver float8 parameter -> the receiver tensor that gets its scale.
    """

    rename: Mapping[str, str] | Callable[[str], str | None] | None = None
    fuse: Mapping[str, Fuse] = field(default_factory=dict)
    scales: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
        fuse: Mapping[str, Fuse | Sequence[str]] | None = None,
        scales: Mapping[str, str] | None = None,
    ) -> NameMap:
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
