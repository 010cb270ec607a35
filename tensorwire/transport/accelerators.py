"""Accelerator vendors: their Ray resource, visibility variable and how to read it.

One table entry per vendor; a vendor adds one entry. :func:`visible_ids` reads a vendor's
visibility variable the way its runtime does; ``None`` means "not restricted" (all devices).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["VENDORS", "Vendor", "parse_comma_list", "parse_furiosa", "parse_ranges", "visible_ids"]


def parse_comma_list(value: str) -> list[str]:
    """``"0,1, 3"`` -> ``["0", "1", "3"]`` (tokens kept as strings: UUIDs and MIG ids too)."""
    return [token.strip() for token in value.split(",") if token.strip()]


def parse_ranges(value: str) -> list[str]:
    """``"0-3,6"`` -> ``["0", "1", "2", "3", "6"]`` (AWS Neuron core ranges)."""
    ids: list[str] = []
    for token in parse_comma_list(value):
        if "-" in token:
            low, high = token.split("-", 1)
            if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
                raise ValueError(f"bad device range {token!r} in {value!r}")
            ids.extend(str(i) for i in range(int(low), int(high) + 1))
        else:
            ids.append(token)
    return ids


def parse_furiosa(value: str) -> list[str]:
    """``"npu:0,npu:1:0-1"`` -> ``["0", "1:0-1"]`` (FuriosaAI ``npu:N[:cores]`` tokens)."""
    ids = []
    for token in parse_comma_list(value):
        if not token.startswith("npu:"):
            raise ValueError(f"FuriosaAI device {token!r} in {value!r} does not start with 'npu:'")
        ids.append(token[len("npu:") :])
    return ids


@dataclass(frozen=True)
class Vendor:
    """One kind of accelerator.

    Attributes:
        name: Our name for the vendor's device family.
        resource: The Ray resource name that schedules it.
        visibility_env: Variables that restrict the visible devices, highest precedence first.
        parse: Reads a visibility variable's value into device ids.
        torch_device: The torch device type, "" when torch has none.
    """

    name: str
    resource: str
    visibility_env: tuple[str, ...]
    parse: Callable[[str], list[str]] = parse_comma_list
    torch_device: str = ""


VENDORS: dict[str, Vendor] = {
    v.name: v
    for v in (
        Vendor("nvidia", "GPU", ("CUDA_VISIBLE_DEVICES",), torch_device="cuda"),
        Vendor("amd", "GPU", ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"), torch_device="cuda"),
        Vendor("intel_gpu", "GPU", ("ZE_AFFINITY_MASK",), torch_device="xpu"),
        Vendor("aws_neuron", "neuron_cores", ("NEURON_RT_VISIBLE_CORES",), parse=parse_ranges),
        Vendor("google_tpu", "TPU", ("TPU_VISIBLE_CHIPS",), torch_device="xla"),
        Vendor("intel_gaudi", "HPU", ("HABANA_VISIBLE_MODULES",), torch_device="hpu"),
        Vendor("huawei_ascend", "NPU", ("ASCEND_RT_VISIBLE_DEVICES",), torch_device="npu"),
        Vendor("rebellions", "RBLN", ("RBLN_DEVICES",)),
        Vendor("metax", "GPU", ("CUDA_VISIBLE_DEVICES",), torch_device="cuda"),
        Vendor("furiosa", "FURIOSA", ("FURIOSA_DEVICES",), parse=parse_furiosa),
        Vendor("mobilint", "MOBILINT", ("QBRUNTIME_VISIBLE_DEVICES",)),
    )
}


def visible_ids(vendor: Vendor, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The device ids ``vendor``'s runtime lets this process see; None if not restricted.

    The first variable of ``vendor.visibility_env`` that is set decides; an empty value means
    no device is visible.

    Raises:
        ValueError: The variable is set to something the vendor's runtime would reject.
    """
    env = os.environ if environ is None else environ
    for variable in vendor.visibility_env:
        if variable in env:
            return vendor.parse(env[variable])
    return None
