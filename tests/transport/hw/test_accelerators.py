"""Visibility variables of every vendor in the table, parsed as their runtimes do."""

from __future__ import annotations

import pytest

from tensorwire.transport.hw.accelerators import (
    VENDORS,
    deciding_variable,
    furiosa_partition,
    parse_oneapi_selector,
    visible_ids,
)

CASES = {
    "nvidia": ("CUDA_VISIBLE_DEVICES", "2, GPU-8f3c,MIG-1a", ["2", "GPU-8f3c", "MIG-1a"]),
    "amd": ("HIP_VISIBLE_DEVICES", "0,3", ["0", "3"]),
    "intel_gpu": ("ZE_AFFINITY_MASK", "0.1,1", ["0.1", "1"]),
    "aws_neuron": ("NEURON_RT_VISIBLE_CORES", "0-3,8", ["0", "1", "2", "3", "8"]),
    "google_tpu": ("TPU_VISIBLE_CHIPS", "0,1,2,3", ["0", "1", "2", "3"]),
    "intel_gaudi": ("HABANA_VISIBLE_MODULES", "4,5", ["4", "5"]),
    "huawei_ascend": ("ASCEND_RT_VISIBLE_DEVICES", "7", ["7"]),
    "rebellions": ("RBLN_DEVICES", "0,1", ["0", "1"]),
    "metax": ("CUDA_VISIBLE_DEVICES", "1", ["1"]),
    "furiosa": ("FURIOSA_DEVICES", "npu:0,npu:1:0-3", ["0", "1:0-3"]),
    "mobilint": ("QBRUNTIME_VISIBLE_DEVICES", "0", ["0"]),
}


def test_every_vendor_has_a_case():
    assert set(CASES) == set(VENDORS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_visibility_parsing(name):
    variable, value, expected = CASES[name]
    vendor = VENDORS[name]
    assert variable in vendor.visibility_env
    assert visible_ids(vendor, {variable: value}) == expected
    assert visible_ids(vendor, {}) is None  # unset: not restricted
    assert visible_ids(vendor, {variable: ""}) == []  # empty: nothing visible


def test_amd_precedence_and_bad_values():
    amd = VENDORS["amd"]
    assert visible_ids(amd, {"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0"}) == ["0"]
    assert visible_ids(amd, {"ROCR_VISIBLE_DEVICES": "1"}) == ["1"]
    with pytest.raises(ValueError, match="bad device range"):
        visible_ids(VENDORS["aws_neuron"], {"NEURON_RT_VISIBLE_CORES": "3-1"})
    with pytest.raises(ValueError, match="does not start with 'npu:'"):
        visible_ids(VENDORS["furiosa"], {"FURIOSA_DEVICES": "0"})


def test_torch_device_types():
    assert VENDORS["nvidia"].torch_device == "cuda"
    assert VENDORS["intel_gaudi"].torch_device == "hpu"
    assert VENDORS["huawei_ascend"].torch_device == "npu"
    assert VENDORS["rebellions"].torch_device == ""


def test_ray_resource_names():
    resources = {name: vendor.resource for name, vendor in VENDORS.items()}
    assert resources == {
        "nvidia": "GPU",
        "amd": "GPU",
        "intel_gpu": "GPU",
        "aws_neuron": "neuron_cores",
        "google_tpu": "TPU",
        "intel_gaudi": "HPU",
        "huawei_ascend": "NPU",
        "rebellions": "RBLN",
        "metax": "GPU",
        "furiosa": "FURIOSA",
        "mobilint": "MBLT",
    }


def test_fractional_resources():
    fractional = {name for name, vendor in VENDORS.items() if vendor.fractional}
    assert fractional == {"nvidia", "amd", "intel_gpu", "huawei_ascend", "metax"}
    whole_only = set(VENDORS) - fractional
    assert whole_only == {"aws_neuron", "google_tpu", "intel_gaudi", "rebellions", "furiosa", "mobilint"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("level_zero:0,1", ["0", "1"]),
        ("*:1", ["1"]),
        ("LEVEL_ZERO:2", ["2"]),
        ("level_zero:0.1, 1.0.1", ["0.1", "1.0.1"]),
        ("level_zero:0;level_zero:1,0", ["0", "1"]),  # terms add up, no repeats
        ("opencl:*;level_zero:3", ["3"]),  # only Level Zero terms select Intel GPUs
        ("opencl:*", []),
        ("cuda:0", []),
        ("level_zero:cpu", []),
        ("level_zero:*", None),
        ("*:gpu", None),
        ("level_zero:1;*:*", None),
    ],
)
def test_oneapi_device_selector(value, expected):
    assert parse_oneapi_selector(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0,1", "is not backend:devices"),
        ("vulkan:0", "is not backend:devices"),
        ("!level_zero:1", "does not interpret discard filters"),
        ("level_zero:0;!opencl:*", "does not interpret discard filters"),
        ("level_zero:0.*", "does not interpret device '0.\\*'"),
        ("level_zero:fast", "does not interpret device 'fast'"),
    ],
)
def test_oneapi_device_selector_rejects(value, message):
    with pytest.raises(ValueError, match=message) as raised:
        parse_oneapi_selector(value)
    assert f"ONEAPI_DEVICE_SELECTOR={value!r}" in str(raised.value)


def test_intel_gpu_reads_oneapi_selector_when_ze_affinity_mask_is_unset():
    intel = VENDORS["intel_gpu"]
    assert intel.visibility_env == ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")
    assert visible_ids(intel, {"ONEAPI_DEVICE_SELECTOR": "level_zero:0,1"}) == ["0", "1"]
    assert deciding_variable(intel, {"ONEAPI_DEVICE_SELECTOR": "level_zero:0,1"}) == "ONEAPI_DEVICE_SELECTOR"
    both = {"ZE_AFFINITY_MASK": "3", "ONEAPI_DEVICE_SELECTOR": "level_zero:0,1"}
    assert visible_ids(intel, both) == ["3"]  # the mask decides when set
    assert deciding_variable(intel, both) == "ZE_AFFINITY_MASK"
    assert visible_ids(intel, {"ONEAPI_DEVICE_SELECTOR": "level_zero:gpu"}) is None
    assert visible_ids(intel, {"ONEAPI_DEVICE_SELECTOR": ""}) == []
    assert deciding_variable(intel, {}) == ""


@pytest.mark.parametrize(
    ("token", "expected"),
    [("npu:1", (1, ())), ("npu:0:2", (0, (2,))), ("npu:0:0-3", (0, (0, 1, 2, 3))), ("npu:12:4-7", (12, (4, 5, 6, 7)))],
)
def test_furiosa_pe_form(token, expected):
    assert furiosa_partition(token) == expected


@pytest.mark.parametrize("value", ["npu:0:3-1", "npu:x", "npu:0:", "npu:0:1-", "npu:0:0:1"])
def test_furiosa_bad_tokens(value):
    with pytest.raises(ValueError, match="FuriosaAI device"):
        visible_ids(VENDORS["furiosa"], {"FURIOSA_DEVICES": value})


def test_furiosa_id_form_is_documented():
    assert "npu:X:Y" in VENDORS["furiosa"].id_form
    assert VENDORS["rebellions"].id_form == ""
