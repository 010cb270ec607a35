"""Visibility variables of every vendor in the table, parsed as their runtimes do."""

from __future__ import annotations

import pytest

from tensorwire.transport.accelerators import VENDORS, visible_ids

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
