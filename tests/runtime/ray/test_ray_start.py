"""tw.init starts a local Ray again when its node timed out during start-up (a loaded machine)."""

from __future__ import annotations

import pytest

from tensorwire.runtime.ray.start import _start_ray

TIMED_OUT = Exception("The current node timed out during startup. This could happen because ...")
GCS_LATE = RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_ab12")


class FakeRay:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls: list[tuple[str | None, dict]] = []
        self.shutdowns = 0

    def init(self, address=None, **kwargs):
        self.calls.append((address, kwargs))
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self):
        self.shutdowns += 1


def test_a_local_start_that_timed_out_is_tried_again(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = FakeRay([TIMED_OUT, GCS_LATE])  # the raylet, then the GCS, too slow
    _start_ray(ray, None, {"num_cpus": 2})
    assert ray.calls == [(None, {"num_cpus": 2})] * 3 and ray.shutdowns == 2


def test_it_gives_up_after_three_attempts(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = FakeRay([TIMED_OUT, TIMED_OUT, TIMED_OUT])
    with pytest.raises(Exception, match="timed out during startup"):
        _start_ray(ray, "local", {})
    assert len(ray.calls) == 3


@pytest.mark.parametrize("address", ["auto", "ray://head:10001"])
def test_joining_a_cluster_and_other_errors_are_not_retried(monkeypatch, address):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = FakeRay([TIMED_OUT])
    with pytest.raises(Exception, match="timed out"):
        _start_ray(ray, address, {})
    other = FakeRay([ValueError("num_cpus must not be provided")])
    with pytest.raises(ValueError):
        _start_ray(other, None, {})
    assert len(ray.calls) == len(other.calls) == 1 and ray.shutdowns == other.shutdowns == 0
