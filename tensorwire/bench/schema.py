"""The JSON document ``tensorwire bench --json`` writes, and its check.

Version 1::

    {"schema": "tensorwire-bench", "schema_version": 1, "created": "<ISO 8601 UTC>",
     "command": [...argv...], "machine": {...}, "versions": {...},
     "rows": [Row...], "fits": [Fit...]}

A row is one (scenario, method, size, tensors, peers) measurement; ``baseline`` tells an
alternative from tensorwire; ``vs_best_baseline`` is the best baseline's median time over this
row's (above 1: tensorwire is faster), for tensorwire rows that have a baseline in the run.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import socket
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tensorwire.bench.stats import bus_bandwidth, gbps, summarize

__all__ = ["SCHEMA", "SCHEMA_VERSION", "Fit", "Row", "document", "machine", "validate", "versions"]

SCHEMA = "tensorwire-bench"
SCHEMA_VERSION = 1


@dataclass
class Row:
    scenario: str  # p2p-processes, p2p-actors, many-tensors, one-to-n, concurrent
    method: str  # e.g. "tensorwire shm", "bare ucxx", "Ray object store"
    baseline: bool
    transport: str  # what carried the bytes ("" for baselines that do not say)
    reason: str  # the selector's reason, "forced", or how the baseline works
    nbytes: int  # bytes of the value (per receiver)
    tensors: int
    peers: int  # receivers (1 for point-to-point)
    iterations: int
    p50_us: float
    p99_us: float
    mean_us: float
    gbps: float  # algorithm bandwidth from the median: nbytes / p50
    busbw_gbps: float  # nccl-tests' bus bandwidth for the scenario's operation
    wrong: int  # iterations whose data did not match (-1: not checked)
    vs_best_baseline: float | None = None  # best alternative's p50 / this p50 (memcpy is not an alternative)
    vs_memcpy: float | None = None  # memcpy's p50 / this p50: the share of the one-node bound reached
    note: str = ""


@dataclass
class Fit:
    scenario: str
    method: str
    latency_us: float  # fixed cost per transfer
    bandwidth_gbps: float  # asymptotic rate
    sizes: list[int] = field(default_factory=list)


def machine() -> dict[str, Any]:
    """What ran the benchmark: host, CPU, cores, memory, GPUs."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = 0
    with contextlib.suppress(ValueError, OSError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA setup reports no GPU
        gpus = []
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "gpus": gpus,
        "os": platform.platform(),
    }


def versions() -> dict[str, str]:
    """Versions of Python and of the libraries whose speed is measured."""
    from importlib import metadata

    found = {"python": platform.python_version()}
    for package in ("tensorwire", "torch", "ray", "numpy", "ucxx-cu12", "ucxx-cu13", "libucx-cu12", "libucx-cu13"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found


def document(command: list[str], rows: list[Row], fits: list[Fit]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(command),
        "machine": machine(),
        "versions": versions(),
        "rows": [asdict(r) for r in rows],
        "fits": [asdict(f) for f in fits],
    }


_ROW_TYPES = {f.name: f.type for f in fields(Row)}
_NUMBERS = (int, float)


def validate(doc: Any) -> list[str]:
    """Problems with a bench document (empty: valid)."""
    if not isinstance(doc, dict):
        return ["the document is not an object"]
    problems = []
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    if doc.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"schema_version is {doc.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    for key in ("created", "machine", "versions", "rows", "fits", "command"):
        if key not in doc:
            problems.append(f"missing {key!r}")
    for index, row in enumerate(doc.get("rows", [])):
        if not isinstance(row, dict):
            problems.append(f"row {index} is not an object")
            continue
        missing = sorted(set(_ROW_TYPES) - set(row))
        if missing:
            problems.append(f"row {index} lacks {missing}")
            continue
        for name in ("nbytes", "tensors", "peers", "iterations", "wrong"):
            if not isinstance(row[name], int) or isinstance(row[name], bool):
                problems.append(f"row {index}: {name} is not an integer")
        for name in ("p50_us", "p99_us", "mean_us", "gbps", "busbw_gbps"):
            if not isinstance(row[name], _NUMBERS) or row[name] < 0:
                problems.append(f"row {index}: {name} is not a non-negative number")
        timed = isinstance(row["p50_us"], _NUMBERS) and isinstance(row["p99_us"], _NUMBERS)
        if timed and row["p99_us"] < row["p50_us"]:
            problems.append(f"row {index}: p99 below p50")
        if not isinstance(row["baseline"], bool):
            problems.append(f"row {index}: baseline is not a boolean")
    return problems


def make_row(
    scenario: str,
    method: str,
    result: dict,
    *,
    baseline: bool,
    nbytes: int,
    tensors: int = 1,
    peers: int = 1,
    transport: str = "",
    reason: str = "",
    operation: str = "p2p",
    rate: float | None = None,
) -> Row:
    """A row from a timed loop's result (``times`` in seconds, ``wrong``)."""
    summary = summarize(result["times"])
    algbw = rate if rate is not None else gbps(nbytes, summary.p50)
    return Row(
        scenario=scenario,
        method=method,
        baseline=baseline,
        transport=transport,
        reason=reason,
        nbytes=nbytes,
        tensors=tensors,
        peers=peers,
        iterations=summary.count,
        p50_us=summary.p50 * 1e6,
        p99_us=summary.p99 * 1e6,
        mean_us=summary.mean * 1e6,
        gbps=algbw,
        busbw_gbps=bus_bandwidth(operation, algbw, peers + 1),
        wrong=int(result.get("wrong", -1)),
    )
