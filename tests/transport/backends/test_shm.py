"""shm specifics: anonymous segments handed out only for the token, freed with their
holders (SIGKILL included), nothing named in /dev/shm, out of memory; direct reads
(process_vm_readv) handed addresses only for the token, checked against the live word,
with segments as the fallback.

Tests of segment packing itself run with direct reads off in the producer
(``segments_only``): with them on, a segment is made only when a consumer asks for one."""

from __future__ import annotations

import errno
import os
import pickle
import re
import socket
import struct
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.transport.backends.shm import cma, memfd
from tensorwire.transport.backends.shm import transport as shm
from tests.helpers.observe import memfd_segments, segment_names, wait_until
from tests.helpers.procs import Worker
from tests.helpers.reentry import collector_reenters
from tests.helpers.tasks import digest


@pytest.fixture
def segments_only(monkeypatch):
    """Direct reads off in this process: shm packs every object when its reference leaves."""
    monkeypatch.setenv("TENSORWIRE_SHM_DIRECT", "0")


@pytest.mark.parametrize("reuse", ["off", "verify"])
def test_segment_is_anonymous_and_closed_on_free(agent, worker, segments_only, monkeypatch, reuse):
    """Freed with its object; where unchanged tensors may share it, once the tensors are gone."""
    monkeypatch.setenv("TENSORWIRE_SHM_REUSE", reuse)
    before = memfd_segments({os.getpid()})
    named_before = segment_names()
    value = torch.randn(100_000)
    ref = tw.put(value)
    blob = pickle.dumps(ref)  # leaving the process exports the segment
    new = memfd_segments({os.getpid()}) - before
    assert len(new) == 1
    assert segment_names() == named_before  # nothing named in /dev/shm while the object lives
    assert worker.call("tests.helpers.tasks:get_transport", pickle.loads(blob)) == (digest(value), "shm")
    tw.free(ref)
    if reuse == "verify":
        assert memfd_segments({os.getpid()}) - before == new  # kept for the next object of `value`
        del value
    assert wait_until(lambda: memfd_segments({os.getpid()}) == before)  # the fd server closes its copy after the send


def test_objects_of_an_unchanged_tensor_share_a_segment_and_are_freed_one_by_one(agent, worker, segments_only):
    before = memfd_segments({os.getpid()})
    value = torch.randint(0, 256, (300_000,), dtype=torch.uint8)
    refs = [tw.put(value), tw.put(value)]
    blobs = [pickle.dumps(ref) for ref in refs]  # the second shares the first's segment
    assert len(memfd_segments({os.getpid()}) - before) == 1
    for name, blob in zip("ab", blobs, strict=True):
        worker.call("tests.helpers.tasks:hold", pickle.loads(blob), name)
        assert worker.call("tests.helpers.tasks:get_transport", pickle.loads(blob)) == (digest(value), "shm")
    tw.free(refs[1])  # clears the second object's live byte only; the worker keeps both descriptors
    assert worker.call("tests.helpers.tasks:get_kept_error", "b", transport="shm") == "ObjectFreedError"
    assert worker.call("tests.helpers.tasks:get_digest", pickle.loads(blobs[0]), transport="shm") == digest(value)
    expected = digest(value)
    value.add_(1)  # written: the next object gets a segment of its own
    third = tw.put(value)
    assert worker.call("tests.helpers.tasks:get_digest", third, transport="shm") == digest(value)
    assert worker.call("tests.helpers.tasks:get_digest", pickle.loads(blobs[0]), transport="shm") == expected
    assert len(memfd_segments({os.getpid()}) - before) == 2


@pytest.mark.parametrize("direct", ["1", "0"])
def test_forged_token_reads_nothing_over_shm(agent, worker, monkeypatch, direct):
    monkeypatch.setenv("TENSORWIRE_SHM_DIRECT", direct)
    value = torch.full((100_000,), 5, dtype=torch.uint8)
    ref = tw.put(value)
    blob = pickle.dumps(ref)
    forged_blob = blob.replace(ref._desc.token, bytes(len(ref._desc.token)))
    assert forged_blob != blob
    forged = worker.call("tests.helpers.tasks:get_error", pickle.loads(forged_blob), transport="shm")
    assert forged == "PermissionDeniedError"
    assert worker.call("tests.helpers.tasks:get_digest", pickle.loads(blob), transport="shm") == digest(value)


