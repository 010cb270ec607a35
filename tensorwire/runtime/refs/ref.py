"""``Ref``: the user-visible reference to a value whose tensors stay with their owner.

A ``Ref`` is small: the object's descriptor (id, capability token, owner, tensor metadata),
the value's non-tensor skeleton, and the handles of one-sided transports. It can be pickled
(pickle or cloudpickle) and sent by any means; the bytes move only when someone calls
:func:`tensorwire.get`.

Results of ``@tw.method`` calls are Ray's own ``ObjectRef``s (Ray Direct Transport through
tensorwire's registered transport), not ``Ref``s.

Lifetime: each live direct ``Ref`` object counts as a hold of its process on the object;
pickling pins the object until the receiving process has registered (see
:mod:`tensorwire.transport.agent.core`).
"""

from __future__ import annotations

import pickle
import weakref
from typing import TYPE_CHECKING, Any

from tensorwire.errors import UnresolvedRefError
from tensorwire.runtime.agent import agent as runtime_agent
from tensorwire.runtime.refs import reading, repeats
from tensorwire.runtime.refs.ref_state import RefState, carries_value
from tensorwire.transport.contract import ObjectDescriptor, TensorMeta

if TYPE_CHECKING:
    import torch

    from tensorwire.runtime.refs.repeats import Remembered


__all__ = ["Ref", "RefState"]  # RefState: re-exported from .ref_state

_UNLOADED = object()


class Ref:
    """A reference to a value held by its owner process. Create with :func:`tensorwire.put`;
    fetch with :func:`tensorwire.get` or ``await ref``."""

    __slots__ = ("__weakref__", "_moved_by", "_skeleton", "_state")

    def __init__(self, state: RefState, skeleton: Any = _UNLOADED):
        self._state = state
        self._skeleton = skeleton
        self._moved_by = ""
        agent = runtime_agent()
        if state.travels_inline and state.desc.owner.agent_id != agent.peer.agent_id:
            return  # the bytes are in the state: nothing to hold at the owner
        agent.ref_attached(state.desc, state.pin_id)
        finalizer = weakref.finalize(self, agent.ref_detached, state.desc)
        finalizer.atexit = False

    # ------------------------------------------------------------------ resolution

    @property
    def state(self) -> RefState:
        """What the reference carries (the runtime reads it; users need not)."""
        return self._state

    @property
    def _desc(self) -> ObjectDescriptor:
        return self._state.desc

    @property
    def _handles(self) -> dict[str, bytes]:
        return self._state.handles

    @property
    def _skeleton_bytes(self) -> bytes:
        return self._state.skeleton_bytes

    @property
    def default_transport(self) -> str:
        """The transport the producer asked consumers to use ("" = automatic)."""
        return self._state.transport

    def skeleton(self) -> Any:
        """The value's structure with its tensors replaced by slots (unpickled once)."""
        if self._skeleton is _UNLOADED:
            self._skeleton = pickle.loads(self._state.skeleton_bytes)
        return self._skeleton

    def __await__(self) -> Any:
        return reading.get_async(self).__await__()

    # ------------------------------------------------------------------ metadata, no fetch

    @property
    def object_id(self) -> str:
        """The object's id as hex (never the capability token)."""
        return self._desc.object_id.hex()

    @property
    def metas(self) -> tuple[TensorMeta, ...]:
        """Shape, dtype, device and size of every tensor of the value, in slot order."""
        return self._desc.metas

    @property
    def num_tensors(self) -> int:
        return len(self._desc.metas)

    @property
    def nbytes(self) -> int:
        """Total bytes of the value's tensors."""
        return self._desc.nbytes

    @property
    def owner_node_id(self) -> str:
        return self._desc.owner.node_id

    @property
    def remembered(self) -> Remembered | int | None:
        """The last fetch of this reference's object into the caller's buffers, ready to run
        again, or the mark of the buffers it used (:mod:`.repeats`: kept per object, not per
        reference, so a reference received anew repeats too; the runtime's, users need not)."""
        return repeats.known(self._desc)

    def remember(self, known: Remembered | int | None) -> None:
        """Keep ``known`` as :attr:`remembered` (the runtime's, after a fetch into buffers)."""
        repeats.keep(self._desc, known)

    def mark_moved(self, transport: str) -> None:
        """Record that ``transport`` moved this reference's value here (read as :attr:`transport`)."""
        self._moved_by = transport

    def _single(self, what: str) -> TensorMeta:
        from tensorwire.runtime.refs.values import Slot

        if self.num_tensors != 1 or not isinstance(self.skeleton(), Slot):
            raise AttributeError(
                f"Ref.{what} exists only for a value that is a single tensor; this value holds "
                f"{self.num_tensors} tensor(s): use Ref.metas"
            )
        return self._desc.metas[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._single("shape").shape

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self._single("dtype").dtype)

    @property
    def device(self) -> str:
        return self._single("device").device

    @property
    def transport(self) -> str:
        """The transport that moved this reference's value into this process the last time
        it was fetched here ("" before any fetch)."""
        return self._moved_by

    def __getattr__(self, name: str) -> Any:
        # Only reached for names a Ref does not have: code that took the reference for its value.
        if name.startswith("_"):
            raise AttributeError(name)
        if hasattr(type(self), name):
            return object.__getattribute__(self, name)  # a property that raised: its own error again
        raise UnresolvedRefError(
            f"{name!r} was asked of a tensorwire reference (tw.Ref), not of its value: fetch the value with "
            "tw.get(ref), or pass the reference as an argument of a @tw.remote actor or task, "
            "which resolves it"
        )

    def __getitem__(self, key: Any) -> Any:
        raise UnresolvedRefError(
            f"a tensorwire reference (tw.Ref) was indexed with {key!r}: fetch the value first with tw.get(ref)"
        )

    def __iter__(self) -> Any:
        raise UnresolvedRefError("a tensorwire reference (tw.Ref) was iterated: fetch the value first with tw.get(ref)")

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        raise UnresolvedRefError("len() of a tensorwire reference (tw.Ref): fetch the value first with tw.get(ref)")

    def __repr__(self) -> str:
        desc = self._state.desc
        return f"Ref(id={desc.object_id.hex()[:12]}, tensors={len(desc.metas)}, nbytes={desc.nbytes})"

    # ------------------------------------------------------------------ pickling

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Ref, (self.outgoing_state(),))

    def outgoing_state(self) -> RefState:
        """The state for a copy of this reference that leaves the process: the owner exports
        one-sided handles first, and the object is pinned until the copy is received (unless
        its bytes travel inline)."""
        state = self._state
        agent = runtime_agent()
        handles, desc = state.handles, state.desc
        if desc.owner.agent_id == agent.peer.agent_id:
            handles = agent.export_handles(desc)
            desc = agent.described_now(desc)  # after the exports: what they published since put
        pin_id = b"" if carries_value(handles) else agent.ref_pickled(desc)
        return state._replace(desc=desc, handles=handles, pin_id=pin_id)
