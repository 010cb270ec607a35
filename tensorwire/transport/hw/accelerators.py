"""Accelerator vendors: their Ray resource, visibility variables and how to read them.

One table entry per vendor; a vendor adds one entry. :func:`visible_ids` reads a vendor's
visibility variables the way its runtime does; ``None`` means "not restricted" (all devices).
The facts (Ray resource names, which vendors Ray lets a task request a fraction of) follow
Ray's accelerator-support page and accelerator managers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "VENDORS",
    "Vendor",
    "deciding_variable",
    "furiosa_partition",
    "parse_comma_list",
    "parse_furiosa",
    "parse_oneapi_selector",
    "parse_ranges",
    "visible_ids",
]

Parser = Callable[[str], "list[str] | None"]


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


_FURIOSA_TOKEN = re.compile(r"npu:(\d+)(?::(\d+)(?:-(\d+))?)?")


def furiosa_partition(token: str) -> tuple[int, tuple[int, ...]]:
    """One FuriosaAI ``npu:X[:Y[-Z]]`` token -> ``(X, PEs)``: device X, and the processing
    elements (PEs) Y..Z of it fused into one device (``()``: the whole device).

    ``"npu:1"`` -> ``(1, ())``; ``"npu:0:2"`` -> ``(0, (2,))``; ``"npu:0:0-3"`` -> ``(0, (0, 1, 2, 3))``.

    Raises:
        ValueError: ``token`` is not of that form, or its PE range is reversed.
    """
    match = _FURIOSA_TOKEN.fullmatch(token.strip())
    if match is None:
        raise ValueError(
            f"FuriosaAI device {token!r} is not npu:X (device X), npu:X:Y (PE Y of it) or npu:X:Y-Z (PEs Y to Z)"
        )
    device, first, last = match.groups()
    if first is None:
        return int(device), ()
    low, high = int(first), int(last if last is not None else first)
    if high < low:
        raise ValueError(f"FuriosaAI device {token!r}: PE range {low}-{high} is reversed")
    return int(device), tuple(range(low, high + 1))


def parse_furiosa(value: str) -> list[str]:
    """``"npu:0,npu:1:0-1"`` -> ``["0", "1:0-1"]`` (FuriosaAI ``npu:X[:Y[-Z]]`` tokens,
    checked by :func:`furiosa_partition`)."""
    ids = []
    for token in parse_comma_list(value):
        if not token.startswith("npu:"):
            raise ValueError(f"FuriosaAI device {token!r} in {value!r} does not start with 'npu:'")
        furiosa_partition(token)
        ids.append(token[len("npu:") :])
    return ids


_ONEAPI_BACKENDS = ("*", "level_zero", "opencl", "cuda", "hip", "native_cpu")
_ONEAPI_INDEX = re.compile(r"\d+(?:\.\d+){0,2}")


def parse_oneapi_selector(value: str) -> list[str] | None:
    """The Level Zero GPUs that ``ONEAPI_DEVICE_SELECTOR`` keeps; None: all of them.

    Accepted: accept-filters ``backend:device[,device...]`` separated by ``;``, with backend
    one of ``*``, ``level_zero``, ``opencl``, ``cuda``, ``hip``, ``native_cpu`` (any case).
    Only ``level_zero`` and ``*`` terms select Intel GPUs (torch's XPU devices come from
    Level Zero); the others are skipped. A device is an index ``N``, a sub-device ``N.M`` or
    ``N.M.K`` (kept as written, like ``ZE_AFFINITY_MASK``), ``*`` or ``gpu`` (every GPU:
    None), or ``cpu``/``fpga``/``acc`` (no GPU). Several terms add up, in order, without
    repeats. Examples: ``level_zero:0,1`` -> ``["0", "1"]``; ``*:1`` -> ``["1"]``;
    ``level_zero:gpu`` -> None; ``opencl:*`` -> ``[]``.

    Raises:
        ValueError: A term without ``backend:``, an unknown backend, or a form tensorwire does
            not interpret: discard filters (``!level_zero:1``), which need the device count,
            and ``N.*`` / ``*.*`` sub-device partitioning. Set ``ZE_AFFINITY_MASK`` instead.
    """
    ids: list[str] = []
    for term in (t.strip() for t in value.split(";")):
        if not term:
            continue
        if term.startswith("!"):
            raise ValueError(
                f"ONEAPI_DEVICE_SELECTOR={value!r}: tensorwire does not interpret discard filters ({term!r}); "
                "list the devices to keep, or set ZE_AFFINITY_MASK"
            )
        backend, colon, devices = term.partition(":")
        backend = backend.strip().lower()
        if not colon or backend not in _ONEAPI_BACKENDS:
            raise ValueError(
                f"ONEAPI_DEVICE_SELECTOR={value!r}: term {term!r} is not backend:devices "
                f"with backend one of {', '.join(_ONEAPI_BACKENDS)}"
            )
        if backend not in ("*", "level_zero"):
            continue  # an OpenCL, CUDA, HIP or CPU term selects no Level Zero GPU
        for device in parse_comma_list(devices.lower()):
            if device in ("*", "gpu"):
                return None
            if device in ("cpu", "fpga", "acc"):
                continue
            if not _ONEAPI_INDEX.fullmatch(device):
                raise ValueError(
                    f"ONEAPI_DEVICE_SELECTOR={value!r}: tensorwire does not interpret device {device!r} "
                    "(it reads N, N.M, N.M.K, *, gpu, cpu, fpga, acc); set ZE_AFFINITY_MASK instead"
                )
            if device not in ids:
                ids.append(device)
    return ids


@dataclass(frozen=True)
class Vendor:
    """One kind of accelerator.

    Attributes:
        name: Our name for the vendor's device family.
        resource: The Ray resource name that schedules it.
        visibility_env: Variables that restrict the visible devices, highest precedence first.
        parse: Reads a visibility variable's value into device ids (None: all devices).
        torch_device: The torch device type, "" when torch has none.
        fractional: Whether Ray schedules fractions of one device (``num_gpus=0.5``); when
            False a task or actor asks for whole devices only.
        id_form: How one device is written in the visibility variable, "" for plain indices.
        env_parsers: Parsers for particular variables of ``visibility_env`` that are not
            written like the first (``(variable, parser)`` pairs); the others use ``parse``.
    """

    name: str
    resource: str
    visibility_env: tuple[str, ...]
    parse: Parser = parse_comma_list
    torch_device: str = ""
    fractional: bool = False
    id_form: str = ""
    env_parsers: tuple[tuple[str, Parser], ...] = ()

    def parser(self, variable: str) -> Parser:
        """How ``variable``'s value is read."""
        return dict(self.env_parsers).get(variable, self.parse)


