"""Transport registry: name -> "module:Class", imported lazily on first use.

Adding a transport means writing one module and calling :func:`register_transport`; nothing
else in the code base changes.
"""

from __future__ import annotations

import difflib
import importlib
import threading

from tensorwire.transport.base import Transport

__all__ = [
    "BUILTIN_TRANSPORTS",
    "get_transport_class",
    "register_transport",
    "registered_transports",
    "unregister_transport",
    "version",
]

BUILTIN_TRANSPORTS: dict[str, str] = {
    "local": "tensorwire.transport.local:LocalTransport",
    "inline": "tensorwire.transport.inline:InlineTransport",
    "shm": "tensorwire.transport.shm:ShmTransport",
    "host": "tensorwire.transport.host:HostTransport",
    "gloo": "tensorwire.transport.gloo:GlooTransport",
    "ucx": "tensorwire.transport.ucx:UcxTransport",
    "cuda_ipc": "tensorwire.transport.cuda_ipc:CudaIpcTransport",
    "nccl": "tensorwire.transport.nccl:NcclTransport",
}

_lock = threading.Lock()
_entries: dict[str, str | type[Transport]] = dict(BUILTIN_TRANSPORTS)
_loaded: dict[str, type[Transport]] = {}
_version = 0  # bumped on every change, so users of the registry can cache what they derive


def register_transport(name: str, target: str | type[Transport], *, replace: bool = False) -> None:
    """Register a transport under ``name``.

    Args:
        name: Registry name, e.g. ``"my_rdma"``; the class's ``name`` attribute must match.
        target: The class, or ``"package.module:ClassName"`` to import on first use.
        replace: Allow replacing an existing entry.

    Raises:
        ValueError: The name is taken (and ``replace`` is false) or malformed.
        TypeError: ``target`` is neither a Transport subclass nor a "module:Class" string.
    """
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"transport name must be alphanumeric/underscore, got {name!r}")
    if isinstance(target, str):
        if target.count(":") != 1:
            raise ValueError(f"transport target must look like 'package.module:Class', got {target!r}")
    elif not (isinstance(target, type) and issubclass(target, Transport)):
        raise TypeError(f"transport target must be a Transport subclass or 'module:Class', got {target!r}")
    global _version
    with _lock:
        if name in _entries and not replace:
            raise ValueError(f"transport {name!r} is already registered; pass replace=True to override")
        _entries[name] = target
        _loaded.pop(name, None)
        _version += 1


def unregister_transport(name: str) -> None:
    """Remove a registered transport (built-ins included). Unknown names raise ``ValueError``."""
    global _version
    with _lock:
        if name not in _entries:
            raise ValueError(_unknown_message(name))
        del _entries[name]
        _loaded.pop(name, None)
        _version += 1


def registered_transports() -> list[str]:
    """Names of every registered transport, in registration order."""
    with _lock:
        return list(_entries)


def version() -> int:
    """A number that changes whenever a transport is registered or unregistered."""
    return _version


def get_transport_class(name: str) -> type[Transport]:
    """The class registered under ``name``, importing its module on first use.

    Raises:
        ValueError: Unknown name ("did you mean ...? available: [...]").
        ImportError: The module could not be imported (the message names the extra to install).
    """
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name not in _entries:
            raise ValueError(_unknown_message(name))
        target = _entries[name]
    if isinstance(target, str):
        module_name, class_name = target.split(":")
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, Transport)):
            raise TypeError(f"{target!r} is not a Transport subclass")
    else:
        cls = target
    if getattr(cls, "name", None) != name:
        raise ValueError(f"transport class {cls.__qualname__} has name {cls.name!r}, registered as {name!r}")
    with _lock:
        _loaded[name] = cls
    return cls


def _unknown_message(name: str) -> str:
    known = list(_entries)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"unknown transport {name!r}: {hint}available: {known}. "
        "Did you forget to call tensorwire.transport.register_transport()?"
    )