def test_descriptor_server_refuses_wrong_tokens_and_malformed_requests(tmp_path):
    server = memfd.FdServer(str(tmp_path))
    client = memfd.FdClient()
    try:
        fd = memfd.create_memfd(4096)
        os.pwrite(fd, b"abc", 0)
        server.offer(b"k" * 16, b"t" * 16, fd, 4096)
        deadline = time.monotonic() + 10
        got, nbytes = client.receive(server.path, b"k" * 16, b"t" * 16, deadline=deadline)
        assert (os.pread(got, 3, 0), nbytes) == (b"abc", 4096)
        os.close(got)
        with pytest.raises(tw.PermissionDeniedError):
            client.receive(server.path, b"k" * 16, b"x" * 16, deadline=deadline)
        with pytest.raises(memfd.SegmentUnknownError):
            client.receive(server.path, b"?" * 16, b"t" * 16, deadline=deadline)
        for junk in (b"GET / HTTP/1.1\r\n\r\n", b"TWFD\x01" + struct.pack("!H", 9999), b"TWFD\x01\x00"):
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.settimeout(10)
            raw.connect(server.path)
            raw.sendall(junk)
            if junk.endswith(b"\x00"):
                raw.shutdown(socket.SHUT_WR)  # truncated: the server ends the connection
            reply = raw.recv(64)
            raw.close()
            assert reply in (struct.pack("!BQ", memfd.FdStatus.BAD_REQUEST, 0), b"")
        got, _ = client.receive(server.path, b"k" * 16, b"t" * 16, deadline=deadline)  # still serving
        os.close(got)
        server.withdraw(b"k" * 16)
        with pytest.raises(memfd.SegmentUnknownError):
            client.receive(server.path, b"k" * 16, b"t" * 16, deadline=deadline)
    finally:
        client.close()
        server.close()
    assert not os.path.exists(server.path)


def test_a_killed_producer_leaves_no_memory_behind():
    w = Worker(env={"TENSORWIRE_SHM_DIRECT": "0"})
    try:
        ref = w.call("tests.helpers.tasks:put_filled", 1 << 20)
        pickle.dumps(ref)  # the worker exported a segment for this reference
        held = memfd_segments({w.pid})
        assert len(held) >= 1
        w.kill()
        # The kernel frees an anonymous segment with its last holder: no process keeps it.
        assert wait_until(lambda: not held & memfd_segments(_all_pids()))
        assert not segment_names()
    finally:
        w.close()


def _all_pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def test_full_dev_shm_falls_back_to_a_two_sided_transport_with_a_warning(
    agent, worker, monkeypatch, caplog, segments_only
):
    def no_room(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "pwrite", no_room)
    value = torch.randn(200_000)
    ref = tw.put(value)
    agent._warned.discard("export:shm")
    with pytest.warns(RuntimeWarning, match="shm could not export"):
        blob = pickle.dumps(ref)
    got_digest, used = worker.call("tests.helpers.tasks:get_transport", pickle.loads(blob))
    following = "nixl" if "nixl" in agent.transports() else "ucx"  # next in the ranking: shm, [nixl,] ucx, host, gloo
    assert (got_digest, used) == (digest(value), following)
    got_digest, used = worker.call("tests.helpers.tasks:get_transport", pickle.loads(blob), transport="host")
    assert (got_digest, used) == (digest(value), "host")
    caplog.clear()  # the captured warning's exception keeps the object alive (the leak guard would see it)


