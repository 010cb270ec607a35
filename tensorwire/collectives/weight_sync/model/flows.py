"""The flows of a push: every bucket of every stream to each of its readers, as the push moves
it (:mod:`..protocol.assign`): readers on the trainer's node read it from the trainer, each other
node's first reader (its leader) from the trainer or from another leader (a binary tree of
leaders, :func:`~tensorwire.collectives.groups.tensorwire_group.broadcast_parents`), the rest of
a node from their leader. A reader takes a stream's buckets in order (a *chain*); it starts
bucket k once its parent has it, and the trainer stages bucket k once every reader of the stream
took bucket k - :data:`~..planning.buckets.IN_FLIGHT` (its staging slots)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tensorwire.collectives.weight_sync.model.cluster import Placement
from tensorwire.collectives.weight_sync.planning.plan import Plan, Stream
from tensorwire.progress import ProgressBar

__all__ = ["Flows", "flows_of"]


@dataclass
class Flows:
    """One row per (stream, reader, bucket), chains in order (a chain's rows are consecutive)."""

    nbytes: np.ndarray  # float64: the bucket's bytes on the wire
    links: np.ndarray  # int64 (rows, width): the links it crosses, -1 past the last
    stream: np.ndarray  # int64: its stream
    bucket: np.ndarray  # int64: its bucket level in the stream
    parent: np.ndarray  # int64: the row it is relayed from (the same bucket to its parent), -1: the trainer
    chain_start: np.ndarray  # int64 (chains + 1,): each chain's first row, then the total
    readers: np.ndarray  # int64 (streams,): readers of each stream
    transfers: int  # the plan's transfers (pieces) in all

    @property
    def count(self) -> int:
        return len(self.nbytes)


def flows_of(plan: Plan, placement: Placement, bucket_bytes: int, *, progress: bool = False) -> Flows:
    """Every bucket flow of a push of ``plan`` to all its receivers (receiver ``r`` at
    ``placement.receivers[r]``), cut at ``bucket_bytes``."""
    receivers = sorted(plan.receivers)
    streams = plan.streams(receivers, bucket_bytes)
    sizes: list[np.ndarray] = []  # per chain: its buckets' bytes
    paths: list[tuple[int, ...]] = []  # per chain: the links it crosses
    chain_stream: list[int] = []
    parent_chain: list[int] = []  # per chain: the chain it is relayed from, -1: the trainer
    readers: list[int] = []
    bar = ProgressBar(len(streams), desc="flows", unit="stream", enabled=progress)
    for sid, stream in enumerate(streams):
        buckets = np.asarray(_bucket_sizes(stream), dtype=np.float64)
        chain_of: dict[int, int] = {}
        for reader, parent in _tree(stream, placement):
            src = placement.trainers[stream.trainer] if parent is None else placement.receivers[parent]
            chain_of[reader] = len(sizes)
            sizes.append(buckets)
            paths.append(placement.path(src, placement.receivers[reader]))
            chain_stream.append(sid)
            parent_chain.append(-1 if parent is None else chain_of[parent])
        readers.append(len(stream.readers))
        bar.advance_to(sid + 1)
    bar.close()
    lengths = np.asarray([len(b) for b in sizes], dtype=np.int64)
    chain_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    chain = np.repeat(np.arange(len(sizes)), lengths)
    bucket = np.arange(int(lengths.sum())) - chain_start[chain]
    width = max((len(p) for p in paths), default=1)
    chain_links = np.full((len(paths), width), -1, dtype=np.int64)
    for c, path in enumerate(paths):
        chain_links[c, : len(path)] = path
    parents = np.asarray(parent_chain, dtype=np.int64)[chain]
    return Flows(
        nbytes=np.concatenate(sizes) if sizes else np.zeros(0),
        links=chain_links[chain] if len(chain) else np.zeros((0, width), dtype=np.int64),
        stream=np.asarray(chain_stream, dtype=np.int64)[chain],
        bucket=bucket,
        parent=np.where(parents >= 0, chain_start[np.maximum(parents, 0)] + bucket, -1),
        chain_start=chain_start,
        readers=np.asarray(readers, dtype=np.int64),
        transfers=sum(len(t) for t in plan.receivers.values()),
    )


def _bucket_sizes(stream: Stream) -> list[float]:
    first = stream.transfers[stream.readers[0]]
    return [float(sum(first[i].nbytes for i in bucket)) for bucket in stream.buckets]


def _tree(stream: Stream, placement: Placement) -> Sequence[tuple[int, int | None]]:
    """(reader, the reader it is relayed from or None for the trainer), parents first: the
    push's relay tree (readers on the trainer's node from it; a binary tree of node leaders)."""
    src_node = placement.trainers[stream.trainer][0]
    by_node: dict[int, list[int]] = {}
    for r in stream.readers:
        by_node.setdefault(placement.receivers[r][0], []).append(r)
    order: list[tuple[int, int | None]] = [(r, None) for r in by_node.get(src_node, [])]
    leaders: list[int | None] = [None] + [ranks[0] for node, ranks in by_node.items() if node != src_node]
    for index, leader in enumerate(leaders[1:], start=1):
        assert leader is not None
        order.append((leader, leaders[(index - 1) // 2]))
    for node, ranks in by_node.items():
        if node != src_node:
            order += [(r, ranks[0]) for r in ranks[1:]]
    return order
