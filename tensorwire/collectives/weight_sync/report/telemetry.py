"""Per-pair telemetry of weight-sync pushes: who moved what to whom, over which transport.

A receiver reports every bucket it took in (:class:`..protocol.spec.BucketSpan`); the driver turns
them into per (source, destination, transport) pairs (:class:`PairStats`: bytes, buckets,
seconds, errors, retries, failovers) and a timeline of every bucket (:class:`PairSpan`), both in
the push's :class:`.summary.SyncReport`. The driver also adds each push's pairs to this
process's Prometheus totals (``tensorwire_sync_pair_{bytes,transfers,seconds,errors,retries,
failovers}_total``, labelled by
sync name, source, destination and transport) and ``SyncReport.plot`` draws the timeline.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensorwire.collectives.weight_sync.protocol.spec import ReceiveResult
from tensorwire.transport.agent import metrics

__all__ = ["PairSpan", "PairStats", "failover_pairs", "merged_pairs", "pairs_of", "plot_timeline", "record"]


@dataclass(frozen=True)
class PairStats:
    """One (source, destination, transport) pair in one push. ``errors``: failures of the
    push's members counted on each pair of the member that failed (a source or destination
    that died or failed); ``retries``: buckets read again after a failover (the push's try
    that completed it); ``failovers``: times this pair's source was replaced mid-push (its
    transport is then "-": the try it served did not complete)."""

    source: str
    destination: str
    transport: str
    nbytes: int = 0
    transfers: int = 0
    seconds: float = 0.0
    errors: int = 0
    retries: int = 0
    failovers: int = 0


@dataclass(frozen=True)
class PairSpan:
    """One bucket on a push's timeline: ``start_s`` after the push began, for ``seconds``."""

    source: str
    destination: str
    transport: str
    bucket: int
    start_s: float
    seconds: float
    nbytes: int


def pairs_of(
    results: Mapping[int, ReceiveResult],
    names: Mapping[int, str],
    started: float,
    failed: Sequence[str] = (),
    *,
    retry: bool = False,
) -> tuple[dict[tuple[str, str, str], PairStats], list[PairSpan]]:
    """Pairs and timeline of one try of a push. ``results``: receiver id -> what it did;
    ``names``: channel rank -> its name ("trainer 0", "receiver 2"); ``started``: the push's
    start (wall clock); ``failed``: names of members that failed or died; ``retry``: the try
    after a failover (its buckets count as retries)."""
    totals: dict[tuple[str, str, str], list[float]] = {}
    timeline = []
    for rid, result in results.items():
        destination = f"receiver {rid}"
        for span in result.spans:
            source = names.get(span.parent, f"member {span.parent}")
            row = totals.setdefault((source, destination, span.transport), [0, 0, 0.0])
            row[0] += span.nbytes
            row[1] += 1
            row[2] += span.seconds
            timeline.append(
                PairSpan(
                    source, destination, span.transport, span.bucket, span.start - started, span.seconds, span.nbytes
                )
            )
    errors = dict.fromkeys(totals, 0)
    for who in failed:
        mine = [key for key in totals if who in (key[0], key[1])] or [(who, "", "")]
        for key in mine:
            errors[key] = errors.get(key, 0) + 1
    pairs = {
        key: PairStats(*key, int(row[0]), int(row[1]), row[2], errors.get(key, 0), int(row[1]) if retry else 0)
        for key, row in totals.items()
    }
    for key, count in errors.items():
        pairs.setdefault(key, PairStats(*key, errors=count))
    timeline.sort(key=lambda s: (s.source, s.destination, s.start_s))
    return pairs, timeline


def merged_pairs(
    first: Mapping[tuple[str, str, str], PairStats], second: Mapping[tuple[str, str, str], PairStats]
) -> dict[tuple[str, str, str], PairStats]:
    """The pairs of both, the counts of a pair in both added."""
    result = dict(first)
    for key, b in second.items():
        a = result.get(key)
        result[key] = (
            b
            if a is None
            else PairStats(
                *key,
                a.nbytes + b.nbytes,
                a.transfers + b.transfers,
                a.seconds + b.seconds,
                a.errors + b.errors,
                a.retries + b.retries,
                a.failovers + b.failovers,
            )
        )
    return result


def failover_pairs(replaced: Mapping[tuple[str, str], int]) -> dict[tuple[str, str, str], PairStats]:
    """The pairs whose source was replaced: (trainer, receiver) -> how many times."""
    return {(src, dst, "-"): PairStats(src, dst, "-", failovers=n) for (src, dst), n in replaced.items()}


_lock = threading.Lock()
_totals: dict[tuple[str, str, str, str], list[float]] = {}  # (sync, source, destination, transport) -> totals


def record(sync: str, pairs: Mapping[tuple[str, str, str], PairStats]) -> None:
    """Add one push's pairs to this process's totals (what Prometheus is shown)."""
    with _lock:
        for (source, destination, transport), stats in pairs.items():
            row = _totals.setdefault((sync, source, destination, transport), [0, 0, 0.0, 0, 0, 0])
            row[0] += stats.nbytes
            row[1] += stats.transfers
            row[2] += stats.seconds
            row[3] += stats.errors
            row[4] += stats.retries
            row[5] += stats.failovers


def totals() -> dict[tuple[str, str, str, str], list[float]]:
    """(sync, source, destination, transport) -> [bytes, transfers, seconds, errors, retries,
    failovers] so far."""
    with _lock:
        return {key: list(row) for key, row in _totals.items()}


def _families() -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    labels = ["sync", "source", "destination", "transport"]
    families = [
        CounterMetricFamily("tensorwire_sync_pair_bytes", "Weight-sync bytes per pair", labels=labels),
        CounterMetricFamily("tensorwire_sync_pair_transfers", "Weight-sync buckets per pair", labels=labels),
        CounterMetricFamily("tensorwire_sync_pair_seconds", "Weight-sync fetch time per pair", labels=labels),
        CounterMetricFamily("tensorwire_sync_pair_errors", "Weight-sync member failures per pair", labels=labels),
        CounterMetricFamily(
            "tensorwire_sync_pair_retries", "Weight-sync buckets read again after a failover", labels=labels
        ),
        CounterMetricFamily("tensorwire_sync_pair_failovers", "Weight-sync sources replaced mid-push", labels=labels),
    ]
    for key, row in sorted(totals().items()):
        for family, value in zip(families, row, strict=True):
            family.add_metric(list(key), value)
    yield from families


metrics.add_collector(_families)


def plot_timeline(timeline: Sequence[PairSpan], path: str, title: str = "") -> None:
    """A PNG of every pair's buckets against time (needs matplotlib: the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("SyncReport.plot needs matplotlib: pip install 'tensorwire[plot]'") from e
    rows = sorted({(s.source, s.destination, s.transport) for s in timeline})
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.35 * max(1, len(rows))))
    colours = plt.get_cmap("tab10")
    transports = sorted({row[2] for row in rows})
    for y, row in enumerate(rows):
        bars = [(s.start_s * 1e3, s.seconds * 1e3) for s in timeline if (s.source, s.destination, s.transport) == row]
        ax.broken_barh(bars, (y - 0.4, 0.8), color=colours(transports.index(row[2]) % 10), edgecolor="black")
    ax.set_yticks(range(len(rows)), [f"{src} -> {dst} ({transport})" for src, dst, transport in rows])
    ax.set_xlabel("ms since the push began")
    ax.set_title(title or "weight sync: buckets per pair")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
