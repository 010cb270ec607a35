"""What ``tensorwire topo`` and ``tensorwire doctor`` report about NIXL: the installed wheel,
its plug-ins and bundled UCX modules (files only), the backends an agent gets, and the RDMA
devices its bundled verbs library lists."""

from __future__ import annotations

import os
from collections.abc import Iterator

from tensorwire.transport.backends.nixl.engine import new_agent
from tensorwire.transport.contract import Diagnosis, Health

__all__ = ["diagnose", "library", "verbs_devices"]


def _wheels() -> Iterator[tuple[str, str]]:
    """(module, its wheel's bundled-libraries folder) of each installed NIXL wheel, cu12 first."""
    from importlib import util

    for module in ("nixl_cu12", "nixl_cu13"):
        spec = util.find_spec(module)
        if spec is not None and spec.origin:
            yield module, os.path.join(os.path.dirname(os.path.dirname(spec.origin)), f"{module}.libs")


def library() -> str:
    """The installed NIXL wheel, its backend plug-ins and its bundled UCX's modules (files only:
    nothing is imported, no agent made)."""
    from importlib import metadata

    for module, libs in _wheels():
        dist = module.replace("_", "-")
        names = os.listdir(libs + "/nixl") if os.path.isdir(libs + "/nixl") else []
        plugins = sorted(n[len("libplugin_") : -3] for n in names if n.startswith("libplugin_") and n.endswith(".so"))
        ucx = os.listdir(libs + "/ucx") if os.path.isdir(libs + "/ucx") else []
        modules = sorted({n[len("libuct_") :].split(".")[0] for n in ucx if n.startswith("libuct_")})
        version = metadata.version(dist)
        return f"{dist} {version}; plugins {', '.join(plugins) or '?'}; UCX modules {', '.join(modules) or '?'}"
    return "not installed (pip install 'tensorwire[nixl]' or nixl-cu12)"


def verbs_devices() -> list[str] | str:
    """The RDMA devices the verbs library bundled in the NIXL wheel lists (what its UCX's ``ib``
    transports would open), or why it lists none. Opens no device. Unverified on a machine
    with RDMA devices (the build VM has none)."""
    import ctypes
    import glob

    for module, libs in _wheels():
        found = sorted(glob.glob(os.path.join(libs, "libibverbs*.so*")))
        if not found:
            return f"{module} bundles no libibverbs"
        try:
            verbs = ctypes.CDLL(found[0], use_errno=True)
        except OSError as e:
            return f"its libibverbs does not load ({e})"
        verbs.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
        verbs.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
        verbs.ibv_get_device_name.restype, verbs.ibv_get_device_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        count = ctypes.c_int(0)
        devices = verbs.ibv_get_device_list(ctypes.byref(count))
        if not devices:
            return f"its libibverbs lists no device ({os.strerror(ctypes.get_errno()) or 'none found'})"
        try:
            return [verbs.ibv_get_device_name(devices[i]).decode() for i in range(count.value)]
        finally:
            verbs.ibv_free_device_list(devices)
    return "NIXL is not installed"


def diagnose() -> list[Diagnosis]:
    """NIXL's wheel, the backends an agent made now has, and the RDMA devices its bundled verbs
    library lists (what its UCX's ib transports would open)."""
    wheel = library()
    try:
        backends = ", ".join(new_agent(f"tw-doctor-{os.getpid()}").backends) or "none"
    except Exception as e:  # noqa: BLE001 - reported, the transfer check says the rest
        backends = f"none ({type(e).__name__}: {e})"
    devices = verbs_devices()
    if isinstance(devices, list) and devices:
        return [
            Diagnosis(
                "NIXL",
                Health.OK,
                f"{wheel}; backends {backends}; its verbs library sees RDMA devices {', '.join(devices)}",
            )
        ]
    why = devices if isinstance(devices, str) else "its verbs library lists none"
    detail = f"{wheel}; backends {backends}; no RDMA device ({why}): its UCX uses TCP across nodes"
    return [Diagnosis("NIXL", Health.WARN, detail)]
