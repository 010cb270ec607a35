"""The settings of a :class:`..sync.WeightSync`, checked together when it is made."""

from __future__ import annotations

from collections.abc import Sequence

from tensorwire.runtime.ray.actor import ActorHandle
from tensorwire.transport.config import validate_timeout

__all__ = ["checked_settings"]


def checked_settings(
    trainers: tuple[ActorHandle, ...],
    receivers: Sequence[ActorHandle],
    *,
    bucket_bytes: int,
    commit: str,
    aside: str,
    atomic: bool,
    publish: str,
    load: str | None,
    skip_unchanged: bool,
    on_commit: object,
    transport: str,
    timeout_s: float,
    stall_s: float | None,
) -> float | None:
    """Raise for settings that cannot work together; returns ``stall_s`` (None: adaptive)."""
    if not trainers:
        raise ValueError("WeightSync needs at least one trainer")
    if not receivers:
        raise ValueError("WeightSync needs at least one receiver")
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be a positive number of bytes")
    if commit not in ("all", "each"):
        raise ValueError(f"commit={commit!r}: expected 'all' (every receiver or none) or 'each' (each on its own)")
    if aside not in ("shadow", "host", "none") or (aside == "none" and (commit != "all" or atomic)):
        raise ValueError(f"aside={aside!r}: expected 'shadow', 'host', or 'none' with commit='all' (and no atomic)")
    if aside == "host" and commit != "all" and not atomic:
        raise ValueError("aside='host' assembles versions aside: it needs commit='all' or atomic=True")
    if load is not None and (not isinstance(load, str) or not load or aside == "none" or publish != "copy"):
        raise ValueError(
            f"load={load!r}: expected the name of a receiver method, with aside='shadow' or 'host' and publish='copy' "
            "(versions are assembled aside and fed to it)"
        )
    if skip_unchanged and publish == "swap":
        raise ValueError(
            "skip_unchanged=True keeps what receivers hold for unchanged buckets: publish='swap' holds "
            "the version before in its shadows; use publish='copy'"
        )
    swappable = aside == "shadow" and (commit == "all" or atomic)
    if publish not in ("copy", "swap") or (publish == "swap" and not swappable):
        raise ValueError(
            f"publish={publish!r}: expected 'copy', or 'swap' where versions are assembled in shadows beside "
            "the tensors (aside='shadow')"
        )
    if on_commit is not None and not (isinstance(on_commit, str) and on_commit) and not callable(on_commit):
        raise TypeError("on_commit must name a receiver method or be a function f(actor, version)")
    if stall_s is not None and validate_timeout(stall_s) >= timeout_s:
        raise ValueError(f"stall_s={stall_s:g} must be below timeout_s={timeout_s:g} (how long trainers wait)")
    if transport != "auto":
        from tensorwire.transport import registry

        registry.get_transport_class(transport)  # unknown names: "did you mean"
    return stall_s
