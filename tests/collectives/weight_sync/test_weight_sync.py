"""WeightSync: bit-exact, in place, bounded memory, versioned, verified; a receiver killed
mid-sync; bad input."""

from __future__ import annotations

import re
import threading
import time

import pytest
import ray
import torch

import tensorwire as tw
from tensorwire.collectives.weight_sync.planning.buckets import cut as bucket_plan
from tensorwire.collectives.weight_sync.streams.staging import checksum
from tests.collectives.actors import Holder, digests
from tests.helpers.broken_transport import environment
from tests.helpers.observe import memfd_sizes


def shm_bytes() -> int:
    """Bytes in tensorwire's shared-memory segments that this process tree keeps right now."""
    return sum(memfd_sizes().values())


class PeakSampler:
    """Samples ``shm_bytes`` on a thread until stopped; ``peak`` above the level at start."""

    def __init__(self) -> None:
        self.base = shm_bytes()
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, shm_bytes() - self.base)
            self.samples += 1
            time.sleep(0.0005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def test_bucket_plan_cuts_in_order_and_gives_big_tensors_their_own_bucket():
    assert bucket_plan([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert bucket_plan([], 8) == []
    with pytest.raises(ValueError, match="positive"):
        bucket_plan([1], 0)


def test_checksum_sees_a_flipped_bit_and_an_order_change():
    a, b = torch.randn(1000), torch.arange(7, dtype=torch.uint8)  # 7 bytes: the byte-wise path
    base = checksum([a, b])
    flipped = a.clone()
    flipped.view(torch.int32)[500] ^= 1
    assert checksum([flipped, b]) != base
    assert checksum([b, a]) != base
    assert checksum([a.clone(), b.clone()]) == base


def with_env(**env: str) -> dict:
    """Actor options that set environment variables of its process."""
    return {"runtime_env": {"env_vars": env}}


def test_thousand_tensors_to_three_receivers_bit_exact_read_in_place(ray_local):
    trainer = Holder.options(**with_env(TENSORWIRE_SYNC_READS="in-place")).remote(1000, 64 << 20, seed=1)
    receivers = [Holder.remote(1000, 64 << 20, seed=None) for _ in range(3)]
    pointers = ray.get([r.data_ptrs.remote() for r in receivers])
    sizes = ray.get(trainer.sizes.remote())
    bucket = 4 << 20
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=bucket)
    assert sync.versions() == [0, 0, 0]
    sampler = PeakSampler()
    report = sync.push()
    peak = sampler.stop()
    assert report.ok, report.failed
    expected = ray.get(trainer.digest.remote())
    assert ray.get([r.digest.remote() for r in receivers]) == [expected] * 3
    assert ray.get([r.data_ptrs.remote() for r in receivers]) == pointers  # into the existing tensors
    assert sync.versions() == [1, 1, 1]
    assert report.nbytes == sum(sizes) and report.buckets == len(bucket_plan(sizes, bucket)) == 17
    assert all(r.transports == {"shm": 17} for r in report.receivers.values())
    # read in place: the receivers read the trainer's own tensors (contiguous, same dtype), so
    # the trainer staged nothing, in shared memory or elsewhere
    assert sampler.samples > 0 and peak == 0, (sampler.samples, peak)
    assert report.peak_staging_nbytes == 0 and report.in_place_nbytes == report.moved_nbytes == 3 * sum(sizes)
    assert "weight sync v1" in str(report) and "pack" in str(report)

    ray.get(trainer.step.remote(7))  # the trainer moves on; verified push of version 2
    verified = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=bucket, verify=True)
    verified.version = sync.version
    report = verified.push()
    assert report.ok and report.verify_s > 0
    expected = ray.get(trainer.digest.remote())
    assert ray.get([r.digest.remote() for r in receivers]) == [expected] * 3
    assert verified.versions() == [2, 2, 2]
    for s in (sync, verified):
        s.close()
    assert shm_bytes() == sampler.base  # the staging slots are gone


def test_ring_reads_go_through_a_ring_of_at_most_two_slots(ray_local):
    trainer = Holder.options(**with_env(TENSORWIRE_SYNC_READS="ring")).remote(100, 16 << 20, seed=1)
    receivers = [Holder.remote(100, 16 << 20, seed=None) for _ in range(2)]
    bucket = 2 << 20
    sampler = PeakSampler()  # (from before the sync is made: its rehearsal makes the ring)
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=bucket)
    report = sync.push()
    peak = sampler.stop()
    assert report.ok, report.failed
    assert ray.get([r.digest.remote() for r in receivers]) == [ray.get(trainer.digest.remote())] * 2
    # at most two buckets exist at once (sampled from the segments, and as reported; how often
    # the sampler looked depends on the machine's load, so only what it saw is checked)
    assert sampler.samples > 0 and 0 <= peak <= 2 * bucket + 64 * 1024, (sampler.samples, peak)
    assert 0 < report.peak_staging_nbytes <= 2 * bucket + 64 * 1024  # the ring: two slots
    assert report.in_place_nbytes == 0 and report.moved_nbytes == 2 * sum(ray.get(trainer.sizes.remote()))
    sync.close()
    assert shm_bytes() == sampler.base  # the ring is gone


