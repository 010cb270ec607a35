"""Run-time transport registrations travel to the Ray actors and tasks started after them in
``runtime_env["env_vars"]["TENSORWIRE_TRANSPORTS"]`` (the Ray part runs in
``tests/conformance/test_entry_point.py``: an actor finds ``testfile`` with no call)."""

from __future__ import annotations

import pytest

from tensorwire.runtime.ray.worker_transports import with_registrations
from tensorwire.transport import registry

TARGET = "tests.helpers.entry_point_transport:EntryPointTransport"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.delenv(registry.ENV, raising=False)
    before = registry.runtime_registrations()
    registry.register_transport("rt_one", TARGET)
    yield {**before, "rt_one": TARGET}
    registry.unregister_transport("rt_one")


def test_options_untouched_without_registrations(monkeypatch):
    monkeypatch.setattr(registry, "runtime_registrations", dict)
    options = {"num_cpus": 1}
    assert with_registrations(options) is options


def test_registrations_merge_into_runtime_env(registered, monkeypatch):
    options = {"num_cpus": 0, "runtime_env": {"env_vars": {"A": "1", registry.ENV: "mine=pkg.mod:Mine"}, "pip": []}}
    monkeypatch.setenv(registry.ENV, "inherited=pkg.mod:Inherited")
    got = with_registrations(options)
    env = got["runtime_env"]["env_vars"]
    assert env["A"] == "1" and got["runtime_env"]["pip"] == [] and got["num_cpus"] == 0
    expected = {**registered, "mine": "pkg.mod:Mine", "inherited": "pkg.mod:Inherited"}
    assert env[registry.ENV] == registry.encode_env(expected)
    assert options["runtime_env"]["env_vars"][registry.ENV] == "mine=pkg.mod:Mine"  # the caller's dict unchanged