def test_forced_shm_on_full_dev_shm_is_a_clear_error(agent, worker, monkeypatch, caplog, segments_only):
    monkeypatch.setattr(shm.os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    ref = tw.put(torch.randn(200_000))
    with pytest.warns(RuntimeWarning):
        agent._warned.discard("export:shm")
        blob = pickle.dumps(ref)
    assert worker.call("tests.helpers.tasks:get_error", pickle.loads(blob), transport="shm") == "TransportError"
    caplog.clear()  # the captured warning's exception keeps the object alive (the leak guard would see it)


# ---------------------------------------------------------------------- direct reads

needs_direct = pytest.mark.skipif(
    cma.unavailable_reason() is not None, reason=f"direct reads unavailable here: {cma.unavailable_reason()}"
)


@needs_direct
def test_direct_read_copies_once_and_makes_no_segment(agent, worker):
    before = memfd_segments({os.getpid()})
    value = torch.arange(300_000, dtype=torch.float32) + 5
    ref = tw.put(value)
    blob = pickle.dumps(ref)
    assert worker.call("tests.helpers.tasks:get_transport", pickle.loads(blob)) == (digest(value), "shm")
    assert memfd_segments({os.getpid()}) == before  # read from the tensor itself: nothing packed
    value.add_(1)  # a direct read sees the tensor as it is at the fetch (like two-sided transports)
    assert worker.call("tests.helpers.tasks:get_digest", pickle.loads(blob), transport="shm") == digest(value)
    view = worker.call("tests.helpers.tasks:view_and_write_with", pickle.loads(blob), "shm")
    assert (view["zero_copy"], view["first"], view["after_write"], view["again"]) == (True, 6, -1, 6)
    # a view still maps a segment, made on request
    assert len(memfd_segments({os.getpid()}) - before) == 1
    tw.free(ref)
    assert worker.call("tests.helpers.tasks:get_error", pickle.loads(blob), transport="shm") == "ObjectFreedError"
    assert len(memfd_segments({os.getpid()}) - before) == 1  # kept for a later view of `value` unchanged
    del value
    assert wait_until(lambda: memfd_segments({os.getpid()}) == before)  # the fd server closes its copy after the send


def test_address_requests_need_the_token_and_never_make_the_segment(tmp_path):
    server = memfd.FdServer(str(tmp_path))
    client = memfd.FdClient()
    made = []

    def make():
        made.append(1)
        fd = memfd.create_memfd(64)
        os.pwrite(fd, b"xyz", 0)
        return fd, 64

    try:
        addresses = cma.pack_addresses(0x1000, 0x55, [(0x2000, 10), (0, 0)])
        server.offer_lazy(b"k" * 16, b"t" * 16, make, addresses=addresses)
        deadline = time.monotonic() + 10
        with pytest.raises(tw.PermissionDeniedError):
            client.addresses(server.path, b"k" * 16, b"x" * 16, deadline=deadline)
        got = cma.unpack_addresses(client.addresses(server.path, b"k" * 16, b"t" * 16, deadline=deadline))
        assert (got.live_address, got.nonce, got.ranges, made) == (0x1000, 0x55, [[0x2000, 10], [0, 0]], [])
        with pytest.raises(tw.PermissionDeniedError):
            client.receive(server.path, b"k" * 16, b"x" * 16, deadline=deadline)
        assert made == []  # a wrong token makes nothing either
        fd, nbytes = client.receive(server.path, b"k" * 16, b"t" * 16, deadline=deadline)
        assert (os.pread(fd, 3, 0), nbytes, made) == (b"xyz", 64, [1])
        os.close(fd)
        fd, _ = client.receive(server.path, b"k" * 16, b"t" * 16, deadline=deadline)
        os.close(fd)
        assert made == [1]  # made once
        server.withdraw(b"k" * 16)
        with pytest.raises(memfd.SegmentUnknownError):
            client.addresses(server.path, b"k" * 16, b"t" * 16, deadline=deadline)
    finally:
        client.close()
        server.close()


@needs_direct
def test_read_into_checks_the_live_word_and_splits_over_threads():
    words = cma.LiveWords()
    slot, address, nonce = words.take()
    src = torch.arange(40 << 20, dtype=torch.uint8)  # large enough for two threads
    small = torch.full((100,), 3, dtype=torch.uint8)
    info = cma.DirectRead(address, nonce, [(src.data_ptr(), src.numel()), (small.data_ptr(), 100)])
    out, out_small = torch.zeros_like(src), torch.zeros_like(small)
    local = [(out.data_ptr(), out.numel()), (out_small.data_ptr(), 100)]
    assert cma.read_into(os.getpid(), info, local, threads=2)
    assert torch.equal(out, src) and torch.equal(out_small, small)
    words.clear(slot)
    assert not cma.read_into(os.getpid(), info, local, threads=1)  # freed: the bytes are not to be used
    runs = cma._split([(0, 100, 10), (10, 200, 30)], 2)
    assert runs == [[(0, 100, 10), (10, 200, 10)], [(20, 210, 20)]]


@needs_direct
def test_an_object_of_few_tensors_is_read_with_its_live_word_in_one_call(monkeypatch):
    """Data then the live word, last in the same process_vm_readv (the kernel copies in order)."""
    import ctypes

    words = cma.LiveWords()
    slot, address, nonce = words.take()
    tensors = [torch.full((n,), i + 1, dtype=torch.uint8) for i, n in enumerate((4096, 10, 1 << 20))]
    info = cma.DirectRead(address, nonce, [(t.data_ptr(), t.numel()) for t in tensors])
    outs = [torch.zeros_like(t) for t in tensors]
    calls = []
    real = cma._readv()

    def counted(pid, local, count, remote, count2, flags):
        last = ctypes.cast(remote, ctypes.POINTER(ctypes.c_uint64 * (2 * count2))).contents
        calls.append((count, last[-2], last[-1]))
        return real(pid, local, count, remote, count2, flags)

    monkeypatch.setattr(cma, "_readv", lambda: counted)
    assert cma.read_into(os.getpid(), info, [(o.data_ptr(), o.numel()) for o in outs])
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors, strict=True))
    assert calls == [(4, address, 8)]  # one call: three tensors, then the live word
    words.clear(slot)
    assert not cma.read_into(os.getpid(), info, [(o.data_ptr(), o.numel()) for o in outs])


