"""Transfer records and where they go: ``tensorwire.stats()``, Prometheus, Ray's metrics.

Every completed fetch produces one :class:`TransferRecord` (transport, the selector's reason,
bytes, duration, source and destination agents). The agent keeps recent ones for
``tensorwire.stats()`` and hands each to the registered observers:

* Prometheus (when ``prometheus-client`` is installed): counters
  ``tensorwire_transfers_total`` and ``tensorwire_transfer_bytes_total`` and the histogram
  ``tensorwire_transfer_seconds``, labelled by transport, in prometheus-client's default
  registry (expose it with ``prometheus_client.start_http_server(port)``).
* Ray (in processes of a Ray cluster, added by the runtime): the same three through
  ``ray.util.metrics``, so they show on the Ray dashboard.

Observers never fail a transfer: their errors are logged and dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TransferRecord", "add_observer", "enable_prometheus", "notify", "observers", "remove_observer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferRecord:
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


Observer = Callable[[TransferRecord], None]
_observers: list[Observer] = []
_lock = threading.Lock()
_prometheus: Observer | None = None


def add_observer(observer: Observer) -> None:
    """Call ``observer(record)`` after every completed fetch in this process (idempotent)."""
    with _lock:
        if observer not in _observers:
            _observers.append(observer)


def remove_observer(observer: Observer) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def observers() -> list[Observer]:
    with _lock:
        return list(_observers)


def notify(record: TransferRecord) -> None:
    """Agent, after a fetch: pass ``record`` to every observer; never raises."""
    for observer in observers():
        try:
            observer(record)
        except Exception:
            logger.debug("transfer observer %r failed", observer, exc_info=True)


def enable_prometheus() -> bool:
    """Export transfers to prometheus-client's default registry; False if it is not installed."""
    global _prometheus
    with _lock:
        if _prometheus is not None:
            return True
        try:
            import prometheus_client
        except ImportError:
            return False
        transfers = prometheus_client.Counter(
            "tensorwire_transfers_total", "Completed tensorwire fetches", ["transport"]
        )
        nbytes = prometheus_client.Counter(
            "tensorwire_transfer_bytes_total", "Bytes moved by tensorwire fetches", ["transport"]
        )
        seconds = prometheus_client.Histogram(
            "tensorwire_transfer_seconds", "Duration of tensorwire fetches", ["transport"]
        )

        children: dict[str, tuple[Any, Any, Any]] = {}  # labelled metrics, made once per transport

        def observe(record: TransferRecord) -> None:
            labelled = children.get(record.transport)
            if labelled is None:
                name = record.transport
                labelled = children[name] = (transfers.labels(name), nbytes.labels(name), seconds.labels(name))
            labelled[0].inc()
            labelled[1].inc(record.nbytes)
            labelled[2].observe(record.duration_s)

        _prometheus = observe
        _observers.append(observe)
        return True
