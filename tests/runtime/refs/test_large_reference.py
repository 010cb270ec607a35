"""A value whose non-tensor part makes the reference large warns once per process."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import tensorwire as tw
from tensorwire.errors import LargeReferenceWarning
from tensorwire.runtime.refs import values
from tensorwire.transport.config import Config


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(values, "_large_warned", False)


def test_a_large_list_warns_once_with_its_size(fresh, agent):
    agent.set_config(dataclasses.replace(agent.config, ref_warn_nbytes=Config().ref_warn_nbytes))
    big = [7] * 1_500_000  # 2 bytes each pickled: about 2.9 MiB
    with pytest.warns(LargeReferenceWarning) as record:
        ref = tw.put({"ids": big, "w": torch.ones(4)})
    assert len(record) == 1
    message = str(record[0].message)
    size = len(ref._skeleton_bytes)
    assert "TENSORWIRE_REF_WARN_NBYTES=1048576" in message and "torch.tensor(a_list)" in message
    assert "2.9 MiB" in message, message
    assert f"({size} bytes" in message
    assert record[0].filename == __file__  # points at the caller's put
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        tw.put({"ids": big})
        tw.put(list(big))
    assert not [w for w in later if issubclass(w.category, LargeReferenceWarning)]
    assert tw.get(ref)["ids"] == big


def test_small_values_and_a_zero_limit_do_not_warn(fresh, agent):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tw.put({"config": list(range(1000)), "w": torch.zeros(1 << 20)})  # the tensor does not count
        agent.set_config(dataclasses.replace(agent.config, ref_warn_nbytes=0))
        tw.put([7] * 1_500_000)
    assert not [w for w in seen if issubclass(w.category, LargeReferenceWarning)]
    assert values._large_warned is False


def test_the_limit_is_a_setting(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_REF_WARN_NBYTES", "4096")
    assert Config.from_env().ref_warn_nbytes == 4096
    monkeypatch.setenv("TENSORWIRE_REF_WARN_NBYTES", "lots")
    with pytest.raises(ValueError, match="TENSORWIRE_REF_WARN_NBYTES='lots' is not an integer"):
        Config.from_env()
    monkeypatch.delenv("TENSORWIRE_REF_WARN_NBYTES")
    assert Config.from_env().ref_warn_nbytes == 1 << 20
