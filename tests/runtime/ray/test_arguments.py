"""Argument errors of the public runtime API (``runtime/api.py``, ``runtime/ray/actor.py``): each
bad call raises the named error with a message saying what was wrong; none needs Ray."""

from __future__ import annotations

import pytest
import torch

import tensorwire as tw
from tensorwire.runtime.ray.actor import _tw_hook


def test_get_and_wait_reject_what_they_cannot_take():
    refs = [tw.put(torch.ones(3)), tw.put(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"out has 1 entries for 2 refs"):
        tw.get(refs, out=[torch.empty(3)])
    with pytest.raises(TypeError, match="expects a Ref or a Ray ObjectRef \\(or a list of them\\), got int"):
        tw.get([refs[0], 5])
    with pytest.raises(TypeError, match=r"tensorwire\.wait expects a list of Refs or Ray ObjectRefs"):
        tw.wait([refs[0], "x"])
    with pytest.raises(ValueError, match=r"num_returns=3 must be between 0 and len\(refs\)=2"):
        tw.wait(refs, num_returns=3)
    ready, not_ready = tw.wait(refs, num_returns=2, timeout_s=5)  # direct references are ready at once
    assert (ready, not_ready) == (refs, [])
    assert [t.tolist() for t in tw.get(refs)] == [[1.0, 1.0, 1.0], [0.0, 0.0]]


def test_method_remote_and_passthrough_reject_bad_targets():
    with pytest.raises(TypeError, match="a transport name is a string, got int"):
        tw.method(transport=3)
    with pytest.raises(TypeError, match=r"@tw\.method decorates methods, got int"):
        tw.method(5)
    with pytest.raises(TypeError, match=r"tw\.passthrough wraps a Ref or a Ray ObjectRef, got list"):
        tw.passthrough([1])
    with pytest.raises(TypeError, match=r"use @tw.remote or @tw.remote\(\*\*ray_options\)"):
        tw.remote(lambda: 1, num_cpus=1)
    with pytest.raises(TypeError, match=r"@tw\.remote decorates classes and functions, got int"):
        tw.remote(num_cpus=1)(7)


def test_a_remote_function_must_be_called_with_remote():
    @tw.remote
    def double(x: int) -> int:
        return 2 * x

    with pytest.raises(TypeError, match=r"remote function double must be called with .remote\(...\)"):
        double(3)


def test_the_hidden_hook_runs_only_registered_hooks():
    from tensorwire.runtime.ray.hooks import HookKey, hook_key

    refused = [
        "os.system",  # not a key at all
        ("os", "system"),  # outside the package: never imported
        ("builtins", "eval"),
        ("tensorwire.collectives.groups.membership", "get_group"),  # a real function, but not registered as a hook
        ("tensorwire.collectives.nonexistent", "join"),
    ]
    for key in refused:
        with pytest.raises(ValueError, match="not a tensorwire hook"):
            _tw_hook(object(), key, "echo hi")
    from tensorwire.collectives.groups import membership as groups

    assert hook_key(groups.leave) == HookKey("tensorwire.collectives.groups.membership", "leave")
    assert _tw_hook(object(), ("tensorwire.collectives.groups.membership", "leave"), "no-such-group") is False  # it ran
    with pytest.raises(ValueError, match="not a registered actor hook"):
        hook_key(groups.get_group)
