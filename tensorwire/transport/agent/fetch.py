"""Fetch dispatch: the consumer's side of one fetch.

The selector ranks the transports that can move an object (its answer is memoised: it is a
pure function of its inputs); the dispatch tries them in order, falls back to the next one
when a transport fails (unless it was forced); :mod:`.destinations` decides what each
attempt fills and puts the tensors where they were asked for. Bytes that travel inside the
reference are the last resort when the owner lost them.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorwire.errors import (
    NoTransportError,
    ObjectFreedError,
    OwnerDiedError,
    PeerLostError,
    PermissionDeniedError,
    TensorwireError,
    TransferTimeoutError,
)
from tensorwire.transport import metadata, selector
from tensorwire.transport.agent import destinations
from tensorwire.transport.agent.instances import LoadedTransports
from tensorwire.transport.agent.metrics import TransferRecord
from tensorwire.transport.agent.peer_client import PeerClient
from tensorwire.transport.agent.repeat import Repeat
from tensorwire.transport.contract import (
    FetchRequest,
    ObjectDescriptor,
    PeerInfo,
)
from tensorwire.transport.host_pool import HostPool
from tensorwire.transport.hw import topology

__all__ = ["FetchDispatch", "hold_while_alive", "summarize"]

_MEMO_SIZE = 1024  # selector answers remembered


def summarize(
    desc: ObjectDescriptor, handles: dict[str, bytes], targets: Sequence[torch.device] | None
) -> selector.ObjectSummary:
    """What the selector needs to know about one fetch of ``desc``."""
    known = metadata.facts(desc.metas)
    return selector.ObjectSummary(
        nbytes=known.nbytes,
        memory=known.memory,
        exported=frozenset(handles),
        foreign_memory=known.foreign_memory,
        src_devices=known.src_devices,
        dst_devices=frozenset(topology.cuda_uuid(t.index or 0) for t in set(targets or ()) if t.type == "cuda"),
    )


class FetchDispatch:
    """Runs fetches for one agent through the transports the selector ranks (thread-safe).

    Args:
        transports: The agent's transports.
        client: The agent's peer client (exports on request, owner errors).
        peer: This process's peer description.
        costs: This machine's calibrated costs (``tensorwire bench --calibrate``), if any.
        hold: Makes the object stay alive while the given view tensors live.
        record: Called with the record of each fetch that succeeded.
        warn_once: Warns once per key (a fallback), then logs at debug level.
        pool: This process's host pool (pooled destinations).
    """

    def __init__(
        self,
        *,
        transports: LoadedTransports,
        client: PeerClient,
        peer: Callable[[], PeerInfo],
        costs: dict[str, Any],
        hold: Callable[[ObjectDescriptor, list[torch.Tensor]], None],
        record: Callable[[TransferRecord], None],
        warn_once: Callable[..., None],
        pool: HostPool,
    ) -> None:
        self._transports = transports
        self._client = client
        self._peer = peer
        self._costs = costs
        self._hold = hold
        self._record = record
        self._warn_once = warn_once
        self._pool = pool
        self._selections: dict[tuple[Any, ...], selector.Selection] = {}
        self._routes: dict[tuple[Any, ...], tuple[ObjectDescriptor, selector.Selection, list[str], list[str]]] = {}

    def select(self, owner: PeerInfo, summary: selector.ObjectSummary, forced: str) -> selector.Selection:
        """The selector's answer, memoised: it is a pure function of these inputs (and of the
        registry, whose changes reset the memo), and repeated fetches ask the same question."""
        key = (owner, summary, forced, self._transports.version)
        selection = self._selections.get(key)
        if selection is None:
            selection = selector.select(
                owner,
                self._peer(),
                summary,
                self._transports.capabilities,
                usable_here=frozenset(self._transports.names()),
                forced=forced,
                costs=self._costs,
                cost_models=self._transports.cost_models,
            )
            if len(self._selections) >= _MEMO_SIZE:
                self._selections.clear()
            self._selections[key] = selection
        return selection

    def fetch(
        self,
        desc: ObjectDescriptor,
        handles: dict[str, bytes],
        dst: Sequence[torch.Tensor | None] | None,
        targets: Sequence[torch.device] | None,
        forced: str,
        *,
        view: bool,
        pooled: bool,
        timeout_s: float,
        repeatable: bool = False,
    ) -> tuple[list[torch.Tensor], TransferRecord, Repeat | None]:
        """Consumer: the object's tensors, where they were asked for, how they came, and if
        ``repeatable`` the same fetch ready to run again (:meth:`_repeat`). ``AgentServices.fetch``
        documents the arguments; ``forced`` is the transport name or ""."""
        deadline = time.monotonic() + timeout_s
        selection, names, carriers = self._route(desc, handles, targets, forced)
        errors: list[str] = []
        for name in names:
            attempt = FetchRequest(
                desc.object_id, desc.token, desc.owner, desc.metas, desc.packed_nbytes, handles.get(name), deadline
            )
            start = time.perf_counter()
            try:
                if time.monotonic() >= deadline:
                    raise TransferTimeoutError(
                        f"fetch of object {desc.object_id.hex()} not started before its deadline ({timeout_s} s)"
                    )
                tensors, zero_copy, attempt = self._attempt(name, attempt, desc, dst, targets, view=view, pooled=pooled)
            except TensorwireError as e:
                self._on_failure(name, e, desc.owner, forced=forced, carriers=carriers)
                errors.append(f"{name}: {e}")
                continue
            moved = time.perf_counter()
            tensors = destinations.finish(tensors, dst, targets)
            record = TransferRecord(
                transport=name,
                reason=selection.reason if not errors else f"{name} after: {'; '.join(errors)}",
                nbytes=desc.nbytes,
                duration_s=moved - start,
                placed_s=time.perf_counter() - moved,
                src=desc.owner.agent_id,
                dst=self._peer().agent_id,
                zero_copy=zero_copy,
                failed_attempts=len(errors),
            )
            self._record(record)
            repeat = self._repeat(name, attempt, dst, record) if repeatable and not errors else None
            return tensors, record, repeat
        raise NoTransportError(f"every transport failed for object {desc.object_id.hex()}: {'; '.join(errors)}")

    def _route(
        self,
        desc: ObjectDescriptor,
        handles: dict[str, bytes],
        targets: Sequence[torch.device] | None,
        forced: str,
    ) -> tuple[selector.Selection, list[str], list[str]]:
        """The selection, the transports to try in order, and those whose bytes travel in the
        reference; remembered per descriptor (the same reference fetched again asks again)."""
        key = (id(desc), tuple(handles), tuple(targets) if targets else (), forced, self._transports.version)
        known = self._routes.get(key)
        if known is not None and known[0] is desc:
            return known[1:]
        selection = self.select(desc.owner, summarize(desc, handles, targets), forced)
        if not selection.choices:
            hint = " (forced by argument or TENSORWIRE_TRANSPORT)" if forced else ""
            raise NoTransportError(f"cannot fetch object {desc.object_id.hex()}{hint}: {selection.reason}")
        names = [c.transport for c in selection.choices]
        # Bytes that travel inside the reference stay readable when the owner no longer has
        # them (it does not track such objects once they left, even when the reference comes
        # back to it and the selector ranks "local" first): the last resort, forced or not.
        carriers = [
            n
            for n in handles
            if n != forced and n in self._transports and self._transports.capabilities[n].carries_value
        ]
        names += [n for n in carriers if n not in names]
        if len(self._routes) >= _MEMO_SIZE:
            self._routes.clear()
        self._routes[key] = (desc, selection, names, carriers)
        return selection, names, carriers

    def _attempt(
        self,
        name: str,
        request: FetchRequest,
        desc: ObjectDescriptor,
        dst: Sequence[torch.Tensor | None] | None,
        targets: Sequence[torch.device] | None,
        *,
        view: bool,
        pooled: bool,
    ) -> tuple[list[torch.Tensor], bool, FetchRequest]:
        """One transport's try: (tensors, whether they are zero-copy views, the request as it
        ran: with the handle the owner exported on request)."""
        instance, owner = self._transports[name], desc.owner
        if request.handle is None and instance.capabilities.needs_export:
            handle, info = self._client.export(request, name)
            request = request._replace(handle=handle)
            if info:  # as the owner publishes it now: newer than the reference's if it changed since
                owner = owner.with_transport_info(name, info)
        if instance.capabilities.peer_setup:
            self._transports.peer_setup.ensure(instance, owner)
        if view and instance.capabilities.zero_copy_view:
            tensors = instance.view(request)
            if instance.capabilities.needs_device_access:
                self._hold(desc, tensors)
            return tensors, True, request
        tensors, lease = destinations.prepare(
            desc.metas,
            desc.packed_nbytes,
            dst,
            targets,
            instance.capabilities,
            pool=None if view else self._pool,  # a view asked for and not possible: a plain copy, as before
            pooled=pooled,
            other_node=not owner.same_node(self._peer()),
        )
        try:
            instance.fetch(request, tensors)
        except BaseException:
            if lease is not None:
                lease.discard()  # a transport that failed may still be writing into it
            raise
        return tensors, False, request

    def _repeat(
        self,
        name: str,
        request: FetchRequest,
        dst: Sequence[torch.Tensor | None] | None,
        record: TransferRecord,
    ) -> Repeat | None:
        """The fetch ``request`` into ``dst`` that made ``record``, ready to run again; None
        where a repeat would skip more than the route: a view, or a buffer the transport did
        not fill itself."""
        instance = self._transports[name]
        if (
            record.zero_copy
            or dst is None
            or not destinations.fills_in_place(instance.capabilities, dst, len(request.metas))
        ):
            return None
        return Repeat(instance, request, record=record, notify=self._record)

    def _on_failure(
        self, name: str, error: TensorwireError, owner: PeerInfo, *, forced: str, carriers: list[str]
    ) -> None:
        """Raise ``error`` (mapped) unless the fetch may go on with the next transport.

        The object gone, or its owner: only bytes carried in the reference (``carriers``) may
        still help. A denied token
        or a passed deadline ends the fetch. Any other failure falls back to the next
        transport, unless the transport was forced.
        """
        if isinstance(error, (ObjectFreedError, OwnerDiedError, PeerLostError)):
            if carriers and name not in carriers:
                return
            if isinstance(error, PeerLostError):
                raise self._client.owner_error(owner, error) from error
            raise error
        if isinstance(error, (PermissionDeniedError, TransferTimeoutError)) or forced:
            raise error
        self._warn_once(f"fallback:{name}", "transport %s failed (%s); falling back to the next one", name, error)


def hold_while_alive(
    attach: Callable[[ObjectDescriptor], None], detach: Callable[[ObjectDescriptor], None]
) -> Callable[[ObjectDescriptor, list[torch.Tensor]], None]:
    """The ``hold`` of a dispatch: each view that maps the producer's own allocation counts
    as a reference of this process while it lives."""

    def hold(desc: ObjectDescriptor, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            attach(desc)
            weakref.finalize(tensor, detach, desc)

    return hold
