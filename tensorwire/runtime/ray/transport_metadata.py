"""What tensorwire, as Ray's tensor transport, passes from a producer to readers through Ray:
:class:`TensorwireMetadata`, which travels as the object's state alone (Ray's list of shapes
and dtypes is made again from it where Ray reads it)."""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.experimental import TensorTransportMetadata

if TYPE_CHECKING:
    import torch

    from tensorwire.transport.contract import TensorMeta

__all__ = ["ShapesAndDtypes", "TensorwireMetadata"]


@dataclass
class TensorwireMetadata(TensorTransportMetadata):
    """What Ray passes from the producer to readers: shapes and dtypes (Ray's part) and the
    tensorwire object's state (descriptor with capability token, one-sided handles).

    It travels as the state alone: ``tensor_meta`` is a :class:`ShapesAndDtypes` made again
    from the state where Ray reads it.
    """

    state: bytes = b""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Producer (or the owner passing it on), when Ray pickles it: the state, the device
        and the tensor count only."""
        return _metadata_from_state, (self.state, self.tensor_device, len(self.tensor_meta))


def _metadata_from_state(state: bytes, device: str | None, count: int) -> TensorwireMetadata:
    """A reader's copy of :class:`TensorwireMetadata` (unpickling it); a value with no tensors
    has no state, and an empty list."""
    shapes: Any = ShapesAndDtypes(count, state=state) if count else []
    return TensorwireMetadata(tensor_meta=shapes, tensor_device=device, state=state)


class ShapesAndDtypes(collections.abc.Sequence):
    """Ray's ``tensor_meta`` of a tensorwire object: ``(torch.Size, torch.dtype)`` per tensor,
    made when Ray first reads one (it does to check ``set_target_for_ref`` buffers, or to
    allocate on a target device), from the object's tensor metadata (``metas``) or from its
    state (a reader's copy). A list of 1,024 sizes and dtypes took Ray about 2 ms to pickle
    and 1 ms to make and read again on every call (the 2-core VM), for nothing on most reads.
    """

    def __init__(self, count: int, *, metas: tuple[TensorMeta, ...] | None = None, state: bytes = b"") -> None:
        self._count, self._metas, self._state = count, metas, state
        self._made: list[tuple[torch.Size, torch.dtype]] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:  # an int gives a (size, dtype) pair, a slice a list of them
        return self._list()[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, ShapesAndDtypes)):
            return NotImplemented
        return self._list() == list(other)

    __hash__ = None  # type: ignore[assignment]  # a list's equality, a list's (lack of) hash

    def __repr__(self) -> str:
        return f"ShapesAndDtypes({self._list()!r})"

    def _list(self) -> list[tuple[torch.Size, torch.dtype]]:
        if self._made is None:
            import torch

            from tensorwire.runtime.refs.ref_state import RefState

            if not self._count:
                metas: tuple[TensorMeta, ...] = ()
            elif self._metas is not None:
                metas = self._metas
            else:
                metas = RefState.from_bytes(self._state).desc.metas
            self._made = [(torch.Size(m.shape), getattr(torch, m.dtype)) for m in metas]
        return self._made
