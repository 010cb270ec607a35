"""Functions that workers run (importable by spawned processes)."""

from __future__ import annotations

import hashlib
import operator
import pickle
from typing import Any

import numpy as np
import torch

import tensorwire as tw
from tensorwire.transport.packing import byte_view

_kept: dict[str, Any] = {}


def digest(value: Any) -> str:
    """A checksum of every tensor's bytes, dtype and shape, in structure order."""
    h = hashlib.sha256()

    def visit(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            h.update(f"T{tuple(item.shape)}{item.dtype}".encode())
            h.update(byte_view(item.detach().cpu().contiguous()).numpy().tobytes())  # device-independent
        elif isinstance(item, np.ndarray):
            h.update(f"N{item.shape}{item.dtype}".encode())
            h.update(np.ascontiguousarray(item).tobytes())
        elif isinstance(item, dict):
            for k in item:
                h.update(repr(k).encode())
                visit(item[k])
        elif isinstance(item, (list, tuple)):
            h.update(f"S{type(item).__name__}{len(item)}".encode())
            for x in item:
                visit(x)
        else:
            h.update(repr(item).encode())

    visit(value)
    return h.hexdigest()


def get_digest(ref: tw.Ref, **kwargs: Any) -> str:
    return digest(tw.get(ref, **kwargs))


def get_error(ref: tw.Ref, **kwargs: Any) -> str:
    """The class name of the error ``get`` raises, or "ok"."""
    try:
        tw.get(ref, **kwargs)
    except Exception as e:
        return type(e).__name__
    return "ok"


def usable_transports() -> list[str]:
    """The transports usable in this process."""
    from tensorwire.transport.agent.core import get_agent

    return sorted(get_agent().transports())


def get_transport(ref: tw.Ref, **kwargs: Any) -> tuple[str, str]:
    """(digest, transport used) of one get."""
    value = tw.get(ref, **kwargs)
    record = tw.stats()["recent"][-1]
    return digest(value), record.transport


def hold(ref: tw.Ref, name: str) -> int:
    """Keep ``ref`` alive in this process under ``name``."""
    _kept[name] = ref
    return ref.nbytes


def drop(name: str) -> None:
    _kept.pop(name, None)  # no gc.collect(): references must die by reference counting
    from tensorwire.transport.agent.core import get_agent

    get_agent().flush()


def get_into_out(ref: tw.Ref, transport: str = "") -> tuple[str, bool]:
    """Receive into preallocated buffers; (digest, whether the very buffers came back)."""
    out = [torch.zeros(m.shape, dtype=getattr(torch, m.dtype)) for m in ref.metas]
    if len(out) == 1:
        value = tw.get(ref, out=out[0], transport=transport)
        return digest(value), value is out[0]
    raise ValueError("get_into_out takes single-tensor refs")


def get_into_kept_out(name: str, ref: tw.Ref | None = None, **kwargs: Any) -> tuple[str, str, bool]:
    """Fetch the reference kept under ``name`` into the buffers kept with it, the same ones each
    time (given ``ref``: kept, fetched once without ``out``, copies of what came kept as the
    buffers and fetched into once): (the digest of what arrived or the error's class, the
    transport, whether the fetch was a repeat)."""
    if ref is not None:
        value = tw.get(ref, **kwargs)
        out = value.clone() if isinstance(value, torch.Tensor) else [t.clone() for t in value]
        _kept[name] = (ref, out)
        tw.get(ref, out=out, **kwargs)  # the buffers' first fetch: the next one is kept to repeat
    else:
        ref, out = _kept[name]
        try:
            value = tw.get(ref, out=out, **kwargs)
        except tw.TensorwireError as e:
            return type(e).__name__, "", False
        assert value is out if isinstance(out, torch.Tensor) else all(map(operator.is_, value, out))
    record = tw.stats()["recent"][-1]
    return digest(value), record.transport, record.repeated


def get_anew_into_kept_out(name: str, blob: bytes, **kwargs: Any) -> tuple[str, str, bool]:
    """:func:`get_into_kept_out` through a new reference each call, unpickled from ``blob`` (a
    consumer that gets its reference in a message): the same object into the same buffers."""
    ref, out = _kept[name]
    anew = pickle.loads(blob)
    assert anew is not ref
    _kept[name] = (anew, out)
    del ref
    return get_into_kept_out(name, **kwargs)


def refuse_shm_fetches(refuse: bool = True) -> None:
    """Make the shm transport's ``fetch`` refuse every fetch in this process (or serve again)."""
    from tensorwire.errors import TransportUnavailableError
    from tensorwire.transport.backends.shm.transport import ShmTransport

    def refused(self: Any, request: Any, dst: Any) -> None:
        raise TransportUnavailableError("shm: fetches refused by the test")

    if refuse:
        _kept["shm_fetch"] = _kept.get("shm_fetch", ShmTransport.fetch)
        ShmTransport.fetch = refused  # type: ignore[method-assign]
    elif "shm_fetch" in _kept:
        ShmTransport.fetch = _kept.pop("shm_fetch")  # type: ignore[method-assign]


def register_test_transport() -> list[str]:
    from tests.helpers.file_transport import register

    return register()


def put_and_return(nbytes: int, seed: int = 0) -> tuple[tw.Ref, str]:
    """Put a random uint8 tensor and keep it alive only through the returned reference."""
    value = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return tw.put(value), digest(value)


def cycle(ref: tw.Ref) -> int:
    """Get and drop: the sum of the bytes (a cheap check)."""
    value = tw.get(ref)
    return int(value.sum())


def flush() -> bool:
    from tensorwire.transport.agent.core import get_agent

    return get_agent().flush()


def pickled(name: str) -> bytes:
    """A kept reference, pickled in this process (as a holder forwarding it)."""
    import pickle

    return pickle.dumps(_kept[name])


def get_kept_error(name: str, **kwargs: Any) -> str:
    return get_error(_kept[name], **kwargs)


def free_ref(ref: tw.Ref) -> None:
    tw.free(ref)


def put_filled(nbytes: int, fill: int = 7) -> tw.Ref:
    """Put a large tensor cheaply (no checksum work)."""
    return tw.put(torch.full((nbytes,), fill, dtype=torch.uint8))


def get_digest_or_error(ref: tw.Ref, **kwargs: Any) -> str:
    try:
        return get_digest(ref, **kwargs)
    except tw.TensorwireError as e:
        return type(e).__name__


def get_many_digests(refs: list[tw.Ref]) -> list[str]:
    return [digest(v) for v in tw.get(refs)]


def get_counting_transfers(ref: tw.Ref, transport: str) -> tuple[str, int]:
    before = tw.stats()["transfers"].get(transport, {"count": 0})["count"]
    value = tw.get(ref, transport=transport)
    return digest(value), tw.stats()["transfers"][transport]["count"] - before


def view_and_write(ref: tw.Ref) -> dict[str, Any]:
    """A zero-copy view: write to it, then fetch again to show the write stayed private."""
    view = tw.get(ref, view=True)
    record = tw.stats()["recent"][-1]
    first = int(view[0])
    view[0] = -1
    again = tw.get(ref, view=True)
    return {"zero_copy": record.zero_copy, "first": first, "after_write": int(view[0]), "again": int(again[0])}


def get_outcome(ref: tw.Ref, **kwargs: Any) -> str:
    """The error class name of ``get``, or "ok via <transport>"."""
    try:
        tw.get(ref, **kwargs)
    except Exception as e:
        return type(e).__name__
    return "ok via " + tw.stats()["recent"][-1].transport


def get_concurrently(refs: list[tw.Ref], transport: str) -> list[str]:
    """Digests of ``refs`` fetched at once, one thread each."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(refs)) as pool:
        return list(pool.map(lambda r: get_digest(r, transport=transport), refs))


def two_sided_connections(transport: str) -> int:
    from tensorwire.transport.agent.core import get_agent

    return get_agent().transports()[transport].connections()


def forget_connections(transport: str) -> int:
    """Drop every connection of ``transport`` in this process (as after a peer loss)."""
    from tensorwire.transport.agent.core import get_agent

    instance = get_agent().transports()[transport]
    for agent_id in {c.peer.agent_id for c in (*instance._outgoing.values(), *instance._incoming.values())}:
        instance.forget_peer(agent_id)
    return instance.connections()


def ucx_active_transports() -> list[str]:
    from tensorwire.transport.agent.core import get_agent

    return get_agent().transports()["ucx"].worker().transports


class DLPackOnly:
    """A producer that offers its data only through DLPack (as cupy or JAX arrays do)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._tensor.__dlpack_device__()


def put_dlpack(n: int) -> tuple[tw.Ref, str]:
    tensor = torch.arange(n, dtype=torch.int64)
    return tw.put({"a": DLPackOnly(tensor)}), digest({"a": tensor})


def put_and_describe_owner(nbytes: int) -> dict[str, str]:
    """Put a value; the transport facts its reference carries about this process."""
    ref = tw.put(torch.zeros(nbytes, dtype=torch.uint8))
    return dict(ref._desc.owner.transport_info)


def put_value(value: Any) -> tw.Ref:
    """Put ``value`` in this worker and keep it alive as long as its reference."""
    return tw.put(value)


def get_into_file(path: str, ref: tw.Ref, **kwargs: Any) -> str:
    """Receive ``ref`` (one uint8 tensor) into the shared file ``path`` (see
    ``tests.helpers.inflight.SharedBuffer``); the digest of what arrived, or the error's class."""
    out = torch.from_file(path, shared=True, size=ref.nbytes, dtype=torch.uint8)
    try:
        tw.get(ref, out=out, **kwargs)
    except Exception as e:
        return type(e).__name__
    return digest(out)


def transfers_serving() -> int:
    return tw.stats()["transfers_serving"]


def agent_id() -> str:
    return tw.stats()["agent_id"]


def view_and_write_with(ref: tw.Ref, transport: str) -> dict[str, Any]:
    """:func:`view_and_write` with ``transport`` forced; adds the transport used."""
    view = tw.get(ref, view=True, transport=transport)
    record = tw.stats()["recent"][-1]
    first = int(view[0])
    view[0] = -1
    again = tw.get(ref, view=True, transport=transport)
    return {
        "zero_copy": record.zero_copy,
        "first": first,
        "after_write": int(view[0]),
        "again": int(again[0]),
        "transport": record.transport,
    }


def reference_facts(ref: tw.Ref, transport: str) -> dict[str, Any]:
    """What a received reference carries (handles, the owner's offered transports) and what a
    fetch with ``transport`` forced delivered."""
    state = ref.state
    value = tw.get(ref, transport=transport)
    return {
        "digest": digest(value),
        "transport": tw.stats()["recent"][-1].transport,
        "handles": sorted(state.handles),
        "offered": list(state.desc.owner.transports),
    }
