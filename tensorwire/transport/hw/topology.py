"""Who and where this process is: node id, machine id, process identity, visible devices.

Never raises at import; anything that cannot be discovered is left empty.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from typing import TYPE_CHECKING, Any

from tensorwire.errors import DeviceUnavailableError
from tensorwire.transport.contract import DeviceInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "checked_device",
    "machine_id",
    "node_id",
    "process_alive",
    "process_start_time",
    "process_stopped",
    "visible_devices",
]

NODE_ID_ENV = "TENSORWIRE_NODE_ID"


@functools.lru_cache(maxsize=1)
def machine_id() -> str:
    """Host name plus kernel boot id: equal only for processes of one running machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{socket.gethostname()}/{boot_id}"


def node_id() -> str:
    """The node id used to decide "same node": ``TENSORWIRE_NODE_ID`` if set, else the machine id."""
    return os.environ.get(NODE_ID_ENV, "").strip() or machine_id()


def process_start_time(pid: int) -> int:
    """The start time of ``pid`` in clock ticks since boot, or 0 if it cannot be read."""
    fields = _stat_fields(pid) or []
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return 0


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 onwards), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return stat[stat.rfind(b")") + 2 :].split()


def _same_process(fields: list[bytes], start_time: int) -> bool:
    """Whether ``fields`` are of the process that started at ``start_time`` (the pid not reused)."""
    try:
        started = int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        started = 0
    return not (start_time and started not in (0, start_time))


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` still runs on this machine
    (not a zombie, and the pid not reused). One read of ``/proc/<pid>/stat``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    fields = _stat_fields(pid)
    if not fields or fields[0] in (b"Z", b"X"):
        return False  # exited, not yet reaped
    if _exiting(fields):
        return False  # killed, tearing down (tens of ms for a large process, its sockets still open)
    return _same_process(fields, start_time)


_PF_EXITING = 0x4  # the kernel's flag of a task in do_exit


def _exiting(fields: list[bytes]) -> bool:
    """Whether the process (its main thread) is exiting: its memory is being torn down and it
    will never run user code again."""
    try:
        return bool(int(fields[6]) & _PF_EXITING)  # field 9 of the whole line
    except (IndexError, ValueError):
        return False


def process_stopped(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` is stopped on this machine
    (``SIGSTOP``, a debugger, job control: state ``T`` or ``t``): alive, but it runs nothing
    until it is continued. One read of ``/proc/<pid>/stat``."""
    fields = _stat_fields(pid) if pid > 0 else None
    return bool(fields) and fields[0] in (b"T", b"t") and _same_process(fields, start_time)


@functools.lru_cache(maxsize=1)
def visible_devices() -> tuple[DeviceInfo, ...]:
    """Devices this process can use: the CPU, plus CUDA devices (physical UUID and PCI bus id)."""
    devices = [DeviceInfo(kind="cpu", index=0)]
    try:
        import torch

        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                devices.append(
                    DeviceInfo(kind="cuda", index=index, uuid=cuda_uuid(index), pci_bus_id=_pci_bus_id(index))
                )
    except Exception:  # noqa: BLE001 - discovery must never fail the caller
        pass
    return tuple(devices)


def _backend_devices(kind: str) -> list[str]:
    """``kind:0``... for every device of a torch backend (cuda, xpu, mps) this process sees."""
    import torch

    module = getattr(torch, kind, None)
    try:
        if module is None or not module.is_available():
            return []
        return [f"{kind}:{i}" for i in range(module.device_count())]
    except Exception:  # noqa: BLE001 - a broken backend sees nothing
        return []


def checked_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``, checked to be one this process can place tensors on.

    CPU and meta always pass; ``cuda``/``xpu``/``mps`` need such a device (with an index: one
    that exists); other types (``hpu``, ``npu``, ...) are left to their torch plug-in.

    Raises:
        DeviceUnavailableError: ``device`` is not a device string torch knows, or names a
            device this process does not see (the message lists the ones it does).
    """
    import torch

    try:
        target = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceUnavailableError(f"device={device!r} is not a device torch can use here: {e}") from e
    if target.type not in ("cuda", "xpu", "mps"):
        return target
    present = _backend_devices(target.type)
    if present and (target.index is None or target.index < len(present)):
        return target
    visible = ["cpu"] + [d for kind in ("cuda", "xpu", "mps") for d in _backend_devices(kind)]
    why = f"this process sees {len(present)} {target.type} device(s)"
    if target.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            why = f"torch {torch.__version__} was built without CUDA"
        elif "CUDA_VISIBLE_DEVICES" in os.environ:
            why += f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
    raise DeviceUnavailableError(
        f"device={device!r} is not available here: {why}; visible: {', '.join(visible)}. "
        "Pass one of those, or leave device unset to land where the producer had the tensors (else the CPU)"
    )


