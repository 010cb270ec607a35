"""shm's segment cache: objects of tensors returned again unchanged share one segment, each with
its own live byte; a write makes a new segment and leaves the old one's bytes alone; entries go
with their storages and within the budget."""

from __future__ import annotations

import gc
import os
import secrets

import numpy as np
import pytest
import torch

from tensorwire.transport.backends.shm import segment_reuse
from tensorwire.transport.backends.shm import transport as shm
from tensorwire.transport.backends.shm.segment_reuse import ReuseMode, SegmentCache
from tensorwire.transport.contract import StoredObject, TensorMeta
from tensorwire.transport.packing import packed_layout


def _object(*tensors: torch.Tensor) -> StoredObject:
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, packed_nbytes = packed_layout(sizes)
    metas = tuple(
        TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch."), "cpu", n, o)
        for t, n, o in zip(tensors, sizes, offsets, strict=True)
    )
    return StoredObject(secrets.token_bytes(16), secrets.token_bytes(16), list(tensors), metas, packed_nbytes)


class _Packer:
    """shm's own packing, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, obj: StoredObject) -> int:
        self.calls += 1
        return shm._pack(obj)


def _segment_bytes(fd: int, obj: StoredObject, index: int) -> bytes:
    meta = obj.metas[index]
    return os.pread(fd, meta.nbytes, meta.offset)


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


@pytest.fixture
def opened():
    """Descriptors the test got from the cache, closed after it."""
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


def _take(cache: SegmentCache, obj: StoredObject, pack: _Packer, opened: list[int]) -> tuple[int, int]:
    fd, live_offset = cache.segment(obj, pack)
    opened.append(fd)
    return fd, live_offset


def test_objects_of_an_unchanged_tensor_share_one_segment_each_with_its_own_live_byte(opened):
    cache, pack = SegmentCache(ReuseMode.VERIFY, 1 << 30), _Packer()
    weights, bias = torch.randn(50_000), torch.arange(1000, dtype=torch.int64)
    first, second, third = (_object(weights, bias) for _ in range(3))
    fd1, live1 = _take(cache, first, pack, opened)
    fd2, live2 = _take(cache, second, pack, opened)
    fd3, live3 = _take(cache, third, pack, opened)
    assert pack.calls == 1 and cache.shared == 2
    assert _inode(fd1) == _inode(fd2) == _inode(fd3)
    assert (live1, live2, live3) == (first.packed_nbytes, first.packed_nbytes + 1, first.packed_nbytes + 2)
    assert [os.pread(fd1, 1, o) for o in (live1, live2, live3)] == [segment_reuse.LIVE] * 3
    assert _segment_bytes(fd3, third, 0) == weights.numpy().tobytes()
    assert _segment_bytes(fd3, third, 1) == bias.numpy().tobytes()
    assert cache.cached_nbytes() == first.packed_nbytes


def test_a_counted_write_packs_anew_and_the_earlier_segment_keeps_its_bytes(opened):
    cache, pack = SegmentCache(ReuseMode.VERSION, 1 << 30), _Packer()
    value = torch.zeros(40_000)
    before = _object(value)
    fd_before, _ = _take(cache, before, pack, opened)
    value.add_(3)  # moves the version counter
    after = _object(value)
    fd_after, live_after = _take(cache, after, pack, opened)
    assert pack.calls == 2 and cache.shared == 0
    assert _inode(fd_before) != _inode(fd_after)
    assert live_after == after.packed_nbytes  # a new segment's first live byte
    assert _segment_bytes(fd_after, after, 0) == value.numpy().tobytes()
    assert _segment_bytes(fd_before, before, 0) == torch.zeros(40_000).numpy().tobytes()  # views of it stay right
    assert cache.cached_nbytes() == after.packed_nbytes  # the stale entry went


@pytest.mark.parametrize("write", ["through .data", "through numpy"])
def test_writes_the_version_counter_misses_are_caught_by_comparing_the_bytes(opened, write):
    value = torch.zeros(40_000)
    for mode, expect_shared in ((ReuseMode.VERIFY, False), (ReuseMode.VERSION, True)):
        cache, pack = SegmentCache(mode, 1 << 30), _Packer()
        fd_before, _ = _take(cache, _object(value), pack, opened)
        version = value._version
        if write == "through .data":
            value.data.fill_(float(mode is ReuseMode.VERIFY) + 1)
        else:
            np.copyto(value.numpy(), float(mode is ReuseMode.VERIFY) + 1)
        assert value._version == version  # the counter did not see it: only the bytes tell
        after = _object(value)
        fd_after, _ = _take(cache, after, pack, opened)
        assert (_inode(fd_before) == _inode(fd_after)) is expect_shared, mode
        if mode is ReuseMode.VERIFY:
            assert _segment_bytes(fd_after, after, 0) == value.numpy().tobytes()
        else:  # the documented trade-off of trusting the counters: the earlier bytes
            assert _segment_bytes(fd_after, after, 0) != value.numpy().tobytes()


def test_other_tensors_on_the_same_storage_or_another_layout_do_not_share(opened):
    cache, pack = SegmentCache(ReuseMode.VERIFY, 1 << 30), _Packer()
    base = torch.arange(100_000, dtype=torch.float32)
    _take(cache, _object(base[:50_000]), pack, opened)
    _take(cache, _object(base[50_000:]), pack, opened)  # same storage, other bytes
    _take(cache, _object(base[:25_000], base[25_000:50_000]), pack, opened)  # same bytes, other layout
    _take(cache, _object(torch.from_numpy(base.numpy()[:50_000])), pack, opened)  # same memory, other storage
    assert pack.calls == 4 and cache.shared == 0


def test_an_entry_goes_when_its_storage_is_freed_even_inside_the_cache_on_the_same_thread(opened):
    cache, pack = SegmentCache(ReuseMode.VERIFY, 1 << 30), _Packer()
    value = torch.ones(30_000)
    obj = _object(value)
    fd, _ = _take(cache, obj, pack, opened)
    nbytes = obj.packed_nbytes
    assert cache.cached_nbytes() == nbytes
    del obj
    with cache._lock:  # a tensor freed while this thread is inside the cache: left for later, no deadlock
        del value
        gc.collect()
        assert cache._dead
    assert cache.cached_nbytes() == 0
    assert os.pread(fd, 4, 0) == torch.ones(1).numpy().tobytes()  # the object's own descriptor still reads


def test_the_budget_keeps_the_most_recently_used_segments(opened):
    tensors = [torch.full((20_000,), float(i)) for i in range(3)]
    nbytes = _object(tensors[0]).packed_nbytes
    cache, pack = SegmentCache(ReuseMode.VERIFY, 2 * nbytes), _Packer()
    for t in tensors:
        _take(cache, _object(t), pack, opened)
    assert cache.cached_nbytes() == 2 * nbytes and pack.calls == 3
    _take(cache, _object(tensors[2]), pack, opened)
    assert pack.calls == 3  # kept
    _take(cache, _object(tensors[0]), pack, opened)
    assert pack.calls == 4  # the oldest went
    too_big = torch.zeros(3 * 20_000)
    _take(cache, _object(too_big), pack, opened)
    _take(cache, _object(too_big), pack, opened)
    assert pack.calls == 6 and cache.cached_nbytes() == 2 * nbytes  # larger than the budget: never kept


def test_a_segment_serves_a_bounded_number_of_objects(opened, monkeypatch):
    monkeypatch.setattr(segment_reuse, "MAX_SHARERS", 3)
    cache, pack = SegmentCache(ReuseMode.VERIFY, 1 << 30), _Packer()
    value = torch.ones(10_000)
    inodes = [_inode(_take(cache, _object(value), pack, opened)[0]) for _ in range(5)]
    assert pack.calls == 2
    assert inodes[:3] == [inodes[0]] * 3 and inodes[3:] == [inodes[3]] * 2 and inodes[3] != inodes[0]


def test_settings_come_from_the_environment_and_bad_ones_are_named(opened, monkeypatch):
    value = torch.ones(10_000)
    monkeypatch.setenv("TENSORWIRE_SHM_REUSE", "off")
    cache, pack = SegmentCache(), _Packer()
    for _ in range(2):
        _take(cache, _object(value), pack, opened)
    assert pack.calls == 2 and cache.cached_nbytes() == 0
    monkeypatch.setenv("TENSORWIRE_SHM_REUSE", "VERSION")
    for _ in range(2):
        _take(cache, _object(value), pack, opened)
    assert pack.calls == 3
    monkeypatch.setenv("TENSORWIRE_SHM_REUSE_NBYTES", "0")
    assert cache.budget_nbytes() == 0
    monkeypatch.setenv("TENSORWIRE_SHM_REUSE", "always")
    with pytest.raises(ValueError, match="TENSORWIRE_SHM_REUSE='always' is not one of verify, version, off"):
        cache.segment(_object(value), pack)
    monkeypatch.setenv("TENSORWIRE_SHM_REUSE", "verify")
    monkeypatch.setenv("TENSORWIRE_SHM_REUSE_NBYTES", "1G")
    with pytest.raises(ValueError, match="TENSORWIRE_SHM_REUSE_NBYTES='1G' is not an integer"):
        cache.segment(_object(value), pack)
