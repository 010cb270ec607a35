"""Protobuf messages of the control service, built at import from the schema below.

The schema is declared here rather than compiled by ``protoc`` so that the package works
with any protobuf runtime from 4.25 on (generated code pins the runtime version). Only these
messages (and raw data chunks, copied byte for byte) are ever read from the network; nothing
received is unpickled.

Equivalent ``.proto``::

    message Device { string kind = 1; int32 index = 2; string uuid = 3; string pci_bus_id = 4; }
    message Peer { string agent_id = 1; string node_id = 2; string machine_id = 3;
                   string hostname = 4; int64 pid = 5; int64 start_time = 6;
                   string unix_address = 7; string tcp_address = 8;
                   repeated string transports = 9; repeated Device devices = 10;
                   repeated GpuLink gpu_links = 11; repeated TransportInfo transport_info = 12; }
    message GpuLink { string a = 1; string b = 2; string kind = 3; }
    message TransportInfo { string name = 1; string info = 2; }
    message PingRequest { Peer sender = 1; }
    message PingReply { Peer peer = 1; }
    message ObjectRequest { bytes object_id = 1; bytes token = 2; }
    message StatusReply { int32 state = 1; }            // ObjectState
    message HolderOp { int32 kind = 1; bytes object_id = 2; bytes token = 3; bytes pin_id = 4; }
    message HolderBatch { Peer sender = 1; repeated HolderOp ops = 2; int64 seq = 3; }  // seq: per sender and owner
    message HolderReply { int32 applied = 1; int32 rejected = 2; }
    message ExportReply { bytes handle = 1; string info = 2; }  // info: the transport's connection info now
    message TransferRequest { bytes object_id = 1; bytes token = 2; string transport = 3;
                              bytes params = 4; Peer sender = 5; }
    message ConnectRequest { string transport = 1; Peer sender = 2; bytes payload = 3; }
    message ConnectReply { bytes payload = 1; }
    message RendezvousRequest { string group = 1; string key = 2; bytes value = 3; }
    message RendezvousReply { }
    message TensorMeta { repeated int64 shape = 1; string dtype = 2; string device = 3; int64 nbytes = 4;
                         int64 offset = 5; string kind = 6; string device_uuid = 7; }
    message Handle { string transport = 1; bytes value = 2; }
    message Announcement { bytes object_id = 1; bytes token = 2; Peer owner = 3;
                           repeated TensorMeta metas = 4; int64 packed_nbytes = 5;
                           repeated Handle handles = 6; }
"""

from __future__ import annotations

import enum
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool

try:
    from google.protobuf.message_factory import GetMessageClass as _get_message_class
except ImportError:  # protobuf < 4.22
    from google.protobuf.message_factory import MessageFactory as _MessageFactory

    _get_message_class = _MessageFactory().GetPrototype  # type: ignore[assignment]

from tensorwire.transport.contract import DeviceInfo, ObjectDescriptor, PeerInfo, TensorKind, TensorMeta

__all__ = [
    "HolderOpKind",
    "ObjectState",
    "decode_announcement",
    "decode_peer",
    "encode_announcement",
    "encode_peer",
    "messages",
    "peer_from_bytes",
    "peer_to_bytes",
]

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64}

# message name -> [(field name, type, repeated)]; field numbers follow the order.
_SCHEMA: dict[str, list[tuple[str, str, bool]]] = {
    "Device": [
        ("kind", "string", False),
        ("index", "int32", False),
        ("uuid", "string", False),
        ("pci_bus_id", "string", False),
    ],
    "Peer": [
        ("agent_id", "string", False),
        ("node_id", "string", False),
        ("machine_id", "string", False),
        ("hostname", "string", False),
        ("pid", "int64", False),
        ("start_time", "int64", False),
        ("unix_address", "string", False),
        ("tcp_address", "string", False),
        ("transports", "string", True),
        ("devices", "Device", True),
        ("gpu_links", "GpuLink", True),
        ("transport_info", "TransportInfo", True),
    ],
    "GpuLink": [("a", "string", False), ("b", "string", False), ("kind", "string", False)],
    "TransportInfo": [("name", "string", False), ("info", "string", False)],
    "PingRequest": [("sender", "Peer", False)],
    "PingReply": [("peer", "Peer", False)],
    "ObjectRequest": [("object_id", "bytes", False), ("token", "bytes", False)],
    "StatusReply": [("state", "int32", False)],
    "HolderOp": [
        ("kind", "int32", False),
        ("object_id", "bytes", False),
        ("token", "bytes", False),
        ("pin_id", "bytes", False),
    ],
    "HolderBatch": [("sender", "Peer", False), ("ops", "HolderOp", True), ("seq", "int64", False)],
    "HolderReply": [("applied", "int32", False), ("rejected", "int32", False)],
    "ExportReply": [("handle", "bytes", False), ("info", "string", False)],
    "TransferRequest": [
        ("object_id", "bytes", False),
        ("token", "bytes", False),
        ("transport", "string", False),
        ("params", "bytes", False),
        ("sender", "Peer", False),
    ],
    "ConnectRequest": [("transport", "string", False), ("sender", "Peer", False), ("payload", "bytes", False)],
    "ConnectReply": [("payload", "bytes", False)],
    "RendezvousRequest": [("group", "string", False), ("key", "string", False), ("value", "bytes", False)],
    "RendezvousReply": [],
    "TensorMeta": [
        ("shape", "int64", True),
        ("dtype", "string", False),
        ("device", "string", False),
        ("nbytes", "int64", False),
        ("offset", "int64", False),
        ("kind", "string", False),
        ("device_uuid", "string", False),
    ],
    "Handle": [("transport", "string", False), ("value", "bytes", False)],
    "Announcement": [
        ("object_id", "bytes", False),
        ("token", "bytes", False),
        ("owner", "Peer", False),
        ("metas", "TensorMeta", True),
        ("packed_nbytes", "int64", False),
        ("handles", "Handle", True),
    ],
}

