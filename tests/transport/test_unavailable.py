"""``TransportUnavailableError``: what a transport raises when asked for something it cannot
do here, with a message naming the transport and what is missing."""

from __future__ import annotations

import time

import pytest
import torch

import tensorwire as tw
from tensorwire.transport.contract import FetchRequest


def _request(ref: tw.Ref, handle: bytes | None) -> FetchRequest:
    desc = ref._desc
    return FetchRequest(
        desc.object_id, desc.token, desc.owner, desc.metas, desc.packed_nbytes, handle, time.monotonic() + 10
    )


def test_inline_fetch_of_a_reference_without_inline_data(agent):
    ref = tw.put(torch.arange(10, dtype=torch.int64))
    inline = agent.transports()["inline"]
    out = [torch.zeros(10, dtype=torch.int64)]
    with pytest.raises(tw.TransportUnavailableError, match="the reference carries no inline data"):
        inline.fetch(_request(ref, None), out)
    assert torch.equal(out[0], torch.zeros(10, dtype=torch.int64))  # nothing written
    assert isinstance(tw.TransportUnavailableError("x"), tw.TransportError)  # callers catch it as that


@pytest.mark.parametrize("name", ["shm", "inline", "local"])
def test_one_sided_transports_refuse_two_sided_calls(agent, name):
    transport = agent.transports()[name]
    with pytest.raises(tw.TransportUnavailableError, match=f"transport '{name}' is not two-sided"):
        transport.serve(None, b"")
    with pytest.raises(tw.TransportUnavailableError, match=f"transport '{name}' takes no connections"):
        transport.accept(agent.peer, b"")


def test_two_sided_transports_do_not_export_handles(agent):
    host = agent.transports()["host"]
    with pytest.raises(tw.TransportUnavailableError, match="transport 'host' does not export handles"):
        host.export(None)
