from __future__ import annotations

import pytest

from tensorwire.transport.agent.wire import decode_peer, encode_peer, messages
from tensorwire.transport.config import Config
from tensorwire.transport.contract import DeviceInfo, PeerInfo


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_INLINE_NBYTES", "1024")
    monkeypatch.setenv("TENSORWIRE_TRANSPORT", " host ")
    monkeypatch.setenv("TENSORWIRE_TIMEOUT_S", "2.5")
    config = Config.from_env()
    assert (config.inline_max_nbytes, config.transport, config.timeout_s) == (1024, "host", 2.5)


@pytest.mark.parametrize(
    ("name", "value"),
    [("TENSORWIRE_TIMEOUT_S", "soon"), ("TENSORWIRE_TIMEOUT_S", "-1"), ("TENSORWIRE_INLINE_NBYTES", "1.5")],
)
def test_config_rejects_bad_values(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        Config.from_env()


def test_peer_round_trips_through_protobuf():
    peer = PeerInfo(
        agent_id="a",
        node_id="n",
        machine_id="m",
        hostname="h",
        pid=12,
        start_time=34,
        unix_address="unix:/x",
        tcp_address="127.0.0.1:5",
        transports=("shm", "host"),
        devices=(DeviceInfo("cpu", 0), DeviceInfo("cuda", 1, uuid="GPU-1", pci_bus_id="0000:01:00.0")),
    )
    data = encode_peer(peer).SerializeToString()
    assert decode_peer(messages["Peer"].FromString(data)) == peer


def test_malformed_bytes_raise_decode_error():
    from google.protobuf.message import DecodeError

    with pytest.raises(DecodeError):
        messages["HolderBatch"].FromString(b"\xff\xff\xff\xff")
