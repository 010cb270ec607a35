"""What each member of a weight-sync push is told, and what it answers (pure data).

The driver turns the plan's streams into a :class:`PushSpec` per member (:mod:`.assign`): for
each stream the member reads or serves, a :class:`Role` with its parent and children in the
stream's relay tree and its buckets of :class:`Region` s (a parameter index, a box of it, the
dtype on the wire). Trainers answer with a :class:`SendResult`, receivers with a
:class:`ReceiveResult`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from tensorwire.collectives.weight_sync.planning.layout import Box, ParamPiece

if TYPE_CHECKING:
    import torch

__all__ = ["BucketSpan", "PushSpec", "ReceiveResult", "Region", "Role", "SendResult"]


@dataclass(frozen=True, slots=True)
class Region:
    """One piece of a bucket, as one side sees it: ``box`` of its tensor ``param``."""

    param: int
    box: Box
    wire_dtype: str


@dataclass(frozen=True)
class Role:
    """One stream as one member sees it: who it reads from (-1: it is the server), whom it
    serves, its buckets, and the channel rank of the trainer it comes from."""

    stream: int
    parent: int
    children: tuple[int, ...]
    buckets: tuple[tuple[Region, ...], ...]
    slot_nbytes: int
    trainer: int = -1


@dataclass(frozen=True)
class PushSpec:
    """Everything one member needs for one push."""

    sync_id: str
    name: str
    version: int
    channel: str
    members: tuple[tuple[bytes, int], ...]
    rank: int
    where: str | None
    layout: tuple[ParamPiece, ...]
    roles: tuple[Role, ...]
    verify: bool
    transport: str
    timeout_s: float
    driver: bytes = b""
    shadow: bool = False  # receiver: assemble the version in shadow copies, published inside the fence
    publish: str = "copy"  # receiver with shadows: "copy" them into its tensors, or "swap" memory with them
    shadow_on_host: bool = False  # receiver with shadows: in host memory (pinned where CUDA is), not beside its tensors
    load: str | None = None  # receiver: its method taking (name, tensor) pairs, fed the shadows at commit
    fence: str | None = None
    scales: tuple[tuple[int, int], ...] = ()  # receiver: (float8 param, its scale param)
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    commit: str = "each"  # receiver: "all" (vote, commit on the driver's word) or "each" (on its own)
    deadline_s: float = 0.0  # the push's whole deadline (the driver decides a vote within it)
    on_commit: str | Callable[[object, int], None] | None = None  # receiver: run once per commit
    trainers: int = 0  # ranks below this are trainers
    stall_s: float = 0.0  # receiver: a trainer that sends no next bucket for this long stalled (0: adaptive)
    in_place: bool = False  # receiver, all-or-none without shadows: vote first, write inside the fence held till then
    voted: bool = False  # in place, a failover's next try: the driver said commit already (no second vote)
    published: tuple[int, ...] | None = None  # receiver: a subset push's parameters, the ones it publishes (None: all)


@dataclass(frozen=True)
class SendResult:
    """What one trainer did in a push.

    Attributes:
        rank: Its channel rank.
        pack_s: Time publishing buckets (the copy into shared memory, exports).
        checksum_s: Time computing bucket checksums (0 without ``verify``).
        seconds: Wall time of its part of the push.
        failed: Child rank -> why it was dropped from a stream.
        sent_nbytes: Bytes handed on (once per reader).
        in_place_nbytes: Of those, bytes its readers read straight out of its tensors (no staging copy).
        peak_nbytes: Most bytes it had staged at once.
    """

    rank: int
    pack_s: float
    checksum_s: float
    seconds: float
    failed: dict[int, str] = field(default_factory=dict)
    sent_nbytes: int = 0
    in_place_nbytes: int = 0
    peak_nbytes: int = 0


class BucketSpan(NamedTuple):
    """One bucket a receiver took in: from channel rank ``parent``, over ``transport``, from
    ``start`` (wall clock, seconds since the epoch) for ``seconds``."""

    parent: int
    bucket: int
    transport: str
    start: float
    seconds: float
    nbytes: int


@dataclass(frozen=True)
class ReceiveResult:
    """What one receiver did in a push.

    Attributes:
        rank: Its channel rank.
        version: The version it now holds.
        nbytes: Bytes it took in.
        transfer_s: Time fetching (the copy into its tensors included).
        unpack_s: Time copying what could not land directly (strided, converted).
        verify_s: Checksum time (0 without ``verify``).
        seconds: Wall time of its part of the push.
        transports: Transport -> buckets it fetched over it.
        relay_failed: Node-mate rank -> why its relay to it failed.
        peak_nbytes: Most bytes it had staged at once as a relay.
        committed: Whether it made ``version`` its own (all-or-none: not when the push aborted).
        refused: Why not (the driver's abort, or no word from it).
        spans: Every bucket it took in (:class:`BucketSpan`), for per-pair telemetry.
        aside_nbytes: Bytes it keeps aside for the sync (shadows, float8 staging).
    """

    rank: int
    version: int
    nbytes: int
    transfer_s: float
    unpack_s: float
    verify_s: float
    seconds: float
    transports: dict[str, int] = field(default_factory=dict)
    relay_failed: dict[int, str] = field(default_factory=dict)
    peak_nbytes: int = 0
    committed: bool = True
    refused: str = ""
    spans: tuple[BucketSpan, ...] = ()
    aside_nbytes: int = 0