VENDORS: dict[str, Vendor] = {
    v.name: v
    for v in (
        Vendor(
            "nvidia",
            "GPU",
            ("CUDA_VISIBLE_DEVICES",),
            torch_device="cuda",
            fractional=True,
            id_form="index, GPU-<uuid> or MIG-<uuid>",
        ),
        Vendor("amd", "GPU", ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"), torch_device="cuda", fractional=True),
        Vendor(
            "intel_gpu",
            "GPU",
            ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR"),
            torch_device="xpu",
            fractional=True,
            id_form="N or N.M (sub-device M of N); ONEAPI_DEVICE_SELECTOR as level_zero:N,...",
            env_parsers=(("ONEAPI_DEVICE_SELECTOR", parse_oneapi_selector),),
        ),
        Vendor("aws_neuron", "neuron_cores", ("NEURON_RT_VISIBLE_CORES",), parse=parse_ranges, id_form="N or N-M"),
        Vendor("google_tpu", "TPU", ("TPU_VISIBLE_CHIPS",), torch_device="xla"),
        Vendor("intel_gaudi", "HPU", ("HABANA_VISIBLE_MODULES",), torch_device="hpu"),
        Vendor("huawei_ascend", "NPU", ("ASCEND_RT_VISIBLE_DEVICES",), torch_device="npu", fractional=True),
        Vendor("rebellions", "RBLN", ("RBLN_DEVICES",)),
        Vendor("metax", "GPU", ("CUDA_VISIBLE_DEVICES",), torch_device="cuda", fractional=True),
        Vendor(
            "furiosa",
            "FURIOSA",
            ("FURIOSA_DEVICES",),
            parse=parse_furiosa,
            id_form="npu:X (device X), npu:X:Y (PE Y of it) or npu:X:Y-Z (PEs Y to Z fused)",
        ),
        Vendor("mobilint", "MBLT", ("QBRUNTIME_VISIBLE_DEVICES",)),
    )
}


def deciding_variable(vendor: Vendor, environ: Mapping[str, str] | None = None) -> str:
    """The first of ``vendor.visibility_env`` that is set ("" if none is)."""
    env = os.environ if environ is None else environ
    return next((variable for variable in vendor.visibility_env if variable in env), "")


def visible_ids(vendor: Vendor, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The device ids ``vendor``'s runtime lets this process see; None if not restricted.

    The first variable of ``vendor.visibility_env`` that is set decides (Intel GPU:
    ``ZE_AFFINITY_MASK``, else ``ONEAPI_DEVICE_SELECTOR``); an empty value means no device
    is visible.

    Raises:
        ValueError: The variable is set to something the vendor's runtime would reject, or
            to a form tensorwire does not interpret (the message says which and what to set).
    """
    env = os.environ if environ is None else environ
    variable = deciding_variable(vendor, env)
    if not variable:
        return None
    value = env[variable]
    if not value.strip():
        return []
    return vendor.parser(variable)(value)
