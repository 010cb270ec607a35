"""The per-peer connection step of one-sided transports: published once, loaded once per
producer on first use, failures not cached, forgotten with the peer."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from tensorwire.errors import TransportUnavailableError
from tensorwire.transport.agent.peer_setup import PeerSetup
from tensorwire.transport.contract import Capabilities, PeerInfo, Transport

ME = PeerInfo(agent_id="me", node_id="n", machine_id="m", hostname="h", pid=1, start_time=1)
OWNER = replace(ME, agent_id="owner", pid=2, transport_info=(("fake", "owner-info"),))


class _Context:
    def __init__(self) -> None:
        self.peer = ME
        self.published: list[tuple[str, str]] = []

    def publish_transport_info(self, transport: str, info: str) -> None:
        self.published.append((transport, info))


class Fake(Transport):
    name = "fake"
    capabilities = Capabilities(one_sided=True, same_process=False, same_node=True, cross_node=True, peer_setup=True)

    def __init__(self, context, fail: int = 0) -> None:
        super().__init__(context)
        self.loads: list[tuple[str, str]] = []
        self.fail = fail
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def connection_info(self) -> str:
        return "my-info"

    def load_peer(self, peer, info) -> None:
        self.entered.set()
        assert self.release.wait(30)
        if self.fail:
            self.fail -= 1
            raise OSError("metadata rejected")
        self.loads.append((peer.agent_id, info))

    def fetch(self, request, dst) -> None:
        raise AssertionError("not used")


def test_publish_and_load_once_per_peer():
    context = _Context()
    setup = PeerSetup(context)
    transport = Fake(context)
    assert setup.publish(transport) is None
    assert context.published == [("fake", "my-info")]
    for _ in range(3):
        setup.ensure(transport, OWNER)
    setup.ensure(transport, ME)  # this process: nothing to load
    assert transport.loads == [("owner", "owner-info")]
    assert setup.loaded("fake", "owner")
    setup.forget("owner")
    assert not setup.loaded("fake", "owner")
    setup.ensure(transport, OWNER)
    assert transport.loads == [("owner", "owner-info")] * 2


def test_concurrent_first_fetches_load_once():
    context = _Context()
    setup, transport = PeerSetup(context), Fake(context)
    transport.release.clear()
    threads = [threading.Thread(target=setup.ensure, args=(transport, OWNER)) for _ in range(4)]
    for t in threads:
        t.start()
    assert transport.entered.wait(30)
    transport.release.set()
    for t in threads:
        t.join(30)
    assert transport.loads == [("owner", "owner-info")]


def test_failures_are_clear_and_not_cached():
    context = _Context()
    setup, transport = PeerSetup(context), Fake(context, fail=1)
    with pytest.raises(
        TransportUnavailableError,
        match=r"fake: loading the connection info of agent owner failed: "
        r"OSError: metadata rejected",
    ):
        setup.ensure(transport, OWNER)
    setup.ensure(transport, OWNER)  # tried again, and now it loads
    assert transport.loads == [("owner", "owner-info")]
    silent = replace(OWNER, agent_id="silent", transport_info=())
    with pytest.raises(TransportUnavailableError, match="agent silent published no connection info"):
        setup.ensure(transport, silent)

    class Broken(Fake):
        def connection_info(self) -> str:
            raise RuntimeError("no NIC")

    assert setup.publish(Broken(context)) == "connection_info() failed: RuntimeError: no NIC"


def test_with_transport_info_replaces_only_that_transports_info():
    peer = replace(ME, transport_info=(("ucx", "cma,tcp"), ("nixl", "tw-h-1-ab")))
    newer = peer.with_transport_info("nixl", "tw-h-1-ab bWV0YQ==")
    assert dict(newer.transport_info) == {"ucx": "cma,tcp", "nixl": "tw-h-1-ab bWV0YQ=="}
    assert dict(peer.transport_info)["nixl"] == "tw-h-1-ab"  # the original is left as it was
    assert dict(ME.with_transport_info("nixl", "x").transport_info) == {"nixl": "x"}
