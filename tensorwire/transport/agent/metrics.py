"""Transfer records and where they go: ``tensorwire.stats()``, Prometheus, Ray's metrics.

Every completed fetch produces one :class:`TransferRecord` (transport, the selector's reason,
bytes, duration, source and destination agents). The agent keeps recent ones for
``tensorwire.stats()``, adds each to this process's :data:`totals` and hands it to the
registered observers:

* Prometheus (when ``prometheus-client`` is installed): counters
  ``tensorwire_transfers_total`` and ``tensorwire_transfer_bytes_total`` and the histogram
  ``tensorwire_transfer_seconds``, labelled by transport, in prometheus-client's default
  registry (expose it with ``prometheus_client.start_http_server(port)``). They are read from
  :data:`totals` when scraped: a fetch takes no lock and calls no metric for them.
* More families from upper layers (:func:`add_collector`: weight sync's per-pair totals), in
  the same registry.
* Ray (in processes of a Ray cluster, added by the runtime): the same three through
  ``ray.util.metrics``, so they show on the Ray dashboard.

Observers never fail a transfer: their errors are logged and dropped.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

__all__ = [
    "BUCKETS",
    "Totals",
    "TransferRecord",
    "add_collector",
    "add_observer",
    "enable_prometheus",
    "notify",
    "observers",
    "remove_observer",
    "totals",
]

logger = logging.getLogger(__name__)

# upper bounds (seconds) of the duration histogram's buckets; the last bucket is +Inf
BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TransferRecord(NamedTuple):
    """One completed fetch, as :func:`tensorwire.stats` reports it."""

    transport: str
    reason: str
    nbytes: int
    duration_s: float
    src: str
    dst: str
    zero_copy: bool
    failed_attempts: int = 0  # transports tried before this one, which failed (fell back)
    placed_s: float = 0.0  # after the transfer: copying into the caller's buffers, moving to devices
    repeated: bool = False  # the same fetch into the same buffers again, nothing worked out again (agent/repeat.py)


class Totals:
    """Per transport: fetches, bytes, the sum of durations and the duration histogram, kept per
    thread (a fetch updates its own thread's numbers without a lock) and summed when read; a
    thread that ends has its numbers folded into the others'."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._tables: list[dict[str, list[float]]] = []  # each live thread's
        self._ended: dict[str, list[float]] = {}  # the threads' that ended
        self._lock = threading.RLock()  # for a thread's first record, its end, and reads

    def add(self, record: TransferRecord) -> None:
        table = getattr(self._local, "table", None)
        if table is None:
            table = self._local.table = {}
            self._local.alive = alive = _Alive()  # collected with the thread's locals when it ends
            with self._lock:
                self._tables.append(table)
            weakref.finalize(alive, self._fold, table)
        row = table.get(record.transport)
        if row is None:
            row = table[record.transport] = [0.0] * (3 + len(BUCKETS) + 1)
        row[0] += 1
        row[1] += record.nbytes
        row[2] += record.duration_s
        row[3 + bisect.bisect_left(BUCKETS, record.duration_s)] += 1

    def by_transport(self) -> dict[str, list[float]]:
        """transport -> [count, bytes, seconds, count per bucket (the last: above the top bound)]."""
        with self._lock:
            summed = {name: list(row) for name, row in self._ended.items()}
            tables = list(self._tables)
        for table in tables:
            _add_into(summed, table)
        return summed

    def _fold(self, table: dict[str, list[float]]) -> None:
        with self._lock:
            self._tables = [t for t in self._tables if t is not table]
            _add_into(self._ended, table)

    def reset(self) -> None:
        """Forget everything (a forked child starts from zero)."""
        self._local = threading.local()
        self._tables = []
        self._ended = {}
        self._lock = threading.RLock()


class _Alive:
    """A thread's marker in its locals: collected when the thread ends."""


def _add_into(summed: dict[str, list[float]], table: dict[str, list[float]]) -> None:
    for name, row in list(table.items()):
        into = summed.setdefault(name, [0.0] * len(row))
        for i, value in enumerate(row):
            into[i] += value


totals = Totals()
os.register_at_fork(after_in_child=totals.reset)

Observer = Callable[[TransferRecord], None]
_observers: tuple[Observer, ...] = ()  # replaced whole on a change: a fetch reads it without a lock
_collectors: tuple[Callable[[], Iterator[Any]], ...] = ()  # more metric families, for upper layers
_lock = threading.Lock()
_prometheus = False


def add_observer(observer: Observer) -> None:
    """Call ``observer(record)`` after every completed fetch in this process (idempotent)."""
    global _observers
    with _lock:
        if observer not in _observers:
            _observers = (*_observers, observer)


def remove_observer(observer: Observer) -> None:
    global _observers
    with _lock:
        _observers = tuple(o for o in _observers if o is not observer)


def observers() -> list[Observer]:
    return list(_observers)


def notify(record: TransferRecord) -> None:
    """Agent, after a fetch: add ``record`` to :data:`totals`, pass it to every observer; never raises."""
    totals.add(record)
    for observer in _observers:
        try:
            observer(record)
        except Exception:
            logger.debug("transfer observer %r failed", observer, exc_info=True)


def add_collector(families: Callable[[], Iterator[Any]]) -> None:
    """Also show ``families()`` (prometheus-client metric families, made when scraped) wherever
    :data:`totals` are exported to Prometheus (idempotent)."""
    global _collectors
    with _lock:
        if families not in _collectors:
            _collectors = (*_collectors, families)


def enable_prometheus() -> bool:
    """Export :data:`totals` to prometheus-client's default registry; False if it is not installed."""
    global _prometheus
    with _lock:
        if _prometheus:
            return True
        try:
            import prometheus_client
        except ImportError:
            return False
        prometheus_client.REGISTRY.register(_Collector())
        _prometheus = True
        return True


class _Collector:
    """prometheus-client's view of :data:`totals`, made when scraped."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        transfers = CounterMetricFamily("tensorwire_transfers", "Completed tensorwire fetches", labels=["transport"])
        nbytes = CounterMetricFamily(
            "tensorwire_transfer_bytes", "Bytes moved by tensorwire fetches", labels=["transport"]
        )
        seconds = HistogramMetricFamily(
            "tensorwire_transfer_seconds", "Duration of tensorwire fetches", labels=["transport"]
        )
        for name, row in sorted(totals.by_transport().items()):
            transfers.add_metric([name], row[0])
            nbytes.add_metric([name], row[1])
            cumulative, buckets = 0.0, []
            for bound, count in zip([*map(str, BUCKETS), "+Inf"], row[3:], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            seconds.add_metric([name], buckets, row[2])
        yield from (transfers, nbytes, seconds)
        for families in _collectors:
            try:
                yield from families()
            except Exception:
                logger.debug("metric families %r failed", families, exc_info=True)

    def describe(self) -> list[Any]:
        return []  # no samples at registration (nothing is collected then)