@needs_direct
def test_a_prepared_read_reads_the_bytes_as_they_are_now_and_checks_the_live_word(monkeypatch):
    words = cma.LiveWords()
    slot, address, nonce = words.take()
    tensors = [torch.full((n,), i + 1, dtype=torch.uint8) for i, n in enumerate((4096, 10))]
    info = cma.DirectRead(address, nonce, [(t.data_ptr(), t.numel()) for t in tensors])
    outs = [torch.zeros_like(t) for t in tensors]
    read = cma.prepared_read(os.getpid(), info, [(o.data_ptr(), o.numel()) for o in outs])
    assert read is not None and read(time.monotonic() + 60)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors, strict=True))
    tensors[0].fill_(7)  # read again: the iovecs made once, the bytes as they are now
    assert read(time.monotonic() + 60) and torch.equal(outs[0], tensors[0])
    tensors[1].fill_(9)
    assert not read(time.monotonic()) and int(outs[1][0]) == 2  # no time left: not read (the caller reads in steps)
    monkeypatch.setattr(cma, "_reason", "turned off by the test")  # as cma.disable() does, undone after
    assert not read(time.monotonic() + 60)  # direct reads turned off since it was made
    monkeypatch.undo()
    words.clear(slot)
    assert not read(time.monotonic() + 60)  # freed: the bytes are not to be used
    assert cma.prepared_read(os.getpid(), info, [(outs[0].data_ptr(), 4096), (outs[1].data_ptr(), 5)]) is None
    many = cma.DirectRead(address, nonce, [(0, 1)] * cma._FEW)
    assert cma.prepared_read(os.getpid(), many, [(0, 1)] * cma._FEW) is None  # read the usual way
    large = cma.DirectRead(address, nonce, [(0, cma.THREADED_MIN_NBYTES)])
    assert cma.prepared_read(os.getpid(), large, [(0, cma.THREADED_MIN_NBYTES)]) is None  # split over threads


@needs_direct
def test_a_refused_direct_read_falls_back_to_the_segment(agent, worker, monkeypatch):
    ref = worker.call("tests.helpers.tasks:put_filled", 1 << 20, 9)

    def refused(pid, pieces, *_):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(cma, "_read_pieces", refused)
    monkeypatch.setattr(cma, "_read_with_word", refused)  # an object of a few tensors: data and live word in one call
    monkeypatch.setattr(cma, "_checked", True)
    monkeypatch.setattr(cma, "_reason", None)
    got = tw.get(ref, transport="shm")
    assert torch.equal(got, torch.full((1 << 20,), 9, dtype=torch.uint8))
    assert cma.unavailable_reason().startswith("process_vm_readv was refused: ")  # the owner lives: off here


