"""Every transfer is recorded (stats, Prometheus); observers never break a transfer."""

from __future__ import annotations

from prometheus_client import REGISTRY

import tensorwire as tw
from tensorwire.transport.agent import metrics
from tests.helpers.tasks import digest


def sample(name: str, transport: str) -> float:
    return REGISTRY.get_sample_value(name, {"transport": transport}) or 0.0


def test_real_transfer_is_recorded_everywhere(agent, worker):
    ref, expected = worker.call("tests.helpers.tasks:put_and_return", 3 << 20)
    before = (sample("tensorwire_transfers_total", "shm"), sample("tensorwire_transfer_bytes_total", "shm"))
    assert digest(tw.get(ref, transport="shm")) == expected
    record = tw.stats()["recent"][-1]
    assert (record.transport, record.nbytes) == ("shm", 3 << 20)
    assert record.src == ref._desc.owner.agent_id and record.dst == agent.peer.agent_id
    assert "forced" in record.reason and record.duration_s > 0
    assert sample("tensorwire_transfers_total", "shm") == before[0] + 1
    assert sample("tensorwire_transfer_bytes_total", "shm") == before[1] + (3 << 20)
    assert REGISTRY.get_sample_value("tensorwire_transfer_seconds_count", {"transport": "shm"}) >= 1
    assert tw.stats()["transfers"]["shm"]["nbytes"] >= 3 << 20


def test_failing_observer_does_not_fail_the_transfer(worker):
    seen = []

    def broken(record):
        seen.append(record.transport)
        raise RuntimeError("observer bug")

    metrics.add_observer(broken)
    try:
        ref, expected = worker.call("tests.helpers.tasks:put_and_return", 1 << 20)
        assert digest(tw.get(ref, transport="host")) == expected
        assert seen == ["host"]
    finally:
        metrics.remove_observer(broken)


def test_totals_are_kept_per_thread_and_summed_when_read():
    import threading

    totals = metrics.Totals()
    record = metrics.TransferRecord("t", "reason", 10, 0.003, "a", "b", False)

    def work() -> None:
        for _ in range(1000):
            totals.add(record)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert totals._tables == []  # the four threads ended: their numbers were folded in
    totals.add(metrics.TransferRecord("u", "reason", 5, 99.0, "a", "b", False))  # past the last bound
    row, other = totals.by_transport()["t"], totals.by_transport()["u"]
    assert row[:2] == [4000, 40000] and abs(row[2] - 12.0) < 1e-9
    buckets = row[3:]
    assert buckets[metrics.BUCKETS.index(5e-3)] == 4000 and sum(buckets) == 4000  # 2.5 ms < 3 ms <= 5 ms
    assert other[-1] == 1 and sum(other[3:]) == 1


def test_prometheus_histogram_is_cumulative_per_bound(agent, worker):
    ref, expected = worker.call("tests.helpers.tasks:put_and_return", 1 << 20)
    assert digest(tw.get(ref, transport="host")) == expected
    labels = {"transport": "host"}
    counts = [
        REGISTRY.get_sample_value("tensorwire_transfer_seconds_bucket", {**labels, "le": le})
        for le in [*map(str, metrics.BUCKETS), "+Inf"]
    ]
    assert counts == sorted(counts) and counts[-1] == sample("tensorwire_transfers_total", "host") >= 1
    assert REGISTRY.get_sample_value("tensorwire_transfer_seconds_count", labels) == counts[-1]
