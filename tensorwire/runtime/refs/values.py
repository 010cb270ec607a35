"""The value walker: split a nested value into a skeleton and its tensors, and join them again.

Walked containers: ``dict`` (and subclasses such as ``OrderedDict``, keeping their attributes,
e.g. a state dict's ``_metadata``), ``list``, ``tuple``, named tuples, dataclass instances, and
any type registered with torch's pytree utilities (``torch.utils._pytree.register_pytree_node``:
TensorDict registers itself), which arrives as the same type.
Leaves that are torch tensors, numpy arrays or DLPack producers (cupy, ...) become slots; every other leaf stays in the
skeleton as an ordinary Python value (pickled with the reference). A tensor that appears
twice (tied weights) becomes one slot and arrives as one tensor twice.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import pickle
import threading
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import torch

from tensorwire.errors import LargeReferenceWarning
from tensorwire.transport.contract import TensorKind

__all__ = [
    "DESCEND",
    "Slot",
    "TreeNode",
    "dumps_skeleton",
    "flatten",
    "map_container",
    "match_out",
    "rebuilder",
    "transform",
    "unflatten",
    "warn_large_skeleton",
]


class Slot:
    """Placeholder for the ``index``-th tensor of a value."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[type[Slot], tuple[int]]:
        return (Slot, (self.index,))

    def __repr__(self) -> str:
        return f"Slot({self.index})"


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def map_container(value: Any, fn: Callable[[Any, str], Any], path: str) -> Any:
    """``value`` with ``fn(child, child_path)`` applied to each child, or ``value`` itself if a leaf."""
    if isinstance(value, dict):
        new = copy.copy(value)
        for key in value:
            new[key] = fn(value[key], f"{path}[{key!r}]")
        return new
    if isinstance(value, list):
        new_list = copy.copy(value)
        new_list[:] = [fn(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return new_list
    if _is_namedtuple(value):
        return type(value)._make(fn(getattr(value, f), f"{path}.{f}") for f in value._fields)
    if isinstance(value, tuple):
        items = tuple(fn(item, f"{path}[{i}]") for i, item in enumerate(value))
        return items if type(value) is tuple else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        new_obj = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(new_obj, f.name, fn(getattr(value, f.name), f"{path}.{f.name}"))
        return new_obj
    if isinstance(value, TreeNode):
        return value.rebuilt([fn(child, f"{path}[{i}]") for i, child in enumerate(value.children)])
    node = _pytree_node(value)
    if node is not None:
        children, context = node.flatten_fn(value)
        return TreeNode(type(value), context, []).rebuilt([fn(c, f"{path}[{i}]") for i, c in enumerate(children)])
    return value


def _pytree_node(value: Any) -> Any:
    """torch's pytree registration of ``value``'s type (TensorDict, a user's container), if any."""
    if isinstance(value, (torch.Tensor, np.ndarray, str, bytes, int, float, type(None))):
        return None
    from torch.utils import _pytree

    return _pytree.SUPPORTED_NODES.get(type(value))


class TreeNode:
    """A container registered with torch's pytree utilities, held apart while its children
    are slots (a TensorDict accepts only tensors); it becomes its own type again as soon as
    its children allow, at the latest when the value is put back together."""

    __slots__ = ("children", "context", "node_type")

    def __init__(self, node_type: type, context: Any, children: list[Any]) -> None:
        self.node_type, self.context, self.children = node_type, context, children

    def rebuilt(self, children: list[Any]) -> Any:
        """The container around ``children``, or a ``TreeNode`` while it refuses them."""
        if not any(isinstance(c, (Slot, TreeNode)) for c in children):
            from torch.utils import _pytree

            try:
                return _pytree.SUPPORTED_NODES[self.node_type].unflatten_fn(children, self.context)
            except Exception:  # noqa: BLE001 - it does not take these children: stay apart
                pass
        return TreeNode(self.node_type, self.context, children)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (TreeNode, (self.node_type, self.context, self.children))


def _as_tensor(value: Any, path: str) -> torch.Tensor:
    """A contiguous, detached torch tensor sharing memory with ``value`` where possible."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.kind in "USVMm":
            raise TypeError(
                f"value{path}: numpy arrays of dtype {value.dtype} cannot be sent as tensors; "
                "convert to a numeric dtype or wrap the data in a plain Python object"
            )
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        if not value.flags.c_contiguous:
            value = value.copy(order="C")  # (np.ascontiguousarray would turn 0-d arrays into 1-d)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only arrays: we never write to them
                return torch.from_numpy(value)
        except TypeError as e:
            raise TypeError(f"value{path}: numpy dtype {value.dtype} is not supported by torch ({e})") from e
    tensor: torch.Tensor = value
    if tensor.layout != torch.strided:
        raise TypeError(f"value{path}: {tensor.layout} tensors are not supported; convert with .to_dense()")
    if tensor.is_quantized:
        raise TypeError(f"value{path}: quantized tensors are not supported; call .dequantize() or send int_repr()")
    if tensor.is_nested:
        raise TypeError(f"value{path}: nested tensors are not supported; unbind them into a list")
    if tensor.device.type == "meta":
        raise TypeError(f"value{path}: tensors on the meta device hold no data")
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter):
        tensor = tensor.data
    return tensor.contiguous()


DESCEND = object()  # returned by a ``transform`` leaf function: "not a leaf, walk into it"
_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None)})  # never leaves


def _only_atoms(items: Any) -> bool:
    """Whether every item of ``items`` is a number, string, bytes or None (one C-level pass)."""
    return set(map(type, items)) <= _ATOMS


def transform(value: Any, leaf: Callable[[Any, str], Any], path: str = "", _active: set[int] | None = None) -> Any:
    """``value`` rebuilt with ``leaf(item, path)`` for every item where it does not return
    :data:`DESCEND`; walked containers are rebuilt around the results.

    Plain recursion rather than a recursive closure: a closure that calls itself is a
    reference cycle, which would keep whatever it captured (tensors, references) alive
    until the garbage collector runs.

    ``leaf`` must return :data:`DESCEND` for numbers, strings, bytes and None: a plain list or
    tuple of nothing else is copied whole without a call per item (item by item, a list of
    1.5 M ints took seconds to walk).

    Raises:
        ValueError: The value contains a reference cycle.
    """
    result = leaf(value, path)
    if result is not DESCEND:
        return result
    if type(value) in (list, tuple) and _only_atoms(value):
        return value.copy() if type(value) is list else value
    active = _active if _active is not None else set()
    if id(value) in active:
        raise ValueError(f"value{path} refers back to a container that holds it (a reference cycle)")
    active.add(id(value))
    try:
        return map_container(value, lambda child, child_path: transform(child, leaf, child_path, active), path)
    finally:
        active.discard(id(value))


def _is_dlpack(item: Any) -> bool:
    """A DLPack producer other than torch and numpy (cupy, JAX, ...)."""
    return hasattr(item, "__dlpack__") and hasattr(item, "__dlpack_device__") and not isinstance(item, type)


def _kind(item: Any) -> TensorKind:
    if isinstance(item, torch.Tensor):
        return TensorKind.TORCH
    if isinstance(item, np.ndarray):
        return TensorKind.NUMPY
    return TensorKind.CUPY if type(item).__module__.split(".")[0] == "cupy" else TensorKind.DLPACK


def flatten(value: Any) -> tuple[Any, list[torch.Tensor], list[TensorKind]]:
    """Split ``value`` into ``(skeleton, tensors, kinds)``: torch tensors, numpy arrays and
    DLPack producers (cupy arrays, ...; taken without a copy through ``torch.from_dlpack``)
    become tensors, and ``kinds`` says which array type each was.

    Non-contiguous tensors are made contiguous (a copy); tensors are detached from autograd.

    Raises:
        TypeError: A tensor of an unsupported kind (sparse, quantized, nested, meta, object
            arrays), with the path to it.
        ValueError: The value contains a reference cycle.
    """
    tensors: list[torch.Tensor] = []
    kinds: list[TensorKind] = []
    slots_by_id: dict[int, tuple[Slot, Any]] = {}  # the original kept so that ids stay unique

    def leaf(item: Any, path: str) -> Any:
        if not isinstance(item, (torch.Tensor, np.ndarray)) and not _is_dlpack(item):
            return DESCEND
        known = slots_by_id.get(id(item))
        if known is not None:
            return known[0]
        slot = Slot(len(tensors))
        kind = _kind(item)
        if kind in (TensorKind.CUPY, TensorKind.DLPACK):
            try:
                tensor = torch.from_dlpack(item)
            except Exception as e:
                raise TypeError(f"value{path}: {type(item).__name__} could not be read through DLPack ({e})") from e
            tensors.append(_as_tensor(tensor, path))
        else:
            tensors.append(_as_tensor(item, path))
        kinds.append(kind)
        slots_by_id[id(item)] = (slot, item)
        return slot

    skeleton = transform(value, leaf)
    return skeleton, tensors, kinds


def rebuilder(skeleton: Any) -> Callable[[list[Any]], Any]:
    """A function that makes the value of ``skeleton`` from its leaves, as :func:`unflatten`
    does, for a value made again and again: a tensor or a list of tensors without a walk."""
    if isinstance(skeleton, Slot):
        index = skeleton.index
        return lambda leaves: leaves[index]
    if type(skeleton) is list and all(isinstance(item, Slot) for item in skeleton):
        indices = [item.index for item in skeleton]
        return lambda leaves: [leaves[i] for i in indices]
    return functools.partial(unflatten, skeleton)


def unflatten(skeleton: Any, leaves: list[Any]) -> Any:
    """``skeleton`` with every :class:`Slot` replaced by its leaf."""
    if type(skeleton) is list and all(isinstance(item, Slot) for item in skeleton):  # a list of tensors
        return [leaves[item.index] for item in skeleton]
    if type(skeleton) is dict and all(isinstance(item, Slot) for item in skeleton.values()):  # a state dict
        return {key: leaves[item.index] for key, item in skeleton.items()}
    return transform(skeleton, lambda item, _path: leaves[item.index] if isinstance(item, Slot) else DESCEND)


def match_out(skeleton: Any, out: Any) -> dict[int, Any]:
    """The user's ``out=`` buffers by slot index, matched by position in the structure.

    Raises:
        ValueError: ``out`` does not have the value's structure (the message names the path).
    """
    found = _match_flat(skeleton, out)
    if found is None:
        found = {}
        _match(skeleton, out, "", found)
    return found


def _match_flat(skeleton: Any, out: Any) -> dict[int, Any] | None:
    """:func:`match_out` of a plain list or dict of tensors (a state dict) in one pass; None for
    any other value, or when something does not match (the full walk then names the path)."""
    if type(skeleton) is list and isinstance(out, (list, tuple)) and len(out) == len(skeleton):
        pairs: Any = zip(skeleton, out, strict=True)
    elif type(skeleton) is dict and isinstance(out, dict) and skeleton.keys() <= out.keys():
        pairs = ((item, out[key]) for key, item in skeleton.items())
    else:
        return None
    found: dict[int, Any] = {}
    for item, target in pairs:
        if not isinstance(item, Slot) or not isinstance(target, (torch.Tensor, np.ndarray)):
            return None
        found.setdefault(item.index, target)
    return found


def _match(item: Any, target: Any, path: str, found: dict[int, Any]) -> None:
    if isinstance(item, Slot):
        if not isinstance(target, (torch.Tensor, np.ndarray)):
            raise ValueError(f"out{path}: expected a tensor to receive into, got {type(target).__name__}")
        found.setdefault(item.index, target)
        return
    if isinstance(item, dict):
        if not isinstance(target, dict):
            raise ValueError(f"out{path}: expected a dict, got {type(target).__name__}")
        for key, child in item.items():
            if key not in target:
                raise ValueError(f"out{path}: missing key {key!r}")
            _match(child, target[key], f"{path}[{key!r}]", found)
    elif isinstance(item, (list, tuple)):
        if not isinstance(target, (list, tuple)) or len(target) != len(item):
            raise ValueError(f"out{path}: expected a sequence of length {len(item)}, got {type(target).__name__}")
        for i, (child, sub) in enumerate(zip(item, target, strict=True)):
            _match(child, sub, f"{path}[{i}]", found)
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        for f in dataclasses.fields(item):
            _match(getattr(item, f.name), getattr(target, f.name, None), f"{path}.{f.name}", found)


class _HiddenTensorError(TypeError):
    pass


class _SkeletonPickler(cloudpickle.CloudPickler):
    """Pickles a skeleton; refuses tensors hidden in containers the walker does not open."""

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            raise _HiddenTensorError(
                f"a {type(obj).__name__} sits inside an object tensorwire does not walk (dict, list, tuple, named "
                "tuples, dataclasses and types registered with torch.utils._pytree.register_pytree_node are); move it "
                "into one of those, or register its type, so it travels by reference"
            )


_SLOT_BYTES: dict[int, bytes] = {}  # the pickled skeleton of a lone tensor (the common value), by index


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is only dicts, lists and tuples (exact types, keys atoms) of atoms and
    slots: such a skeleton pickles without a check per object (a 1.5 M-int list: 0.7 s less)."""
    kind = type(value)
    if kind in _ATOMS or kind is Slot:
        return True
    if depth > 32:
        return False
    if kind is dict:
        return _only_atoms(value) and all(_is_plain(v, depth + 1) for v in value.values())
    if kind is list or kind is tuple:
        return _only_atoms(value) or all(_is_plain(v, depth + 1) for v in value)
    return False


def dumps_skeleton(skeleton: Any) -> bytes:
    """Pickle ``skeleton`` (cloudpickle) or raise ``TypeError`` naming what cannot travel.
    A lone tensor's skeleton (one ``Slot``) is pickled once per index and reused."""
    if type(skeleton) is Slot:
        found = _SLOT_BYTES.get(skeleton.index)
        if found is None:
            found = _SLOT_BYTES[skeleton.index] = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
        return found
    if _is_plain(skeleton):  # nothing in it can hide a tensor: the C pickler alone
        return pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    buffer = io.BytesIO()
    try:
        _SkeletonPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(skeleton)
    except _HiddenTensorError:
        raise
    except Exception as e:
        raise TypeError(f"the value's non-tensor parts cannot be pickled: {type(e).__name__}: {e}") from e
    return buffer.getvalue()


_large_warned = False
_large_lock = threading.Lock()


def warn_large_skeleton(nbytes: int, limit_nbytes: int) -> None:
    """Warn (once per process) that a pickled skeleton of ``nbytes`` is over ``limit_nbytes``
    (0: never warn); later large values of this process pass silently."""
    global _large_warned
    if not limit_nbytes or nbytes <= limit_nbytes:
        return
    with _large_lock:
        if _large_warned:
            return
        _large_warned = True
    warnings.warn(
        f"this value's non-tensor part pickles to {nbytes / 2**20:.1f} MiB ({nbytes} bytes, over "
        f"TENSORWIRE_REF_WARN_NBYTES={limit_nbytes}): it travels inside every copy of the reference, "
        "through Ray with each call. Hold bulk data in tensors or numpy arrays (e.g. return "
        "torch.tensor(a_list) instead of the list) so it moves by reference. Warned once per process.",
        LargeReferenceWarning,
        stacklevel=3,
    )