def test_partial_direct_reads_resume_where_the_kernel_stopped(monkeypatch):
    """process_vm_readv may copy less than asked (the kernel stops at a page it cannot
    read): every piece still arrives whole, in order, even cut mid-piece."""
    import ctypes

    import numpy as np

    calls = []

    def stingy(pid, local, count, remote, count2, flags):
        words = ctypes.POINTER(ctypes.c_uint64)
        dst = np.ctypeslib.as_array(ctypes.cast(local, words), (count, 2))
        src = np.ctypeslib.as_array(ctypes.cast(remote, words), (count2, 2))
        budget, copied = 7_000, 0  # less than one piece, not a multiple of anything
        for (d, n), (r, _) in zip(dst.tolist(), src.tolist(), strict=True):
            take = min(n, budget - copied)
            ctypes.memmove(d, r, take)
            copied += take
            if copied == budget:
                break
        calls.append(count)
        return copied

    monkeypatch.setattr(cma, "_readv", lambda: stingy)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (10_000, 0, 3, 25_000)]
    outs = [torch.zeros_like(s) for s in sources]
    pieces = [(o.data_ptr(), s.data_ptr(), s.numel()) for o, s in zip(outs, sources, strict=True)]
    cma._read_pieces(os.getpid(), pieces)
    assert all(torch.equal(o, s) for o, s in zip(outs, sources, strict=True))
    assert len(calls) == 6 and calls[0] == 3  # 35,003 bytes in 7,000-byte steps; the empty piece is skipped


@needs_direct
def test_a_direct_read_that_may_miss_its_deadline_goes_in_steps_and_says_so():
    words = cma.LiveWords()
    _, address, nonce = words.take()
    src = torch.arange(40 << 20, dtype=torch.uint8)
    info = cma.DirectRead(address, nonce, [(src.data_ptr(), src.numel())])
    out = torch.zeros_like(src)
    with pytest.raises(tw.TransferTimeoutError, match=r"shm test: not complete before the deadline") as caught:
        cma.read_into(os.getpid(), info, [(out.data_ptr(), out.numel())], deadline=time.monotonic(), what="shm test")
    done, total = (int(x) for x in re.search(r"\((\d+) of (\d+) bytes\)", str(caught.value)).groups())
    assert (total, 0 < done <= cma.STEP_NBYTES) == (40 << 20, True)  # one step, then the time was up
    assert torch.equal(out[:done], src[:done]) and not out[done:].any()
    with pytest.raises(tw.TransportError, match="sizes and the consumer's buffers disagree"):
        cma.read_into(os.getpid(), info, [(out.data_ptr(), 100)])
    assert cma.read_into(os.getpid(), info, [(out.data_ptr(), out.numel())], deadline=time.monotonic() + 600)
    assert torch.equal(out, src)


@needs_direct
def test_a_held_objects_kept_addresses_still_see_free_and_changes(agent, worker):
    """A consumer that holds a reference keeps the owner's addresses (no round trip on the
    next fetch); the live word still makes a fetch after free() an ObjectFreedError."""
    value = torch.full((200_000,), 4, dtype=torch.uint8)
    ref = tw.put(value)
    worker.call("tests.helpers.tasks:hold", pickle.loads(pickle.dumps(ref)), "kept")
    assert worker.call("tests.helpers.tasks:get_kept_error", "kept", transport="shm") == "ok"
    value.fill_(6)  # another reference to the held object: the kept addresses serve it
    assert worker.call("tests.helpers.tasks:get_digest", pickle.loads(pickle.dumps(ref)), transport="shm") == digest(
        value
    )
    tw.free(ref)
    assert worker.call("tests.helpers.tasks:get_kept_error", "kept", transport="shm") == "ObjectFreedError"
    worker.call("tests.helpers.tasks:drop", "kept")


@needs_direct
def test_a_held_object_is_described_once(agent, worker, monkeypatch):
    ref = worker.call("tests.helpers.tasks:put_filled", 1 << 20, 5)
    asked = []
    original = memfd.FdClient.addresses

    def counting(self, *args, **kwargs):
        asked.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(memfd.FdClient, "addresses", counting)
    out = torch.zeros(1 << 20, dtype=torch.uint8)
    for _ in range(3):
        out.zero_()
        tw.get(ref, out=out, transport="shm")
        assert int(out.sum()) == 5 << 20
    assert len(asked) == 1  # the addresses are kept while this process holds the reference
    assert tw.stats()["recent"][-1].transport == "shm"