_PACKAGE = "tensorwire.control.v1"


class ObjectState(enum.IntEnum):
    """What an owner knows about an object id (``StatusReply.state``)."""

    UNKNOWN = 0
    LIVE = 1
    FREED = 2


class HolderOpKind(enum.IntEnum):
    """Holder bookkeeping sent from holders to owners (``HolderOp.kind``)."""

    REGISTER = 1  # this process now holds a reference (consumes pin_id if set)
    RELEASE = 2  # this process holds no reference any more
    PIN = 3  # a reference left this process in transit under pin_id
    UNPIN = 4  # the transit pin_id was consumed by a process that already holds


def _build() -> dict[str, Any]:
    proto = descriptor_pb2.FileDescriptorProto(name="tensorwire_control.proto", package=_PACKAGE, syntax="proto3")
    for message_name, fields in _SCHEMA.items():
        message = proto.message_type.add(name=message_name)
        for number, (field_name, type_name, repeated) in enumerate(fields, start=1):
            field = message.field.add(name=field_name, number=number)
            field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
            if type_name in _SCALARS:
                field.type = _SCALARS[type_name]
            else:
                field.type = _F.TYPE_MESSAGE
                field.type_name = f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: _get_message_class(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}")) for name in _SCHEMA}


messages: dict[str, Any] = _build()


def encode_peer(peer: PeerInfo) -> Any:
    """A ``Peer`` message for ``peer``."""
    return messages["Peer"](
        agent_id=peer.agent_id,
        node_id=peer.node_id,
        machine_id=peer.machine_id,
        hostname=peer.hostname,
        pid=peer.pid,
        start_time=peer.start_time,
        unix_address=peer.unix_address,
        tcp_address=peer.tcp_address,
        transports=list(peer.transports),
        devices=[
            messages["Device"](kind=d.kind, index=d.index, uuid=d.uuid, pci_bus_id=d.pci_bus_id) for d in peer.devices
        ],
        gpu_links=[messages["GpuLink"](a=a, b=b, kind=kind) for a, b, kind in peer.gpu_links],
        transport_info=[messages["TransportInfo"](name=n, info=i) for n, i in peer.transport_info],
    )


def decode_peer(message: Any) -> PeerInfo:
    """The :class:`PeerInfo` a ``Peer`` message describes."""
    return PeerInfo(
        agent_id=message.agent_id,
        node_id=message.node_id,
        machine_id=message.machine_id,
        hostname=message.hostname,
        pid=int(message.pid),
        start_time=int(message.start_time),
        unix_address=message.unix_address,
        tcp_address=message.tcp_address,
        transports=tuple(message.transports),
        devices=tuple(
            DeviceInfo(kind=d.kind, index=int(d.index), uuid=d.uuid, pci_bus_id=d.pci_bus_id) for d in message.devices
        ),
        gpu_links=tuple((link.a, link.b, link.kind) for link in message.gpu_links),
        transport_info=tuple((t.name, t.info) for t in message.transport_info),
    )


def peer_to_bytes(peer: PeerInfo) -> bytes:
    """``peer`` as a serialized ``Peer`` message (to hand through Ray, no pickle of ours)."""
    return encode_peer(peer).SerializeToString()


def peer_from_bytes(data: bytes) -> PeerInfo:
    """The :class:`PeerInfo` that :func:`peer_to_bytes` wrote."""
    message = messages["Peer"]()
    message.ParseFromString(data)
    return decode_peer(message)


def encode_announcement(desc: ObjectDescriptor, handles: dict[str, bytes]) -> bytes:
    """An object's descriptor and export handles as bytes (how collectives tell members
    what to fetch: the capability token travels, as in a reference, but no pickle)."""
    return messages["Announcement"](
        object_id=desc.object_id,
        token=desc.token,
        owner=encode_peer(desc.owner),
        metas=[
            messages["TensorMeta"](
                shape=list(m.shape),
                dtype=m.dtype,
                device=m.device,
                nbytes=m.nbytes,
                offset=m.offset,
                kind=m.kind.value,
                device_uuid=m.device_uuid,
            )
            for m in desc.metas
        ],
        packed_nbytes=desc.packed_nbytes,
        handles=[messages["Handle"](transport=name, value=value) for name, value in handles.items()],
    ).SerializeToString()


def decode_announcement(data: bytes) -> tuple[ObjectDescriptor, dict[str, bytes]]:
    """The descriptor and handles :func:`encode_announcement` wrote. Raises ``ValueError``
    for bytes that are not such a message."""
    message = messages["Announcement"]()
    try:
        message.ParseFromString(data)
        metas = tuple(
            TensorMeta(
                shape=tuple(int(n) for n in m.shape),
                dtype=m.dtype,
                device=m.device,
                nbytes=int(m.nbytes),
                offset=int(m.offset),
                kind=TensorKind(m.kind),
                device_uuid=m.device_uuid,
            )
            for m in message.metas
        )
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, or a bad enum value
        raise ValueError(f"malformed announcement: {e}") from None
    desc = ObjectDescriptor(
        message.object_id, message.token, decode_peer(message.owner), metas, int(message.packed_nbytes)
    )
    return desc, {h.transport: h.value for h in message.handles}
