"""The transport layer: how a tensor's bytes get from one process to another (no Ray here)."""

from tensorwire.transport.contract import (
    Capabilities,
    CostEstimate,
    CostModel,
    DeviceInfo,
    FetchRequest,
    MemoryKind,
    ObjectDescriptor,
    PeerInfo,
    Placement,
    StoredObject,
    TensorKind,
    TensorMeta,
    Transport,
    TransportContext,
)
from tensorwire.transport.registry import (
    get_transport_class,
    register_transport,
    registered_transports,
    unregister_transport,
)

__all__ = [
    "Capabilities",
    "CostEstimate",
    "CostModel",
    "DeviceInfo",
    "FetchRequest",
    "MemoryKind",
    "ObjectDescriptor",
    "PeerInfo",
    "Placement",
    "StoredObject",
    "TensorKind",
    "TensorMeta",
    "Transport",
    "TransportContext",
    "get_transport_class",
    "register_transport",
    "registered_transports",
    "unregister_transport",
]