def test_forget_object_entered_again_by_a_finalizer_on_its_thread_finishes_and_closes_every_descriptor():
    """A reference's finalizer calls ``forget_object``, and the garbage collector can run it on
    a thread already inside ``forget_object`` (an allocation there starts a collection). That
    must neither block (a consumer hung so under load) nor leave a descriptor open."""
    from tensorwire.transport.backends.shm.transport import ShmTransport

    transport = ShmTransport(None)
    pipes = [os.pipe() for _ in range(3)]
    for i, (read_end, write_end) in enumerate(pipes):
        os.close(write_end)
        transport._kept[(b"first" if i == 0 else b"other", bytes([i]))] = (read_end, 0)
    entered, finished = collector_reenters(
        lambda: transport.forget_object(b"first"),
        inside=ShmTransport.forget_object,
        lock=transport._kept_lock,
        reenter=lambda: transport.forget_object(b"other"),
    )
    assert entered, "the collector never ran inside forget_object's lock: the test did not test it"
    assert finished, "forget_object blocked when a finalizer entered it again on its thread"
    assert not transport._kept
    for read_end, _ in pipes:
        with pytest.raises(OSError):
            os.fstat(read_end)


def test_live_words_grow_without_waking_the_collector_and_a_freed_slot_is_kept():
    """Making a new chunk of live words used to allocate thousands of tuples inside take's lock:
    the garbage collector ran there (a gen-2 pass costs a Ray worker tens of ms, and a finalizer
    in it freed an object, re-entering the lock). The slots are plain ints now: collecting at
    every allocation, none starts inside the lock; a slot freed meanwhile stays takeable."""
    words = cma.LiveWords()
    first = [words.take()[0] for _ in range(cma.LiveWords._CHUNK)]  # the first chunk, all taken
    entered, finished = collector_reenters(
        words.take, inside=cma.LiveWords.take, lock=words._lock, reenter=lambda: words.clear(first[0])
    )
    assert finished and not entered, "a collection ran inside take's lock while the live words grew"
    words.clear(first[0])
    later = {words.take()[0] for _ in range(cma.LiveWords._CHUNK)}
    assert first[0] in later and len(later) == cma.LiveWords._CHUNK  # all distinct, the freed one among them


def test_an_offer_withdrawn_while_its_segment_is_made_answers_unknown_and_closes_the_segment(tmp_path):
    """A finalizer run inside a lazy segment's ``make()`` (it allocates) may free that very
    object: the server withdraws the offer on the same thread. That must not block the
    server, and the segment made meanwhile must be closed, not served or leaked."""
    server, client = memfd.FdServer(str(tmp_path)), memfd.FdClient()
    made: list[int] = []
    inodes: list[int] = []

    def make() -> tuple[int, int]:
        made.append(memfd.create_memfd(4096))
        inodes.append(os.fstat(made[-1]).st_ino)
        server.withdraw(b"k" * 16)  # what the finalizer does
        return made[-1], 4096

    try:
        server.offer_lazy(b"k" * 16, b"t" * 16, make, addresses=b"")
        with pytest.raises(memfd.SegmentUnknownError):
            client.receive(server.path, b"k" * 16, b"t" * 16, deadline=time.monotonic() + 20)
        assert len(made) == 1
        try:  # closed by the server (its number may be in use again, for something else)
            still_open = os.fstat(made[0]).st_ino == inodes[0]
        except OSError:
            still_open = False
        assert not still_open
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("device", ["cuda:0", "xpu:0", "mps"])
def test_only_objects_wholly_on_the_cpu_are_offered(device):
    """shm hands out host addresses: an object with one tensor elsewhere (even a device the
    selector counts as host memory) is left to other transports."""
    from tensorwire.transport.contract import StoredObject, TensorMeta

    tensors = [torch.zeros(4), torch.zeros(4)]
    metas = (TensorMeta((4,), "float32", "cpu", 16, 0), TensorMeta((4,), "float32", device, 16, 64))
    stored = StoredObject(b"o" * 16, b"t" * 16, tensors, metas, 128)
    assert not stored.host_only
    assert shm.ShmTransport(None).export(stored) is None
    assert StoredObject(b"p" * 16, b"t" * 16, tensors, metas[:1] * 2, 128).host_only
