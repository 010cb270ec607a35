"""Transport registry: name -> "module:Class", imported lazily on first use.

Three sources, merged lazily on first use of the registry in every process (no call needed):

* the built-in table :data:`BUILTIN_TRANSPORTS`;
* third-party transports declared in the ``tensorwire.transports`` entry-point group of any
  installed distribution (``name = "package.module:Class"``); a name that a built-in already
  uses is ignored with a warning;
* :data:`ENV` (``TENSORWIRE_TRANSPORTS="name=package.module:Class,..."``), which the runtime
  sets for the Ray actors and tasks a driver starts after :func:`register_transport`, so that
  run-time registrations reach them.

:func:`register_transport` adds or replaces an entry at run time. Every class is checked
against its capabilities when it is registered (class targets) or first loaded (string
targets): a method that a capability requires and the class lacks raises
:class:`~tensorwire.errors.TransportContractError` naming both.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import threading

from tensorwire.errors import TransportContractError
from tensorwire.transport.contract import REQUIRED_METHODS, Transport

__all__ = [
    "BUILTIN_TRANSPORTS",
    "ENTRY_POINT_GROUP",
    "ENV",
    "check_contract",
    "encode_env",
    "get_transport_class",
    "library_report",
    "register_transport",
    "registered_transports",
    "runtime_registrations",
    "unregister_transport",
    "version",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tensorwire.transports"
ENV = "TENSORWIRE_TRANSPORTS"

BUILTIN_TRANSPORTS: dict[str, str] = {
    "local": "tensorwire.transport.backends.local:LocalTransport",
    "inline": "tensorwire.transport.backends.inline:InlineTransport",
    "shm": "tensorwire.transport.backends.shm:ShmTransport",
    "host": "tensorwire.transport.backends.host:HostTransport",
    "gloo": "tensorwire.transport.backends.gloo:GlooTransport",
    "ucx": "tensorwire.transport.backends.ucx:UcxTransport",
    "cuda_ipc": "tensorwire.transport.backends.cuda_ipc:CudaIpcTransport",
    "nccl": "tensorwire.transport.backends.nccl:NcclTransport",
}

_lock = threading.RLock()
_entries: dict[str, str | type[Transport]] = dict(BUILTIN_TRANSPORTS)
_loaded: dict[str, type[Transport]] = {}
_runtime: dict[str, str | type[Transport]] = {}  # register_transport() calls of this process
_discovered_pid = 0
_version = 0  # bumped on every change, so users of the registry can cache what they derive


def _check_name_and_target(name: str, target: object) -> None:
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"transport name must be alphanumeric/underscore, got {name!r}")
    if isinstance(target, str):
        if target.count(":") != 1:
            raise ValueError(f"transport target must look like 'package.module:Class', got {target!r}")
    elif not (isinstance(target, type) and issubclass(target, Transport)):
        raise TypeError(f"transport target must be a Transport subclass or 'module:Class', got {target!r}")


def check_contract(cls: type[Transport]) -> None:
    """Raise :class:`TransportContractError` if ``cls`` lacks a method its capabilities require.

    The rules are :data:`~tensorwire.transport.contract.REQUIRED_METHODS`; abstract methods
    left unimplemented (``fetch``, the two-sided hooks) count too.
    """
    caps = getattr(cls, "capabilities", None)
    if caps is None:
        raise TransportContractError(f"transport class {cls.__qualname__} declares no `capabilities`")
    missing = [(m, "every transport") for m in sorted(getattr(cls, "__abstractmethods__", ()))]
    for capability, methods in REQUIRED_METHODS:
        has = not caps.one_sided if capability == "two_sided" else getattr(caps, capability)
        for method in methods if has else ():
            if getattr(cls, method, None) is getattr(Transport, method, None):
                missing.append((method, "one_sided=False" if capability == "two_sided" else f"{capability}=True"))
    if missing:
        what = "; ".join(f"method {m!r} (required by {c})" for m, c in missing)
        raise TransportContractError(
            f"transport class {cls.__module__}.{cls.__qualname__} (name {getattr(cls, 'name', '?')!r}) "
            f"does not implement {what}; see the table in tensorwire/transport/contract.py"
        )


def register_transport(name: str, target: str | type[Transport], *, replace: bool = False) -> None:
    """Register a transport under ``name`` in this process (and, through the runtime, in the
    Ray actors and tasks started after this call).

    Args:
        name: Registry name, e.g. ``"my_rdma"``; the class's ``name`` attribute must match.
        target: The class, or ``"package.module:ClassName"`` to import on first use. Ray
            workers receive it as ``module:Class``, so a class must be importable there.
        replace: Allow replacing an existing entry.

    Raises:
        ValueError: The name is taken (and ``replace`` is false) or malformed.
        TypeError: ``target`` is neither a Transport subclass nor a "module:Class" string.
        TransportContractError: The class lacks a method one of its capabilities requires.
    """
    _check_name_and_target(name, target)
    if isinstance(target, type):
        check_contract(target)
    _discover()
    global _version
    with _lock:
        if name in _entries and not replace:
            raise ValueError(f"transport {name!r} is already registered; pass replace=True to override")
        _entries[name] = target
        _runtime[name] = target
        _loaded.pop(name, None)
        _version += 1


def unregister_transport(name: str) -> None:
    """Remove a registered transport (built-ins included) in this process only. Unknown
    names raise ``ValueError``."""
    _discover()
    global _version
    with _lock:
        if name not in _entries:
            raise ValueError(_unknown_message(name))
        del _entries[name]
        _runtime.pop(name, None)
        _loaded.pop(name, None)
        _version += 1


def registered_transports() -> list[str]:
    """Names of every registered transport, in registration order."""
    _discover()
    with _lock:
        return list(_entries)


def version() -> int:
    """A number that changes whenever a transport is registered or unregistered."""
    _discover()
    return _version


def runtime_registrations() -> dict[str, str]:
    """This process's :func:`register_transport` entries that another process can import
    (``name -> "module:Class"``), for the runtime to pass to the workers it starts. Classes
    that cannot be imported by name (defined in ``__main__`` or inside a function) are
    left out with a debug message."""
    with _lock:
        runtime = dict(_runtime)
    result = {}
    for name, target in runtime.items():
        path = target if isinstance(target, str) else _import_path(target)
        if path:
            result[name] = path
        else:
            logger.debug("transport %s: class %r is not importable by name; Ray workers do not get it", name, target)
    return result


def encode_env(registrations: dict[str, str]) -> str:
    """The :data:`ENV` value for ``registrations``."""
    return ",".join(f"{n}={t}" for n, t in sorted(registrations.items()))


def _import_path(cls: type) -> str:
    module = cls.__module__
    if module == "__main__" or "<locals>" in cls.__qualname__:
        return ""
    try:
        found = importlib.import_module(module)
        for part in cls.__qualname__.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return ""
    return f"{module}:{cls.__qualname__}" if found is cls else ""


def _discover() -> None:
    """Merge entry points and :data:`ENV` into the table, once per process."""
    global _discovered_pid, _version
    if _discovered_pid == os.getpid():
        return
    with _lock:
        if _discovered_pid == os.getpid():
            return
        _discovered_pid = os.getpid()
        for name, target in _entry_points():
            if name in BUILTIN_TRANSPORTS:
                logger.warning("ignoring entry point %r = %r: a built-in transport has that name", name, target)
            elif name not in _entries:
                _entries[name] = target
        for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
            name, _, target = item.partition("=")
            try:
                _check_name_and_target(name.strip(), target.strip())
            except (TypeError, ValueError) as e:
                logger.warning("ignoring %s entry %r: %s", ENV, item, e)
                continue
            _entries[name.strip()] = target.strip()
            _loaded.pop(name.strip(), None)
        _version += 1


def _entry_points() -> list[tuple[str, str]]:
    from importlib import metadata

    try:
        found = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as e:  # noqa: BLE001 - broken metadata of another package must not break us
        logger.warning("could not read the %s entry points: %s", ENTRY_POINT_GROUP, e)
        return []
    result = []
    for entry in found:
        if entry.value.count(":") != 1:
            logger.warning("ignoring entry point %r = %r: not 'package.module:Class'", entry.name, entry.value)
            continue
        result.append((entry.name, entry.value))
    return result


def get_transport_class(name: str) -> type[Transport]:
    """The class registered under ``name``, importing its module on first use.

    Raises:
        ValueError: Unknown name ("did you mean ...? available: [...]").
        ImportError: The module could not be imported (the message names the extra to install).
        TransportContractError: The class lacks a method one of its capabilities requires.
    """
    _discover()
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
        check_contract(cls)
    else:
        cls = target
    if getattr(cls, "name", None) != name:
        raise ValueError(f"transport class {cls.__qualname__} has name {cls.name!r}, registered as {name!r}")
    with _lock:
        _loaded[name] = cls
    return cls


def library_report() -> dict[str, str]:
    """Each registered transport's optional library and its state (``Transport.library_status``),
    for those that name one; a transport that cannot be loaded says why. Imports the transport
    modules, not their libraries."""
    report = {}
    for name in registered_transports():
        try:
            status = get_transport_class(name).library_status()
        except Exception as e:  # noqa: BLE001 - a broken plug-in is reported, not raised
            status = f"cannot be loaded: {type(e).__name__}: {e}"
        if status:
            report[name] = status
    return report


def _unknown_message(name: str) -> str:
    known = list(_entries)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"unknown transport {name!r}: {hint}available: {known}. Did you forget to call "
        f"tensorwire.transport.register_transport() or to install the package whose "
        f"{ENTRY_POINT_GROUP!r} entry point provides it?"
    )
