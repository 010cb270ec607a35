"""Settings of the per-process agent, read once from ``TENSORWIRE_*`` environment variables."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["UCX_ENVIRONMENT_LOCK", "Config", "socket_dir", "ucxx_settings_hidden", "validate_timeout"]


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"environment variable {name}={raw!r} must be positive")
    return value


def validate_timeout(timeout_s: object, *, what: str = "timeout_s") -> float:
    """``timeout_s`` as a positive, finite float; ``ValueError`` for anything else (zero,
    negative, infinite, NaN, a bool, a string)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise ValueError(f"{what} must be a positive number of seconds, got {timeout_s!r}")
    value = float(timeout_s)
    if not 0 < value < float("inf"):
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {timeout_s!r}")
    return value


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must not be negative")
    return value


@dataclass(frozen=True)
class Config:
    """Agent settings. ``Config.from_env()`` reads them; tests build their own.

    Attributes:
        inline_max_nbytes: Objects up to this size travel inside the reference
            (``TENSORWIRE_INLINE_NBYTES``, default 32 KiB).
        transport: Forced transport for every fetch in this process, "" for automatic
            (``TENSORWIRE_TRANSPORT``).
        timeout_s: Default deadline of a fetch (``TENSORWIRE_TIMEOUT_S``, default 60 s).
        rpc_timeout_s: Deadline of one control call (``TENSORWIRE_RPC_TIMEOUT_S``, 10 s).
        transit_ttl_s: How long a reference in transit pins its object if nobody
            deserializes it (``TENSORWIRE_TRANSIT_TTL_S``, default 600 s).
        holder_check_interval_s: How often the owner checks that holders are alive.
        holder_lost_after_s: A holder on another machine that has not answered for this
            long loses its holds.
        hold_linger_s: How long this process keeps holding an object after its last reference
            to it is gone (``TENSORWIRE_HOLD_LINGER_S``, default 1 s; 0: let go at once), so that
            a reference to it received anew (a consumer that gets one in every message) finds
            the hold and the transports' state of it still there: no new registration, no new
            remote descriptors. The owner frees it up to this much later (and a reaper tick).
        host: Address the TCP control service binds to (``TENSORWIRE_HOST``, default
            127.0.0.1; the Ray runtime sets the node's address).
        chunk_nbytes: Chunk size of streamed (two-sided) transfers.
        ref_warn_nbytes: ``put`` warns once per process when a value's non-tensor parts
            pickle to more than this, 0 never (``TENSORWIRE_REF_WARN_NBYTES``, default 1 MiB).
        host_pool_nbytes: Idle host memory this process keeps for later values of the same
            size (an actor's arguments; larger values are not pooled), 0 none
            (``TENSORWIRE_HOST_POOL_NBYTES``, default 1 GiB; :mod:`tensorwire.transport.host_pool`).
    """

    inline_max_nbytes: int = 32 * 1024
    transport: str = ""
    timeout_s: float = 60.0
    rpc_timeout_s: float = 10.0
    transit_ttl_s: float = 600.0
    holder_check_interval_s: float = 1.0
    holder_lost_after_s: float = 30.0
    hold_linger_s: float = 1.0
    host: str = "127.0.0.1"
    chunk_nbytes: int = 4 * 1024 * 1024
    ref_warn_nbytes: int = 1024 * 1024
    host_pool_nbytes: int = 1 << 30

    @classmethod
    def from_env(cls) -> Config:
        return cls(
            inline_max_nbytes=_env_int("TENSORWIRE_INLINE_NBYTES", cls.inline_max_nbytes),
            transport=os.environ.get("TENSORWIRE_TRANSPORT", "").strip(),
            timeout_s=_env_float("TENSORWIRE_TIMEOUT_S", cls.timeout_s),
            rpc_timeout_s=_env_float("TENSORWIRE_RPC_TIMEOUT_S", cls.rpc_timeout_s),
            transit_ttl_s=_env_float("TENSORWIRE_TRANSIT_TTL_S", cls.transit_ttl_s),
            holder_check_interval_s=_env_float("TENSORWIRE_HOLDER_CHECK_S", cls.holder_check_interval_s),
            holder_lost_after_s=_env_float("TENSORWIRE_HOLDER_LOST_S", cls.holder_lost_after_s),
            hold_linger_s=_env_float("TENSORWIRE_HOLD_LINGER_S", cls.hold_linger_s),
            host=os.environ.get("TENSORWIRE_HOST", "").strip() or cls.host,
            chunk_nbytes=_env_int("TENSORWIRE_CHUNK_NBYTES", cls.chunk_nbytes) or cls.chunk_nbytes,
            ref_warn_nbytes=_env_int("TENSORWIRE_REF_WARN_NBYTES", cls.ref_warn_nbytes),
            host_pool_nbytes=_env_int("TENSORWIRE_HOST_POOL_NBYTES", cls.host_pool_nbytes),
        )


# What importing ucxx writes into the environment, each where it was unset (ucxx/__init__.py), for
# ucxx's own UCX context; another UCX made in the process later (NIXL's bundled one) would read it too.
_UCXX_SETTINGS = {
    "UCX_MEMTYPE_CACHE": "n",
    "UCX_RNDV_THRESH": "8192",
    "UCX_RNDV_FRAG_MEM_TYPE": "cuda",
    "UCX_MAX_RNDV_RAILS": "1",
    "UCX_CUDA_COPY_MAX_REG_RATIO": "1.0",
}
UCX_ENVIRONMENT_LOCK = threading.Lock()  # held while a UCX context of this process reads its settings


@contextlib.contextmanager
def ucxx_settings_hidden() -> Iterator[None]:
    """Hide, meanwhile, the UCX settings importing ucxx wrote into this process's environment.

    They are meant for ucxx's context. Read by NIXL's UCX, ``UCX_RNDV_THRESH=8192`` made its
    1 MiB READ 9x slower on the build VM (1.25-1.60 ms against 0.135 ms). A value that differs
    from ucxx's, or any value while ucxx is not imported, stays (a user's value equal to ucxx's
    own, set before ucxx was imported, is hidden too: the two cannot be told apart). Held under
    ``UCX_ENVIRONMENT_LOCK``, which tensorwire's ucx transport holds while it makes its context.
    """
    with UCX_ENVIRONMENT_LOCK:
        imported = "ucxx" in sys.modules
        hidden = {k: v for k, v in _UCXX_SETTINGS.items() if imported and os.environ.get(k) == v}
        for key in hidden:
            del os.environ[key]
        try:
            yield
        finally:
            os.environ.update(hidden)


_made_dirs: set[str] = set()  # socket directories this process made (or found) already


def socket_dir() -> str:
    """A directory private to this user (0700) for the agents' Unix sockets (every object's
    export asks: made once per process, its owner and mode checked every time)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, f"tensorwire-{os.getuid()}")
    if path not in _made_dirs:
        os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"socket directory {path} must be owned by uid {os.getuid()} with mode 0700 "
            f"(found uid {info.st_uid}, mode {oct(info.st_mode & 0o777)}); remove it or fix its permissions"
        )
    _made_dirs.add(path)
    return path
