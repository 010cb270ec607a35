"""Who and where this process is: node id, machine id, process identity, visible devices.

Never raises at import; anything that cannot be discovered is left empty.
"""

from __future__ import annotations

import functools
import os
import socket

from tensorwire.transport.base import DeviceInfo

__all__ = ["machine_id", "node_id", "process_alive", "process_start_time", "visible_devices"]

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
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return 0


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` still runs on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if start_time and process_start_time(pid) not in (0, start_time):
        return False  # the pid was reused
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


def visible_devices() -> tuple[DeviceInfo, ...]:
    """Devices this process can use: the CPU, plus CUDA devices if torch sees any."""
    devices = [DeviceInfo(kind="cpu", index=0)]
    try:
        import torch

        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                uuid = str(getattr(props, "uuid", "") or "")
                devices.append(DeviceInfo(kind="cuda", index=index, uuid=uuid))
    except Exception:  # noqa: BLE001 - discovery must never fail the caller
        pass
    return tuple(devices)
