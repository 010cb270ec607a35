"""User functions that travel by value inside a push's spec.

A push's spec is pickled with the C pickler (tens of times faster than cloudpickle on the
thousands of small records of a large plan). That pickler writes a function as a reference,
its module and name, so a function defined in the user's script (``__main__``) or inside
another function does not exist where the trainers and receivers unpickle it. Each user
function is therefore wrapped in :class:`ByValue` just before pickling: the wrapper pickles
its function with cloudpickle (by value where the function's module cannot be imported on the
other side, as Ray does for remote functions) and unpickles as the bare function, so the
member's spec holds the function itself and the rest of the spec keeps the C pickler's speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle

__all__ = ["ByValue", "by_value"]


class ByValue:
    """A function that pickles through cloudpickle and unpickles as itself."""

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        return cloudpickle.loads, (cloudpickle.dumps(self.function),)


def by_value(value: object) -> object:
    """``value`` wrapped in :class:`ByValue` when it is a callable; anything else (a method's
    name, ``None``) as it is."""
    return ByValue(value) if callable(value) else value