@functools.lru_cache(maxsize=64)
def cuda_uuid(index: int) -> str:
    """The physical UUID ("GPU-...") of this process's CUDA device ``index`` ("" if unknown).

    Indices depend on ``CUDA_VISIBLE_DEVICES``; UUIDs do not, so devices are compared across
    processes by UUID only.
    """
    try:
        import torch

        raw = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    except Exception:  # noqa: BLE001
        return ""
    return normalize_uuid(raw)


def normalize_uuid(raw: str) -> str:
    """One spelling for a GPU UUID: torch prints it bare, NVML and nvidia-smi with "GPU-"."""
    raw = raw.strip()
    if not raw:
        return ""
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def _pci_bus_id(index: int) -> str:
    try:
        import torch

        props = torch.cuda.get_device_properties(index)
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except Exception:  # noqa: BLE001
        return ""


def local_cuda_index(uuid: str, devices: tuple[DeviceInfo, ...] | None = None) -> int | None:
    """This process's index of the CUDA device with ``uuid``, or None if it cannot see it."""
    for device in devices if devices is not None else visible_devices():
        if device.kind == "cuda" and device.uuid and device.uuid == uuid:
            return device.index
    return None


@functools.lru_cache(maxsize=1)
def gpu_links() -> tuple[tuple[str, str, str], ...]:
    """How this process's GPUs reach each other: ``(uuid_a, uuid_b, kind)`` per pair, kind
    "nvlink", "pcie" (P2P over PCIe) or "none" (no P2P: copies go through the host). Empty
    with fewer than two GPUs or without NVML (the selector then assumes P2P where CUDA has it).
    """
    uuids = [d.uuid for d in visible_devices() if d.kind == "cuda" and d.uuid]
    if len(uuids) < 2:
        return ()
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVML missing: no link facts
        return ()
    try:
        handles = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            handles[normalize_uuid(uuid.decode() if isinstance(uuid, bytes) else uuid)] = handle
        links = []
        for i, a in enumerate(uuids):
            for b in uuids[i + 1 :]:
                if a in handles and b in handles:
                    links.append((a, b, _link_kind(pynvml, handles[a], handles[b])))
        return tuple(links)
    except Exception:  # noqa: BLE001
        return ()
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _link_kind(pynvml: object, a: object, b: object) -> str:
    ok = pynvml.NVML_P2P_STATUS_OK  # type: ignore[attr-defined]
    if pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == ok:  # type: ignore[attr-defined]
        return "nvlink"
    if pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_READ) == ok:  # type: ignore[attr-defined]
        return "pcie"
    return "none"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _numa_nodes() -> int:
    try:
        return sum(1 for n in os.listdir("/sys/devices/system/node") if n.startswith("node") and n[4:].isdigit())
    except OSError:
        return 0


def _shared_memory() -> dict[str, object]:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError as e:
        return {"path": "/dev/shm", "error": str(e)}
    return {
        "path": "/dev/shm",
        "total_nbytes": stats.f_blocks * stats.f_frsize,
        "free_nbytes": stats.f_bavail * stats.f_frsize,
    }


_INFINIBAND = "/sys/class/infiniband"


