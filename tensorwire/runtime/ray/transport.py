"""tensorwire as a Ray tensor transport: ``@ray.method(tensor_transport="tensorwire")``.

Registered through Ray's public extension point for custom tensor transports
(``ray.experimental.register_tensor_transport`` with a ``TensorTransportManager``). Ray
does the bookkeeping (which process holds which object, reference counting, passing the
metadata to readers, ``ray.get`` / ``ray.wait``, freeing); tensorwire moves the bytes:

* **Producer** (:meth:`TensorwireTransport.extract_tensor_transport_metadata`, when the
  method returns or on ``ray.put(..., _tensor_transport="tensorwire")``): the tensors Ray
  found in the value become one tensorwire object of this process (kept by reference, as
  Ray's transports do; values up to the inline size travel inside the metadata, copied at
  return), its one-sided handles are exported, and the metadata Ray passes to readers carries
  the object's descriptor (with its capability token) and those handles.
* **Reader** (``recv_multiple_tensors`` in the actor the reference was passed to;
  ``fetch_multiple_tensors`` / ``wait_fetch_complete`` for ``ray.get``): tensorwire's selector
  picks the path the two processes share (inline for small values, shared memory or cma on one
  node, nixl or ucx across nodes, cuda_ipc or nccl between GPUs, host as the fallback) and
  records the choice and its reason in :func:`tensorwire.stats`. To Ray the transport is
  one-sided: the producer's actor threads take no part (two-sided paths such as host or nccl
  run in the producer's tensorwire agent threads).
* **Freeing** (``garbage_collect``): Ray calls it in the producer once every reference is
  gone; the object and what its transports registered are released.

Ray requires the registration in the process that creates the actors, before it creates
them: :func:`register` is called by ``tw.init()``, by ``tw.register_ray_transport()`` and by
``import tensorwire`` in a process that has already imported Ray.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import ray
from ray.experimental import TensorTransportManager
from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata, FetchRequest

from tensorwire.errors import OwnerDiedError, TransferAbortedError
from tensorwire.runtime.ray.errors import ProducerDiedError
from tensorwire.runtime.ray.transport_metadata import ShapesAndDtypes, TensorwireMetadata
from tensorwire.runtime.ray.transport_options import current_read_options, read_pool, take_hint

__all__ = ["DEVICES", "NAME", "ShapesAndDtypes", "TensorwireMetadata", "TensorwireTransport", "register"]

logger = logging.getLogger(__name__)

NAME = "TENSORWIRE"  # Ray upper-cases transport names; users write "tensorwire"
DEVICES = ["cpu", "cuda"]
_ACTOR_CHECK_TIMEOUT_S = 60.0  # the actor's system thread may be busy with a large read
_ABORT_MARK_TTL_S = 600.0  # an abort for a read that never comes is forgotten after this


@dataclass
class TensorwireCommunicator(CommunicatorMetadata):
    """Nothing to agree on before a read (tensorwire's peers find each other), but the
    caller's choice of transport for it ("" for none)."""

    transport: str = ""


@dataclass
class TensorwireFetch(FetchRequest):
    """A read started by :meth:`TensorwireTransport.fetch_multiple_tensors` on a tensorwire
    thread; :meth:`TensorwireTransport.wait_fetch_complete` waits for it."""

    future: Any = None


@dataclass
class _Published:
    """An object this process published through Ray, until Ray frees it."""

    metadata: TensorwireMetadata
    desc: Any  # its ObjectDescriptor


class TensorwireTransport(TensorTransportManager):
    """Ray's tensor transport manager for tensorwire (one instance per process, made by Ray;
    its methods may run on any of Ray's threads at once, so its tables are under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._published: dict[str, _Published] = {}
        self._aborted: dict[str, float] = {}  # object id -> when Ray aborted its read
        self._checked_actors: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def tensor_transport_backend(self) -> str:
        return NAME

    @staticmethod
    def is_one_sided() -> bool:
        """Readers pull: ``ray.get`` works in any process and Ray never asks the producer to send."""
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        """True: a read Ray aborts ends by its own deadline and raises; no actor need be killed."""
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """In the caller, before each call with ``tensor_transport="tensorwire"`` (Ray's thread
        of ``.remote()``; blocks for one call into the actor the first time per handle): makes
        sure the actor has the transport registered, so an actor created before the
        registration gets it now.

        Raises:
            ImportError: tensorwire cannot be imported in the actor's process.
        """
        from tensorwire.runtime.ray import surface as ray_surface

        if self._checked(actor):
            return True
        try:
            ray_surface.run_on_actor(actor, _register_here, timeout_s=_ACTOR_CHECK_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return True  # a dead or stuck actor: the call itself reports it
        except ray.exceptions.RayError as e:
            raise ImportError(
                f"tensor_transport='tensorwire': tensorwire cannot be loaded in actor {actor} ({e}); install it "
                "where the actor runs (the actor's runtime_env pip, or the cluster's image)"
            ) from e
        self._mark_checked(actor)
        return True

    # ------------------------------------------------------------------ producer

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> TensorwireMetadata:
        """In the producer, right after the method returns (its task thread) or in
        ``ray.put`` (the caller's thread): registers the tensors as one object and exports
        its handles. A retried task's second extraction returns the first object's metadata.

        Raises:
            ValueError, TypeError: A tensor tensorwire cannot move (naming the fix).
        """
        hint = take_hint(rdt_object)  # before the retry check: a retry's note goes too
        with self._lock:
            published = self._published.get(obj_id)
        if published is not None:
            return published.metadata
        tensors = _checked_tensors(rdt_object)
        if not tensors:
            _warn_no_tensors()
            return TensorwireMetadata(tensor_meta=[], tensor_device=None)
        from tensorwire.runtime.agent import agent as runtime_agent
        from tensorwire.runtime.refs.ref_state import RefState
        from tensorwire.runtime.refs.registering import register_tensors

        agent = runtime_agent()
        desc = register_tensors(tensors)
        try:
            handles = agent.export_handles(desc)
            desc = agent.described_now(desc)
            metadata = TensorwireMetadata(
                tensor_meta=ShapesAndDtypes(len(tensors), metas=desc.metas),
                tensor_device=tensors[0].device.type,
                state=RefState(desc, b"", handles, b"", hint).to_bytes(),
            )
        except BaseException:
            agent.free(desc)  # nothing would free it: Ray never learns of this object
            raise
        with self._lock:
            self._published[obj_id] = _Published(metadata, desc)
        return metadata

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        """In the producer once Ray's reference counting drops the object (its system thread,
        or inline in Ray's free callback for an object the driver put): frees it."""
        with self._lock:
            published = self._published.pop(obj_id, None)
        if published is not None:
            from tensorwire.runtime.agent import agent as runtime_agent

            runtime_agent().free(published.desc)

    def published_count(self) -> int:
        """Objects this process published through Ray and Ray has not freed yet."""
        with self._lock:
            return len(self._published)

    def send_multiple_tensors(
        self, tensors: list[Any], tensor_transport_metadata: Any, communicator_metadata: Any
    ) -> None:
        """Never called: reads are one-sided."""
        raise NotImplementedError("tensorwire reads are one-sided: Ray never asks the producer to send")

    # ------------------------------------------------------------------ reader

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> TensorwireCommunicator:
        """In the owner, under Ray's lock, before it sends a reader actor its read (never
        blocks): the first time per reader handle, queue the transport's registration in the
        reader ahead of the read (an actor created before the registration has none; Ray runs
        the two in order on the reader's system thread)."""
        if dst_actor is not None and not self._checked(dst_actor):
            from tensorwire.runtime.ray import surface as ray_surface

            ray_surface.start_on_actor(dst_actor, _register_here)
            self._mark_checked(dst_actor)
        return TensorwireCommunicator(transport=current_read_options().transport)

    def _checked(self, actor: Any) -> bool:
        with self._lock:
            try:
                return bool(self._checked_actors.get(actor))
            except TypeError:  # a handle that cannot be weakly referenced
                return False

    def _mark_checked(self, actor: Any) -> None:
        with self._lock, contextlib.suppress(TypeError):
            self._checked_actors[actor] = True

    def fetch_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> TensorwireFetch:
        """For ``ray.get`` (the caller's thread): starts the read on a tensorwire thread, so that
        several objects are read at once and ``ray.get(..., timeout=)`` is honoured; the
        thread's :func:`read_options` apply."""
        options = current_read_options()
        future = read_pool().submit(
            self._read,
            obj_id,
            tensor_transport_metadata,
            TensorwireCommunicator(transport=options.transport) if options.transport else communicator_metadata,
            target_buffers or options.target_buffers,
            options.device,
        )
        return TensorwireFetch(obj_id=obj_id, tensors=[], future=future)

    def wait_fetch_complete(self, fetch_request: Any, timeout: float = -1) -> list[Any]:
        """The tensors of a read :meth:`fetch_multiple_tensors` started.

        Raises:
            TimeoutError: Not done within ``timeout`` seconds (-1: wait for the read, which
                ends by its own deadline). The read's own errors.
        """
        if not isinstance(fetch_request, TensorwireFetch):
            return fetch_request.tensors
        try:
            return fetch_request.future.result(timeout=None if timeout is None or timeout < 0 else timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the read of object {fetch_request.obj_id} is not done within {timeout} s") from None

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        """In the reader (the actor's system thread for a task argument): the object's tensors,
        read through the selector (or the transport the caller or the producer chose), host
        tensors on pooled buffers unless ``target_buffers`` are given.

        Raises:
            TransferAbortedError: Ray aborted this read (before it started or while it ran).
            ValueError: ``target_buffers`` that do not match the object.
            tensorwire's errors of the read (``ObjectFreedError``...; a dead producer's
                ``OwnerDiedError`` as :class:`.errors.ProducerDiedError`, Ray's ``ActorDiedError`` too).
        """
        return self._read(obj_id, tensor_transport_metadata, communicator_metadata, target_buffers, None)

    def _read(
        self, obj_id: str, tensor_transport_metadata: Any, communicator_metadata: Any, target_buffers: Any, device: Any
    ) -> list[Any]:
        """:meth:`recv_multiple_tensors`, landing on ``device`` (None: where the producer had them)."""
        self._take_abort(obj_id)
        if not tensor_transport_metadata.tensor_meta:
            return []
        from tensorwire.runtime.agent import agent as runtime_agent
        from tensorwire.runtime.refs import placement
        from tensorwire.runtime.refs.ref_state import RefState

        state = RefState.from_bytes(tensor_transport_metadata.state)
        desc = state.desc
        if target_buffers:
            _check_buffers(target_buffers, desc.metas)
        try:
            tensors, _record = runtime_agent().fetch(
                desc,
                state.handles,
                dst=list(target_buffers) if target_buffers else None,
                targets=placement.targets(desc.metas, device),
                transport=getattr(communicator_metadata, "transport", "") or state.transport,
                pooled=True,  # host tensors on reused buffers: no page faults once one is idle again
            )
        except OwnerDiedError as e:  # as Ray's own transports say it: the producing actor died
            raise ProducerDiedError(str(e)) from e
        self._take_abort(obj_id)  # aborted while it ran: its result is dropped
        return tensors

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        """Ray gave up on a read of ``obj_id`` in this process (its error-monitor thread): the
        read in progress, or the next one to start, raises ``TransferAbortedError``."""
        now = time.monotonic()
        with self._lock:
            for old in [k for k, when in self._aborted.items() if now - when > _ABORT_MARK_TTL_S]:
                del self._aborted[old]
            self._aborted[obj_id] = now

    def _take_abort(self, obj_id: str) -> None:
        with self._lock:
            when = self._aborted.pop(obj_id, None)
        if when is not None and time.monotonic() - when <= _ABORT_MARK_TTL_S:
            raise TransferAbortedError(f"Ray aborted the read of object {obj_id}")


def _check_buffers(buffers: list[Any], metas: Any) -> None:
    """Buffers given with ``ray.experimental.set_target_for_ref`` match the object's tensors.

    Raises:
        ValueError: Another count, shape or dtype, or a non-contiguous buffer (naming its index).
    """
    from tensorwire.transport import metadata

    if len(buffers) != len(metas):
        raise ValueError(f"{len(buffers)} target buffers for an object of {len(metas)} tensors")
    for index, (buffer, meta) in enumerate(zip(buffers, metas, strict=True)):
        if tuple(buffer.shape) != tuple(meta.shape) or metadata.dtype_name(buffer.dtype) != meta.dtype:
            raise ValueError(
                f"target buffer {index} is {tuple(buffer.shape)} {buffer.dtype}; the tensor is "
                f"{tuple(meta.shape)} {meta.dtype}: give set_target_for_ref buffers of the value's shapes and dtypes"
            )
        if not buffer.is_contiguous():
            raise ValueError(f"target buffer {index} is not contiguous: pass a contiguous tensor")


def _checked_tensors(rdt_object: list[Any]) -> list[Any]:
    """The tensors Ray found in a method's value, ready to register (contiguous, detached).

    A state dict of 1,024 tensors comes here every step, so the usual tensor passes with a
    few cheap attribute reads (not ``device.type``: 0.8 us a call on the 2-core VM); the checks
    that name a problem run only for the unusual one.

    Raises:
        TypeError: A tensor tensorwire cannot move (sparse, quantized, nested).
        ValueError: A tensor on a device other than cpu and cuda.
    """
    import torch

    tensors = []
    strided = torch.strided
    for given in rdt_object:
        usual = (
            type(given) is torch.Tensor
            and (given.is_cpu or given.is_cuda)
            and given.layout is strided
            and not given.is_quantized
            and not given.is_nested
        )
        if not usual:
            _check_unusual(given)
        # a twin on the same memory: the object keeps that memory even if the caller later points
        # the tensor elsewhere (`set_`, `.data = `)
        tensor = given.detach()
        tensors.append(tensor if tensor.is_contiguous() else tensor.contiguous())
    return tensors


def _check_unusual(tensor: Any) -> None:
    """A value :func:`_checked_tensors` does not take at a glance: a torch tensor subclass on a
    device and layout tensorwire moves passes; anything else raises, naming the fix."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor_transport='tensorwire' moves torch tensors; Ray handed it a {type(tensor).__name__}")
    if tensor.device.type not in DEVICES:
        raise ValueError(
            f"tensor_transport='tensorwire' moves tensors on {' and '.join(DEVICES)}; this value holds one on "
            f"{tensor.device}: move it with .to('cpu') (or a GPU) first, or return it without tensor_transport"
        )
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise TypeError(
            f"tensor_transport='tensorwire' moves dense tensors; this value holds a {tensor.layout} "
            "tensor: convert it with .to_dense() first"
        )


_warned_no_tensors = False


def _warn_no_tensors() -> None:
    global _warned_no_tensors
    if not _warned_no_tensors:
        _warned_no_tensors = True
        warnings.warn(
            "a method with tensor_transport='tensorwire' (or @tw.method) returned a value holding no torch tensors: "
            "it travels through Ray's object store as usual; drop tensor_transport (or @tw.method) for such methods",
            UserWarning,
            stacklevel=2,
        )


def _register_here(_actor: Any = None) -> None:
    """In an actor (through Ray's developer hook): register the transport in this process
    if Ray did not (the actor existed before the registration)."""
    register()


_registered = False
_register_lock = threading.Lock()


def register() -> None:
    """Register tensorwire with Ray as the tensor transport ``"tensorwire"`` (idempotent).

    Call it before creating the actors that use it, in the process that creates them (Ray's
    rule for custom transports); ``tw.init()`` does, and so does ``import tensorwire`` in a
    process that has imported Ray already.
    """
    global _registered
    import torch

    with _register_lock:
        if _registered:
            return
        try:
            ray.experimental.register_tensor_transport(NAME, DEVICES, TensorwireTransport, torch.Tensor)
        except ValueError as e:
            if "already registered" not in str(e):
                raise
        _registered = True
