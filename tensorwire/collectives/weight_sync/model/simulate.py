"""The time of a push's flows (:mod:`.flows`) on a cluster's links (:mod:`.cluster`).

Time advances in small steps (``steps`` over the expected push: the busiest link's bytes at its
bandwidth). In each step every flow that may run (its chain's previous bucket done, its parent
has the bucket, the trainer's staging slot free, then ``latency_us``) gets a rate: each link's
bandwidth shared by the flows on it, a flow held back on one link leaving the rest of the others
to the flows beside it (a few rounds of proportional sharing, then scaled down to fit). A flow
that ends inside a step hands the rest of the step on to its chain's next bucket.

The *bound* is what no push can beat on these links: the busiest link's bytes at its bandwidth.
The model's time over the bound says how much the plan, its buckets and the latencies leave
idle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensorwire.collectives.weight_sync.model.cluster import GBPS, Link, Placement
from tensorwire.collectives.weight_sync.model.flows import Flows
from tensorwire.collectives.weight_sync.planning.buckets import IN_FLIGHT
from tensorwire.progress import ProgressBar

__all__ = ["Modelled", "simulate"]

_SHARING_ROUNDS = 6


@dataclass
class Modelled:
    """A modelled push: ``seconds``, the ``bound_s`` of its busiest link, the links by how busy
    they are (``busiest``: (link, its bytes, its bytes at its bandwidth in s)), and each link's
    utilisation over time (``times`` (steps,), ``utilisation`` (steps, links), 0 to 1)."""

    seconds: float
    bound_s: float
    busiest: list[tuple[Link, float, float]]
    times: np.ndarray
    utilisation: np.ndarray
    links: list[Link]
    flows: int
    transfers: int

    @property
    def over_bound(self) -> float:
        return self.seconds / self.bound_s if self.bound_s > 0 else 1.0


def simulate(flows: Flows, placement: Placement, *, steps: int = 1000, progress: bool = False) -> Modelled:
    """The modelled push of ``flows`` on ``placement``'s links (see the module doc)."""
    caps = np.asarray([link.gbps * GBPS for link in placement.links])
    link_bytes = _bytes_per_link(flows, len(caps))
    bound_s = float((link_bytes / caps).max()) if flows.count else 0.0
    order = np.argsort(-(link_bytes / caps))
    busiest = [(placement.links[i], float(link_bytes[i]), float(link_bytes[i] / caps[i])) for i in order[:8]]
    latency_s = placement.cluster.latency_us * 1e-6
    chains = len(flows.chain_start) - 1
    per_chain = np.diff(flows.chain_start).max() if chains else 0
    dt = max(bound_s, latency_s * per_chain, 1e-6) / steps
    state = _State(flows)
    times, used = [], []
    now = 0.0
    bar = ProgressBar(flows.count, desc="model", unit="flow", enabled=progress)
    while not state.finished():
        state.schedule(now, latency_s)
        rates, active = _rates(flows, state, caps, now, dt)
        state.advance(active, rates, now, dt)
        times.append(now)
        used.append(np.bincount(_links_of(flows, active), weights=_per_link(flows, active, rates), minlength=len(caps)))
        now += dt
        bar.advance_to(int(state.done_count))
        if now > 1e6 * max(bound_s, dt):  # (nothing can move: a bug, not a slow push)
            raise RuntimeError("the push model made no progress")
    bar.close()
    seconds = float(state.done_at.max()) if flows.count else 0.0
    utilisation = np.asarray(used) / caps if used else np.zeros((0, len(caps)))
    return Modelled(
        seconds, bound_s, busiest, np.asarray(times), utilisation, placement.links, flows.count, flows.transfers
    )


def _bytes_per_link(flows: Flows, links: int) -> np.ndarray:
    rows = np.repeat(np.arange(flows.count), flows.links.shape[1])
    crossed = flows.links.reshape(-1)
    keep = crossed >= 0
    return np.bincount(crossed[keep], weights=flows.nbytes[rows[keep]], minlength=links)


def _links_of(flows: Flows, active: np.ndarray) -> np.ndarray:
    crossed = flows.links[active].reshape(-1)
    return crossed[crossed >= 0]


def _per_link(flows: Flows, active: np.ndarray, rates: np.ndarray) -> np.ndarray:
    crossed = flows.links[active]
    return np.repeat(rates, crossed.shape[1]).reshape(crossed.shape)[crossed >= 0]


