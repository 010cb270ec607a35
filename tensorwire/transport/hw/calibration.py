"""Per-machine transport cost tables written by ``tensorwire bench --calibrate``.

The selector ranks transports by ``fixed_us + bytes / bandwidth``; each transport declares
a default ``cost_model`` (the built-ins' numbers were measured on the project's build VM). A
calibration measures this machine and writes a JSON table that every agent on the machine
loads at start (an entry replaces that transport's declared model):

``$TENSORWIRE_COSTS_FILE``, else ``$XDG_CONFIG_HOME/tensorwire/costs.json`` (default
``~/.config/tensorwire/costs.json``). A table written on another machine (different
``machine_id``) is ignored with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from tensorwire.transport.hw import topology
from tensorwire.transport.selector import CostEstimate

__all__ = ["SCHEMA_VERSION", "costs_path", "load_costs", "save_costs"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


def costs_path() -> str:
    """Where this machine's cost table lives."""
    explicit = os.environ.get("TENSORWIRE_COSTS_FILE", "").strip()
    if explicit:
        return explicit
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "tensorwire", "costs.json")


def save_costs(costs: Mapping[str, CostEstimate], path: str | None = None) -> str:
    """Write ``costs`` for this machine (atomically, mode 0600); returns the path."""
    path = path or costs_path()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    document = {
        "schema_version": SCHEMA_VERSION,
        "machine_id": topology.machine_id(),
        "costs": {name: {"fixed_us": c.fixed_us, "bandwidth_gbps": c.bandwidth_gbps} for name, c in costs.items()},
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(document, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


def load_costs(path: str | None = None) -> dict[str, CostEstimate]:
    """This machine's calibrated costs, or ``{}`` (no table, another machine's, or malformed)."""
    path = path or costs_path()
    try:
        with open(path) as f:
            document = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring the transport cost table %s: %s", path, e)
        return {}
    if not isinstance(document, dict) or document.get("schema_version") != SCHEMA_VERSION:
        logger.warning("ignoring the transport cost table %s: unknown schema", path)
        return {}
    if document.get("machine_id") != topology.machine_id():
        logger.warning("ignoring the transport cost table %s: it was measured on another machine", path)
        return {}
    costs = {}
    for name, entry in (document.get("costs") or {}).items():
        try:
            fixed, bandwidth = float(entry["fixed_us"]), float(entry["bandwidth_gbps"])
        except (KeyError, TypeError, ValueError):
            logger.warning("ignoring the malformed cost entry %r in %s", name, path)
            continue
        if fixed >= 0 and bandwidth > 0:
            costs[name] = CostEstimate(fixed_us=fixed, bandwidth_gbps=bandwidth)
    return costs
