"""Per-pair weight-sync telemetry: the report's pairs and timeline, Prometheus totals, the plot."""

from __future__ import annotations

import prometheus_client
import pytest
import ray

import tensorwire as tw
from tensorwire.collectives.weight_sync.protocol.spec import BucketSpan, ReceiveResult
from tensorwire.collectives.weight_sync.report.telemetry import (
    PairSpan,
    PairStats,
    failover_pairs,
    pairs_of,
    plot_timeline,
    record,
)
from tensorwire.transport.agent import metrics
from tests.collectives.actors import Holder


def result(*spans: BucketSpan) -> ReceiveResult:
    return ReceiveResult(rank=0, version=1, nbytes=0, transfer_s=0, unpack_s=0, verify_s=0, seconds=0, spans=spans)


def test_pairs_sum_each_pairs_buckets_and_count_a_failed_members_pairs():
    names = {0: "trainer 0", 1: "trainer 1", 2: "receiver 5", 3: "receiver 6"}
    results = {
        5: result(BucketSpan(0, 0, "shm", 100.5, 0.25, 10), BucketSpan(1, 0, "nixl", 100.25, 0.5, 20)),
        6: result(BucketSpan(0, 0, "shm", 100.0, 0.125, 30), BucketSpan(0, 1, "shm", 100.75, 0.125, 40)),
    }
    pairs, timeline = pairs_of(results, names, started=100.0, failed=["trainer 1", "receiver 9"])
    assert pairs[("trainer 0", "receiver 6", "shm")] == PairStats("trainer 0", "receiver 6", "shm", 70, 2, 0.25, 0)
    assert pairs[("trainer 1", "receiver 5", "nixl")] == PairStats("trainer 1", "receiver 5", "nixl", 20, 1, 0.5, 1)
    assert pairs[("trainer 0", "receiver 5", "shm")].errors == 0
    assert pairs[("receiver 9", "", "")].errors == 1  # failed before any bucket: a pair of its own
    assert [(s.source, s.destination, s.start_s) for s in timeline] == [
        ("trainer 0", "receiver 5", 0.5),
        ("trainer 0", "receiver 6", 0.0),
        ("trainer 0", "receiver 6", 0.75),
        ("trainer 1", "receiver 5", 0.25),
    ]


def scraped(name: str, **labels: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


def test_a_push_reports_every_pair_exports_them_and_draws_them(ray_local, tmp_path):
    trainer = Holder.remote(16, 4 << 20, seed=1)
    receivers = [Holder.remote(16, 4 << 20, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=1 << 20, name="telemetry")
    before = {
        r: scraped(
            "tensorwire_sync_pair_bytes_total",
            sync="telemetry",
            source="trainer 0",
            destination=f"receiver {r}",
            transport="shm",
        )
        or 0.0
        for r in (0, 1)
    }
    report = sync.push()
    assert report.ok
    plan = sync.plan.pair_nbytes()
    assert {(k[0], k[1]) for k in report.pairs} == {("trainer 0", "receiver 0"), ("trainer 0", "receiver 1")}
    for (source, destination, transport), stats in report.pairs.items():
        rid = int(destination.split()[1])
        assert transport == "shm" and stats.errors == 0
        assert stats.nbytes == plan[(0, rid)] and stats.transfers == report.receivers[rid].transports["shm"]
        got = scraped(
            "tensorwire_sync_pair_bytes_total",
            sync="telemetry",
            source=source,
            destination=destination,
            transport=transport,
        )
        assert got == before[rid] + stats.nbytes
    assert len(report.timeline) == sum(s.transfers for s in report.pairs.values())
    assert all(0 <= s.start_s <= report.seconds and s.seconds >= 0 for s in report.timeline)
    path = tmp_path / "timeline.png"
    report.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sync.close()


def test_retries_and_failovers_are_counted_per_pair_and_exported():
    names = {0: "trainer 0", 1: "receiver 3"}
    retried, _ = pairs_of(
        {3: result(BucketSpan(0, 0, "shm", 5.0, 0.5, 8), BucketSpan(0, 1, "shm", 6.0, 0.5, 8))},
        names,
        started=5.0,
        retry=True,
    )
    assert retried[("trainer 0", "receiver 3", "shm")].retries == 2
    first, _ = pairs_of({3: result(BucketSpan(0, 0, "shm", 5.0, 0.5, 8))}, names, started=5.0)
    assert first[("trainer 0", "receiver 3", "shm")].retries == 0
    lost = failover_pairs({("trainer 1", "receiver 3"): 1})
    assert lost == {("trainer 1", "receiver 3", "-"): PairStats("trainer 1", "receiver 3", "-", failovers=1)}
    assert metrics.enable_prometheus()  # (the agent does it when it starts)
    labels = {"sync": "fo-test", "destination": "receiver 3"}
    record("fo-test", retried)
    record("fo-test", lost)
    record("fo-test", lost)
    assert scraped("tensorwire_sync_pair_retries_total", source="trainer 0", transport="shm", **labels) == 2
    assert scraped("tensorwire_sync_pair_failovers_total", source="trainer 1", transport="-", **labels) == 2


def test_a_dead_receivers_pairs_count_an_error(ray_local):
    trainer = Holder.remote(16, 4 << 20, seed=1)
    receivers = [Holder.remote(16, 4 << 20, seed=None) for _ in range(2)]
    sync = tw.WeightSync(trainer, receivers, source="weights", bucket_bytes=1 << 20, commit="each")
    ray.get(receivers[1].die_at.remote("receiver", 1))
    report = sync.push()
    assert set(report.failed) == {1}
    assert report.pairs[("receiver 1", "", "")].errors == 1  # its buckets died with it
    assert report.pairs[("trainer 0", "receiver 0", "shm")].errors == 0
    sync.close()


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from tensorwire.collectives.weight_sync.report.summary import SyncReport

    with pytest.raises(ImportError, match=r"pip install 'tensorwire\[plot\]'"):
        SyncReport(1, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0).plot(str(tmp_path / "x.png"))


def _pixels_near(image, rgb: tuple[float, float, float]) -> int:
    return int((abs(image[:, :, :3] - list(rgb)).max(axis=2) < 0.02).sum())


def test_the_timeline_plot_draws_every_bucket_as_a_bar_in_its_transports_colour(tmp_path):
    """The picture, read back: bars in the colour of each transport (tab10's first two, in
    sorted order), none of a transport with no bucket; a timeline with no buckets has none."""
    import matplotlib.image
    import matplotlib.pyplot as plt

    blue, orange = plt.get_cmap("tab10")(0)[:3], plt.get_cmap("tab10")(1)[:3]
    spans = [PairSpan("trainer 0", "receiver 0", "nixl", k, 0.01 * k, 0.008, 1) for k in range(4)]
    spans.append(PairSpan("trainer 1", "receiver 1", "shm", 0, 0.0, 0.04, 1))
    plot_timeline(spans, str(tmp_path / "both.png"))
    image = matplotlib.image.imread(str(tmp_path / "both.png"))
    nixl, shm = _pixels_near(image, blue), _pixels_near(image, orange)  # transports in sorted order
    assert nixl > 500 and shm > 500, (nixl, shm)
    plot_timeline(spans[:1], str(tmp_path / "one.png"))
    one = matplotlib.image.imread(str(tmp_path / "one.png"))
    assert _pixels_near(one, blue) > 500 and _pixels_near(one, orange) == 0
    plot_timeline([], str(tmp_path / "none.png"))
    none = matplotlib.image.imread(str(tmp_path / "none.png"))
    assert _pixels_near(none, blue) == 0 and _pixels_near(none, orange) == 0
