"""``Ref``: the user-visible reference to a value whose tensors stay with their owner.

A ``Ref`` is small: the object's descriptor (id, capability token, owner, tensor metadata),
the value's non-tensor skeleton, and the handles of one-sided transports. It can be pickled
(pickle or cloudpickle) and sent by any means; the bytes move only when someone calls
:func:`tensorwire.get`.

Lifetime: each live ``Ref`` object counts as a hold of its process on the object; pickling
pins the object until the receiving process has registered (see
:mod:`tensorwire.transport.agent`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from tensorwire.transport.agent import get_agent
from tensorwire.transport.base import ObjectDescriptor, TensorMeta

if TYPE_CHECKING:
    import torch

__all__ = ["Ref"]

_UNLOADED = object()


class Ref:
    """A reference to a value held by its owner process. Create with :func:`tensorwire.put`."""

    __slots__ = ("__weakref__", "_desc", "_handles", "_skeleton", "_skeleton_bytes")

    def __init__(
        self,
        desc: ObjectDescriptor,
        skeleton_bytes: bytes,
        handles: dict[str, bytes],
        skeleton: Any = _UNLOADED,
        *,
        pin_id: bytes = b"",
    ) -> None:
        self._desc = desc
        self._skeleton_bytes = skeleton_bytes
        self._handles = handles
        self._skeleton = skeleton
        agent = get_agent()
        agent.ref_attached(desc, pin_id or b"")
        finalizer = weakref.finalize(self, agent.ref_detached, desc)
        finalizer.atexit = False

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

    def _single(self, what: str) -> TensorMeta:
        from tensorwire.runtime.values import Slot

        if self.num_tensors != 1 or not isinstance(self._load_skeleton(), Slot):
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

    def _load_skeleton(self) -> Any:
        if self._skeleton is _UNLOADED:
            import pickle

            self._skeleton = pickle.loads(self._skeleton_bytes)
        return self._skeleton

    def __repr__(self) -> str:
        return f"Ref(id={self.object_id[:12]}, tensors={self.num_tensors}, nbytes={self.nbytes})"

    # ------------------------------------------------------------------ pickling

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        agent = get_agent()
        handles = self._handles
        if self._desc.owner.agent_id == agent.peer.agent_id:
            handles = agent.export_handles(self._desc)
        pin_id = agent.ref_pickled(self._desc)
        return (_rebuild, (self._desc, self._skeleton_bytes, handles, pin_id))


def _rebuild(desc: ObjectDescriptor, skeleton_bytes: bytes, handles: dict[str, bytes], pin_id: bytes) -> Ref:
    return Ref(desc, skeleton_bytes, handles, pin_id=pin_id)