def sysfs_pci_address(bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" as sysfs spells it: "0000:3b:00.0"."""
    domain, _, rest = bus_id.strip().partition(":")
    return f"{domain[-4:]}:{rest}".lower() if rest else bus_id.lower()


def gpu_nic_affinity(gpus: list[dict[str, object]], nics: list[dict[str, object]]) -> dict[str, list[str]]:
    """For each GPU (by UUID), the RDMA NICs on its NUMA node (the ones to prefer for it)."""
    near: dict[str, list[str]] = {}
    for gpu in gpus:
        numa = str(gpu.get("numa_node", ""))
        near[str(gpu["uuid"])] = [
            str(n["name"]) for n in nics if numa not in ("", "-1") and str(n.get("numa_node", "")) == numa
        ]
    return near


def rdma_nic_names() -> list[str]:
    """This machine's RDMA NICs (InfiniBand / RoCE), by name."""
    try:
        return sorted(os.listdir(_INFINIBAND))
    except OSError:
        return []


def _rdma_nics() -> list[dict[str, object]]:
    base = _INFINIBAND
    nics = []
    for name in rdma_nic_names():
        ports = []
        try:
            port_names = sorted(os.listdir(f"{base}/{name}/ports"))
        except OSError:
            port_names = []
        for port in port_names:
            ports.append(
                {
                    "port": port,
                    "state": _read(f"{base}/{name}/ports/{port}/state"),
                    "link_layer": _read(f"{base}/{name}/ports/{port}/link_layer"),
                    "rate": _read(f"{base}/{name}/ports/{port}/rate"),
                }
            )
        nics.append({"name": name, "numa_node": _read(f"{base}/{name}/device/numa_node"), "ports": ports})
    return nics


def _gpudirect_rdma() -> bool:
    modules = _read("/proc/modules")
    return any(line.split(" ", 1)[0] in ("nvidia_peermem", "nv_peer_mem") for line in modules.splitlines())


def _nvidia(visible: list[str] | None) -> dict[str, object]:
    """NVIDIA GPUs through NVML: physical ids and the P2P/NVLink matrix, or why not."""
    try:
        import pynvml
    except ImportError:
        return {"devices": [], "reason": "nvidia-ml-py is not installed (pip install 'tensorwire[gpu]')"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVML raises its own error types
        return {"devices": [], "reason": f"NVML unavailable: {e}"}
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        devices = []
        for index, handle in enumerate(handles):
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            shown = visible is None or str(index) in visible or uuid in visible
            numa = _read(f"/sys/bus/pci/devices/{sysfs_pci_address(bus)}/numa_node")
            devices.append({"index": index, "uuid": uuid, "pci_bus_id": bus, "visible": shown, "numa_node": numa})
        links = []
        for i, a in enumerate(handles):
            for j, b in enumerate(handles):
                if i < j:
                    kind = _link_kind(pynvml, a, b)
                    links.append({"a": i, "b": j, "p2p": kind != "none", "link": kind})
        return {"devices": devices, "p2p": links, "reason": ""}
    except Exception as e:  # noqa: BLE001
        return {"devices": [], "reason": f"NVML query failed: {e}"}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def describe_node() -> dict[str, object]:
    """This node's facts as plain data (JSON-ready). Never raises; missing facts give reasons."""
    from tensorwire.transport.hw.accelerators import VENDORS, deciding_variable, furiosa_partition, visible_ids

    accelerators: dict[str, object] = {}
    for vendor in VENDORS.values():
        try:
            ids = visible_ids(vendor)
        except ValueError as e:
            accelerators[vendor.name] = {"error": str(e)}
            continue
        entry: dict[str, object] = {
            "resource": vendor.resource,
            "visibility_env": list(vendor.visibility_env),
            "visible_from": deciding_variable(vendor),
            "visible": ids,
            "torch_device": vendor.torch_device,
            "fractional": vendor.fractional,
            "id_form": vendor.id_form,
        }
        if vendor.name == "furiosa" and ids:
            parts = (furiosa_partition(f"npu:{token}") for token in ids)
            entry["partitions"] = [{"device": device, "pes": list(pes)} for device, pes in parts]
        if vendor.name == "nvidia":
            entry.update(_nvidia(ids))
        elif ids is None:
            continue  # nothing restricts or reports this vendor here
        accelerators[vendor.name] = entry
    nics = _rdma_nics()
    nvidia = accelerators.get("nvidia")
    if isinstance(nvidia, dict) and nvidia.get("devices"):
        nvidia["nic_affinity"] = gpu_nic_affinity(nvidia["devices"], nics)
    return {
        "node_id": node_id(),
        "machine_id": machine_id(),
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count() or 0,
        "numa_nodes": _numa_nodes(),
        "shared_memory": _shared_memory(),
        "devices": [vars(d) for d in visible_devices()],
        "accelerators": accelerators,
        "rdma_nics": nics,
        "gpudirect_rdma": _gpudirect_rdma(),
    }
