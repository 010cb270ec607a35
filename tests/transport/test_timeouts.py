"""Every timeout fires: one-sided copies included; bad timeouts are refused."""

from __future__ import annotations

import pytest
import torch

import tensorwire as tw
from tensorwire.transport.config import validate_timeout
from tests.helpers.tasks import digest

LARGE = 256 << 20  # no machine copies this in a millisecond


@pytest.mark.parametrize("bad", [0, -1, 0.0, float("nan"), float("inf"), "5", True, None])
def test_bad_timeouts_are_value_errors(agent, bad):
    ref = tw.put(torch.ones(4))
    if bad is None:
        assert torch.equal(tw.get(ref, timeout_s=bad), torch.ones(4))  # None: the default deadline
        return
    with pytest.raises(ValueError, match="timeout_s"):
        tw.get(ref, timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s"):
        tw.wait([ref], timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s"):
        agent.fetch(ref._desc, {}, dst=None, timeout_s=bad)


def test_validate_timeout_keeps_good_values():
    assert validate_timeout(2) == 2.0 and validate_timeout(0.25) == 0.25


def test_a_short_deadline_fires_on_a_large_shm_fetch(agent, worker):
    ref = worker.call("tests.helpers.tasks:put_filled", LARGE)  # exported: it left the worker
    assert "shm" in ref.state.handles
    with pytest.raises(tw.TransferTimeoutError):
        tw.get(ref, transport="shm", timeout_s=0.001)
    value = tw.get(ref, transport="shm", timeout_s=60)  # the same reference, a sane deadline
    assert value.numel() == LARGE and int(value[0]) == int(value[-1]) == 7


def test_a_short_deadline_fires_on_a_large_local_copy(agent):
    value = torch.full((LARGE,), 3, dtype=torch.uint8)
    ref = tw.put(value)
    out = torch.empty_like(value)
    with pytest.raises(tw.TransferTimeoutError):
        tw.get(ref, out=out, timeout_s=0.001)
    assert digest(tw.get(ref, out=out, timeout_s=60)) == digest(value)
