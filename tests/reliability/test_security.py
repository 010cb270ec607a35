"""Access control: capability tokens, cluster token, and secrets kept out of logs and errors."""

from __future__ import annotations

import importlib.util
import logging
import pickle
from dataclasses import replace

import pytest
import torch

import tensorwire as tw
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.refs.ref import Ref, RefState
from tensorwire.transport.agent.control import cluster_token


def test_another_objects_token_is_denied(worker):
    mine = tw.put(torch.randn(100_000))
    other = tw.put(torch.randn(100_000))
    borrowed = replace(mine._desc, token=other._desc.token)  # a real token, of another object
    forged = Ref(RefState(borrowed, mine._skeleton_bytes, {}, b""))
    for transport in ("host", "shm"):
        assert worker.call("tests.helpers.tasks:get_outcome", forged, transport=transport) == "PermissionDeniedError"
    assert worker.call("tests.helpers.tasks:get_error", mine) == "ok"


@pytest.mark.skipif(
    not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")),
    reason="NIXL is not installed: pip install 'tensorwire[nixl]' (or nixl-cu12)",
)
def test_nixl_handle_opens_only_with_its_objects_token_even_after_a_fetch(worker):
    """The consumer remembers handles it opened: a real handle with another token must still fail."""
    mine = tw.put(torch.randn(100_000))
    other = tw.put(torch.randn(100_000))
    assert worker.call("tests.helpers.tasks:get_transport", mine, transport="nixl")[1] == "nixl"  # opened, remembered
    handles = runtime_agent().export_handles(mine._desc)  # the real nixl handle
    assert handles.get("nixl")
    forged = Ref(RefState(replace(mine._desc, token=other._desc.token), mine._skeleton_bytes, handles, b""))
    assert worker.call("tests.helpers.tasks:get_outcome", forged, transport="nixl") == "PermissionDeniedError"
    assert worker.call("tests.helpers.tasks:get_transport", mine, transport="nixl")[1] == "nixl"


def test_missing_token_is_denied(worker):
    ref = tw.put(torch.randn(100_000))
    forged = Ref(RefState(replace(ref._desc, token=b""), ref._skeleton_bytes, {}, b""))
    assert worker.call("tests.helpers.tasks:get_error", forged, transport="host") == "PermissionDeniedError"


def test_tokens_never_reach_logs_or_error_messages(worker, caplog):
    caplog.set_level(logging.DEBUG, logger="tensorwire")
    ref = tw.put(torch.randn(100_000))
    secret_hexes = {ref._desc.token.hex(), cluster_token().decode()}
    texts = [repr(ref), repr(ref._desc), str(tw.stats())]
    worker.call("tests.helpers.tasks:get_digest", ref, transport="host")
    worker.call("tests.helpers.tasks:get_digest", pickle.loads(pickle.dumps(ref)), transport="shm")
    forged = Ref(RefState(replace(ref._desc, token=b"\x01" * 16), ref._skeleton_bytes, {}, b""))
    with pytest.raises(tw.PermissionDeniedError) as denied:
        tw.get(forged)  # same process: the local transport checks the token too
    texts.append(str(denied.value))
    tw.free(ref)
    with pytest.raises(tw.ObjectFreedError) as freed:
        tw.get(ref)
    texts.append(str(freed.value))
    texts.extend(record.getMessage() for record in caplog.records)
    for text in texts:
        for secret in secret_hexes:
            assert secret not in text
    for text in texts:  # the capability token as raw bytes, as repr() would show it
        assert repr(ref._desc.token)[2:-1] not in text