def test_a_receiver_killed_mid_sync_does_not_stall_the_others(ray_local):
    trainer = Holder.remote(64, 256 << 20, seed=2)
    receivers = [Holder.remote(64, 256 << 20, seed=None) for _ in range(3)]
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=8 << 20, commit="each")
    ray.get(receivers[1].die_at.remote("receiver", 3))  # killed after its fourth of 32 buckets
    report = sync.push()
    assert list(report.failed) == [1] and "died" in report.failed[1]
    expected = ray.get(trainer.digest.remote())
    assert ray.get([receivers[0].digest.remote(), receivers[2].digest.remote()]) == [expected] * 2
    assert sync.versions() == [1, -1, 1]
    report = sync.push()  # the dead one is left out from now on
    assert set(report.receivers) == {0, 2} and "left out" in report.failed[1]
    sync.close()


def test_a_failing_trainer_or_receiver_ends_the_push_at_once(ray_local):
    trainer = Holder.remote(8, 1 << 20, seed=1)
    receivers = [Holder.remote(8, 1 << 20, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=256 << 10, timeout_s=120, commit="each")
    ray.get(receivers[0].reshape_first.remote())
    start = time.monotonic()
    report = sync.push()  # the receiver tells the trainer; the other one completes
    assert list(report.failed) == [0] and "changed shape" in report.failed[0]
    assert ray.get(receivers[1].digest.remote()) == ray.get(trainer.digest.remote())
    ray.get(trainer.reshape_first.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="trainer's tensors changed"):
        sync.push()  # the trainer tells the receivers at once: nobody waits for the 120 s deadline
    assert time.monotonic() - start < 60
    assert sync.versions() == [0, 1]
    sync.close()


def test_mismatched_receivers_and_bad_arguments_are_refused(ray_local):
    trainer = Holder.remote(4, 4096, seed=1)
    other = Holder.remote(3, 4096, seed=None)
    with pytest.raises(ValueError, match=r"receiver 0's 'layer0.weight' has global shape \[341\], its source"):
        tw.WeightSync(trainer, [other], source="weights")  # planned on the driver: the parameter named
    with pytest.raises(ray.exceptions.RayTaskError, match="no attribute 'model'"):
        tw.WeightSync(trainer, [other])
    with pytest.raises(ValueError, match="at least one receiver"):
        tw.WeightSync(trainer, [], source="weights")
    with pytest.raises(ValueError, match="appears twice"):
        tw.WeightSync(trainer, [trainer], source="weights")
    with pytest.raises(ValueError, match="bucket_bytes"):
        tw.WeightSync(trainer, [other], source="weights", bucket_bytes=0)


def test_progress_line_follows_the_buckets(ray_local, capfd):
    trainer = Holder.remote(16, 4 << 20, seed=1)
    receivers = [Holder.remote(16, 4 << 20, seed=None)]
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=1 << 20, progress=True)
    report = sync.push()
    sync.close()
    captured = capfd.readouterr()
    assert report.ok and report.buckets == 4
    # a tqdm bar on stderr, advanced by the trainer's per-bucket messages: it starts at 0 and ends at 4/4
    drawn = [int(n) for n in re.findall(r"weight sync v1: +\d+%\|[^|]*\| (\d+)/4 \[", captured.err)]
    assert drawn[0] == 0 and drawn[-1] == 4 and drawn == sorted(drawn), captured.err[-600:]
    assert "weight sync" not in captured.out


def test_verify_catches_a_bucket_corrupted_on_the_way(ray_local):
    """Receivers whose ``host`` transport writes none of a bucket's bytes into their tensors
    (tests/helpers/broken_transport.py): with ``verify=True`` each names the bucket's checksum
    mismatch and none commits; without, the push says it succeeded over bytes it never wrote,
    which is what ``verify`` is for."""
    broken = {"runtime_env": {"env_vars": environment("host")}}
    trainer = Holder.remote(8, 4 << 20, seed=1)
    receivers = [Holder.options(**broken).remote(8, 4 << 20, seed=None) for _ in range(2)]
    expected = ray.get(trainer.digest.remote())
    options = {"source": "weights", "transport": "host", "bucket_bytes": 1 << 20, "prepare": False}
    with pytest.raises(tw.TensorwireError, match=r"rehearsal failed .* checksum mismatch"):
        tw.WeightSync(trainer, receivers, verify=True, **{**options, "prepare": True})  # caught when made
    checked = tw.WeightSync(trainer, receivers, verify=True, name="checked", **options)
    unchecked = tw.WeightSync(trainer, receivers, name="unchecked", **options)
    try:
        report = checked.push()
        assert set(report.failed) == {0, 1}, report
        assert all("checksum mismatch" in why for why in report.failed.values()), report.failed
        assert checked.versions() == [0, 0]
        report = unchecked.push()
        assert report.ok and unchecked.versions() == [1, 1]  # nothing looked at the bytes...
        assert digests(receivers) != [expected] * 2  # ...and they are not the trainer's
    finally:
        checked.close()
        unchecked.close()
