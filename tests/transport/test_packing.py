from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorwire.errors import TransferAbortedError
from tensorwire.transport import packing
from tensorwire.transport.packing import ALIGNMENT, ByteSink, iter_stream_chunks, packed_layout


def test_packed_layout_aligns_every_tensor():
    offsets, total = packed_layout([1, 0, 100, 64])
    assert offsets == [0, ALIGNMENT, ALIGNMENT, ALIGNMENT + 128]
    assert total == ALIGNMENT + 128 + 64
    assert all(o % ALIGNMENT == 0 for o in offsets)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_stream_round_trip_many_small_and_large(chunk):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for n in (0, 1, 3, 1000, 5)] + [torch.tensor(True)]
    chunks = list(iter_stream_chunks(tensors, chunk))
    assert all(len(c) <= chunk for c in chunks)
    dst = [torch.empty_like(t) for t in tensors]
    sink = ByteSink(dst)
    for c in chunks:
        sink.write(c)
    sink.finish()
    assert all(torch.equal(a, b) for a, b in zip(tensors, dst, strict=True))


def test_many_small_tensors_share_chunks():
    tensors = [torch.ones(4) for _ in range(1000)]  # 16 KB in 1,000 tensors
    assert len(list(iter_stream_chunks(tensors, 1 << 20))) == 1


def test_sink_rejects_overrun_and_short_streams():
    sink = ByteSink([torch.empty(2, dtype=torch.uint8)])
    with pytest.raises(TransferAbortedError, match="more bytes than expected"):
        sink.write(b"abc")
    short = ByteSink([torch.empty(4, dtype=torch.uint8)])
    short.write(b"ab")
    with pytest.raises(TransferAbortedError, match="2 of 4 bytes"):
        short.finish()


def test_message_plan_packs_small_tensors_and_keeps_large_ones_alone():
    from tensorwire.transport.packing import message_plan

    sizes = [10, 0, 100, 5000, 20, 30, 6000, 40]
    plan = message_plan(sizes, small_nbytes=1000, pack_nbytes=100)
    assert plan == [[0], [3], [2], [6], [4, 5, 7]]  # larges alone; smalls in order, <= 100 B per message
    assert sorted(i for message in plan for i in message) == [i for i, n in enumerate(sizes) if n]
    assert message_plan([], small_nbytes=1, pack_nbytes=1) == []


def test_parallel_copy_cuts_large_copies_over_threads_and_keeps_small_ones_in_one(monkeypatch):
    """Which threads ran the pieces: ``threads`` of them from the threshold on, the caller alone below."""
    import threading

    seen: list[tuple[str, int]] = []
    copy, caller = np.copyto, threading.current_thread()

    def recorded(out, src):
        if threading.current_thread() is caller or threading.current_thread().daemon:  # ours: caller and helpers
            seen.append((threading.current_thread().name, len(src)))
        copy(out, src)

    monkeypatch.setattr(packing.np, "copyto", recorded)
    size = packing.PARALLEL_MIN_NBYTES
    packing.parallel_copy(np.zeros(size, dtype=np.uint8), np.ones(size, dtype=np.uint8), 2)
    assert len({name for name, _ in seen}) == 2 and sum(n for _, n in seen) == size
    seen.clear()
    packing.parallel_copy(np.zeros(size - 1, dtype=np.uint8), np.ones(size - 1, dtype=np.uint8), 2)
    assert seen == [(threading.current_thread().name, size - 1)]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_copy_copies_every_byte_of_an_odd_size(threads):
    size = packing.PARALLEL_MIN_NBYTES + 12_345  # above the threshold, not a multiple of anything
    source = np.frombuffer(np.random.default_rng(threads).bytes(size), dtype=np.uint8)
    out = np.zeros(size, dtype=np.uint8)
    packing.parallel_copy(out, source, threads)
    assert np.array_equal(out, source)
    small = np.arange(100, dtype=np.uint8)
    out_small = np.zeros(100, dtype=np.uint8)
    packing.parallel_copy(out_small, small, threads)  # below the threshold: one call
    assert np.array_equal(out_small, small)
