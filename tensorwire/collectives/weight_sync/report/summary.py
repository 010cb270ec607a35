"""What one weight-sync push did (:class:`SyncReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorwire.collectives.weight_sync.protocol.messages import ReceiverFailure
from tensorwire.collectives.weight_sync.protocol.spec import ReceiveResult
from tensorwire.collectives.weight_sync.report.telemetry import PairSpan, PairStats, plot_timeline

__all__ = ["SyncReport"]


@dataclass
class SyncReport:
    """What one :meth:`WeightSync.push` did.

    Attributes:
        version: The version pushed.
        nbytes: The largest receiver's bytes in the plan (M = 1 into replicas: the state size).
        buckets: Buckets over all streams.
        seconds: Wall time of the push, seen from the caller.
        pack_s: Slowest trainer's time publishing buckets (the copy into shared memory).
        transfer_s: Slowest receiver's time fetching (the copy into its tensors included).
        unpack_s: Slowest receiver's time copying what could not land directly (strided, converted).
        verify_s: Slowest receiver's checksum time (0 without ``verify``).
        receivers: Receiver id -> its :class:`ReceiveResult` (times, transports, bytes).
        failed: Receiver id -> why it does not hold this version.
        failure_kinds: Receiver id -> the kind of each entry of ``failed``
            (:class:`~..protocol.messages.ReceiverFailure`: left out, died, failed, not committed).
        peak_staging_nbytes: Most bytes any trainer had staged at once (about two buckets per stream).
        in_place_nbytes: Bytes the receivers read straight out of the trainers' tensors (no staging
            copy on the trainer; the rest was packed or converted into staging first).
        moved_nbytes: Bytes the receivers that completed took in (in the try that completed the
            push, after a failover).
        plan_nbytes: The plan's bytes for those receivers (what a push must move, and no more).
        kept_nbytes: Of those, bytes a try that a failover ended had delivered already: not
            read again (``moved_nbytes + kept_nbytes == plan_nbytes``).
        aside_nbytes: Most bytes a receiver keeps aside for the sync (shadows of an all-or-none
            or atomic commit, float8 staging; 0 with ``aside="none"`` and no float8).
        pairs: (source, destination, transport) -> :class:`.telemetry.PairStats` (bytes,
            buckets, seconds, errors), sources and destinations named "trainer i" / "receiver j".
        timeline: Every bucket a receiver that completed took in (:class:`.telemetry.PairSpan`).
        replaced: Trainer that died or stalled during the push -> why; the push completed from
            the others (failover), and the trainer is out of the sync.
        covered_nbytes: Of ``moved_nbytes``, bytes a cover read from the others in place of a
            trainer lost while the push ran (:mod:`..recovery.cover`; 0 when none was lost, or
            when the failover took a second try).
    """

    version: int
    nbytes: int
    buckets: int
    seconds: float
    pack_s: float
    transfer_s: float
    unpack_s: float
    verify_s: float
    receivers: dict[int, ReceiveResult] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    failure_kinds: dict[int, ReceiverFailure] = field(default_factory=dict)
    peak_staging_nbytes: int = 0
    in_place_nbytes: int = 0
    moved_nbytes: int = 0
    plan_nbytes: int = 0
    kept_nbytes: int = 0
    aside_nbytes: int = 0
    covered_nbytes: int = 0
    replaced: dict[str, str] = field(default_factory=dict)
    pairs: dict[tuple[str, str, str], PairStats] = field(default_factory=dict)
    timeline: list[PairSpan] = field(default_factory=list)

    def fail(self, receiver: int, kind: ReceiverFailure, why: str) -> None:
        """Record that ``receiver`` does not hold this version, and why."""
        self.failed[receiver] = why
        self.failure_kinds[receiver] = kind

    def plot(self, path: str) -> None:
        """Write a PNG timeline of every pair's buckets (needs matplotlib: ``tensorwire[plot]``):
        a slow link or rank stands out as a long row."""
        plot_timeline(self.timeline, path, title=f"weight sync v{self.version}: buckets per pair")

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def gbps(self) -> float:
        """Bytes delivered to the receivers per second, in GB/s."""
        return self.moved_nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        transports = sorted({t for r in self.receivers.values() for t in r.transports})
        text = (
            f"weight sync v{self.version}: {self.moved_nbytes / 2**20:.1f} MiB into {len(self.receivers)} receiver(s) "
            f"in {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s; {self.buckets} bucket(s) by "
            f"{', '.join(transports) or '-'}; pack {self.pack_s * 1e3:.1f} ms, "
            f"transfer {self.transfer_s * 1e3:.1f} ms, unpack {self.unpack_s * 1e3:.1f} ms"
        )
        if self.verify_s:
            text += f", verify {self.verify_s * 1e3:.1f} ms"
        text += ")"
        if self.failed:
            text += f"; FAILED: {self.failed}"
        return text
