"""How tensorwire writes byte counts for people (plan summaries, the bench's table)."""

from __future__ import annotations

__all__ = ["nbytes_text"]

_BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def nbytes_text(nbytes: float, *, compact: bool = False) -> str:
    """``nbytes`` in binary units: ``"1.50 MiB"``; ``compact``: a size as the bench's table
    writes it (nccl-tests style), ``"64M"`` for an exact multiple of a unit, else the count."""
    for unit, scale in _BINARY:
        if compact and nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes) // scale}{unit[0]}"
        if not compact and nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return str(int(nbytes)) if compact else f"{int(nbytes)} B"
