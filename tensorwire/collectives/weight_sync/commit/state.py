"""The push's version state in the driver: one object, with named phases.

``version`` is the last version pushed (or being pushed), ``committed`` the last one the
receivers hold (all-or-none: every live receiver; ``commit="each"``: at least one). A push
moves through :class:`Phase`:

* ``IDLE``: no push running;
* ``PUSHING``: a try of ``version`` runs; on failure every receiver keeps what it had;
* ``PROMISED``: in place (``aside="none"``), the receivers voted to write ``version`` into
  their tensors: from here the push only goes forward (a lost trainer is replaced, a failure
  leaves receivers ``TORN`` till the next push, never rolled back).

Receivers found dead are kept in ``dead`` (left out of later pushes until removed).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Phase", "PushState"]


class Phase(enum.Enum):
    IDLE = "idle"
    PUSHING = "pushing"
    PROMISED = "promised"


@dataclass
class PushState:
    """The driver's version state of one sync (see the module doc)."""

    version: int = 0
    committed: int = 0
    phase: Phase = Phase.IDLE
    dead: set[int] = field(default_factory=set)

    def start(self) -> int:
        """A new push: the next version, a first try."""
        self.version += 1
        self.phase = Phase.PUSHING
        return self.version

    def first_try(self) -> None:
        """A first try of a version (a push, or a late joiner's catch-up): nothing promised yet."""
        self.phase = Phase.PUSHING

    def promise(self) -> None:
        """In place: the receivers voted to write the version (only forward from here)."""
        self.phase = Phase.PROMISED

    @property
    def promised(self) -> bool:
        """Whether the receivers voted to write the version being pushed, in place."""
        return self.phase is Phase.PROMISED

    def finish(self, *, committed: bool) -> None:
        """The push ended (``committed``: the receivers hold its version now)."""
        if committed:
            self.committed = self.version
        self.phase = Phase.IDLE