def _rates(flows: Flows, state: _State, caps: np.ndarray, now: float, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """The active rows (running at some time in [now, now + dt)) and their rates (bytes/s)."""
    active = np.flatnonzero((state.start_at < now + dt) & ~state.done)
    if not len(active):
        return np.zeros(0), active
    crossed = flows.links[active]
    valid = crossed >= 0
    safe = np.where(valid, crossed, 0)
    link_cap = np.where(valid, caps[safe], np.inf)
    rates = link_cap.min(axis=1)
    for _ in range(_SHARING_ROUNDS):
        load = np.bincount(
            safe[valid], weights=np.broadcast_to(rates[:, None], crossed.shape)[valid], minlength=len(caps)
        )
        scale = np.where(valid, caps[safe] / np.maximum(load[safe], 1e-9), np.inf)
        rates = rates * scale.min(axis=1)
    load = np.bincount(safe[valid], weights=np.broadcast_to(rates[:, None], crossed.shape)[valid], minlength=len(caps))
    fit = np.where(valid, np.minimum(1.0, caps[safe] / np.maximum(load[safe], 1e-9)), np.inf)
    return rates * fit.min(axis=1), active


class _State:
    """Where each chain is: its next row, when each row may start and when it ended."""

    def __init__(self, flows: Flows) -> None:
        self.flows = flows
        n = flows.count
        self.remaining = flows.nbytes.copy()
        self.start_at = np.full(n, np.inf)
        self.done_at = np.full(n, np.inf)
        self.done = np.zeros(n, dtype=bool)
        self.done_count = 0
        self.heads = flows.chain_start[:-1].copy()  # each chain's next row (its end: finished)
        self.ends = flows.chain_start[1:]
        buckets = np.bincount(flows.stream, minlength=len(flows.readers)) // np.maximum(flows.readers, 1)
        self.slot_base = np.concatenate([[0], np.cumsum(buckets)[:-1]])  # stream -> its first (stream, bucket)
        self.slot_taken = np.zeros(int(buckets.sum()), dtype=np.int64)  # readers that took each (stream, bucket)
        self.slot_free_at = np.full(int(buckets.sum()), np.inf)
        self.chain_ready_at = np.zeros(len(self.heads))  # when the chain's previous row ended

    def finished(self) -> bool:
        return self.done_count >= self.flows.count

    def schedule(self, now: float, latency_s: float) -> None:
        """Give a start time to each chain's next row whose bucket its parent has and whose
        staging slot is free."""
        waiting = np.flatnonzero(self.heads < self.ends)
        rows = self.heads[waiting]
        new = np.isinf(self.start_at[rows])
        waiting, rows = waiting[new], rows[new]
        if not len(rows):
            return
        parent = self.flows.parent[rows]
        parent_at = np.where(parent >= 0, self.done_at[np.maximum(parent, 0)], 0.0)
        k = self.flows.bucket[rows]
        slot = self.slot_base[self.flows.stream[rows]] + k - IN_FLIGHT
        slot_at = np.where(k >= IN_FLIGHT, self.slot_free_at[np.maximum(slot, 0)], 0.0)
        at = np.maximum(np.maximum(parent_at, slot_at), self.chain_ready_at[waiting])
        ok = np.isfinite(at)
        self.start_at[rows[ok]] = np.maximum(at[ok] + latency_s, now)

    def advance(self, active: np.ndarray, rates: np.ndarray, now: float, dt: float) -> None:
        """Move the active rows on by what they can in [now, now + dt); end those that finish."""
        if not len(active):
            return
        begin = np.maximum(self.start_at[active], now)
        moved = rates * (now + dt - begin)
        left = self.remaining[active] - moved
        self.remaining[active] = np.maximum(left, 0.0)
        ended = left <= 0
        rows = active[ended]
        over_s = np.where(rates[ended] > 0, -left[ended] / np.maximum(rates[ended], 1e-9), 0.0)
        self.done_at[rows] = np.maximum(now + dt - over_s, begin[ended])
        self.done[rows] = True
        self.done_count += len(rows)
        chains = np.searchsorted(self.flows.chain_start, rows, side="right") - 1
        self.heads[chains] = rows + 1
        self.chain_ready_at[chains] = self.done_at[rows]
        slots = self.slot_base[self.flows.stream[rows]] + self.flows.bucket[rows]
        np.add.at(self.slot_taken, slots, 1)
        full = slots[self.slot_taken[slots] >= self.flows.readers[self.flows.stream[rows]]]
        for slot in np.unique(full):  # (the last reader's end frees it)
            if np.isinf(self.slot_free_at[slot]):
                self.slot_free_at[slot] = self.done_at[rows[slots == slot]].max()
