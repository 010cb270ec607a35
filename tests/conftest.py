"""Shared fixtures: hardware probe and markers, test-only transport, leak checks, the order of
the modules that share a local Ray instance."""

from __future__ import annotations

import functools
import itertools
import os
import pathlib
import sys

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # only loopback traffic on test machines
# Ray runs its workers at nice 15; next to busy processes at nice 0 (the load run,
# .ci/load-run) they got about 4% of a core each and the suite would take hours. The tests'
# Ray workers run at the same niceness as everything else, so load slows every process alike.
os.environ.setdefault("RAY_worker_niceness", "0")
# A loaded machine can take longer than Ray's default 30 s to start a local GCS (seen in CI runs
# with other processes busy): the tests and the processes they start wait up to 120 s for it.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=1)
def hardware() -> dict[str, object]:
    """One cached probe of the hardware the marked tests need."""
    import torch

    gpus, gpu_error = 0, ""
    try:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            torch.cuda.init()  # a driver that lists GPUs but cannot start fails here, not in the tests
    except Exception as e:
        gpus, gpu_error = 0, f"CUDA failed to start: {type(e).__name__}: {e}"
    rdma = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
    return {"gpus": gpus, "gpu_error": gpu_error, "rdma": rdma}


_RAY_MODULES = pytest.StashKey[frozenset[pathlib.Path]]()  # the modules that share a local Ray instance


@pytest.hookimpl(trylast=True)  # after -m and -k took out what does not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    hw = hardware()
    none_seen = hw["gpu_error"] or "this machine has none (torch.cuda sees 0 devices)"
    reasons = {
        "gpu": None if hw["gpus"] >= 1 else f"needs an NVIDIA GPU; {none_seen}",
        "multi_gpu": None
        if hw["gpus"] >= 2
        else f"needs 2 NVIDIA GPUs; this machine has {hw['gpus']}"
        + (f" ({hw['gpu_error']})" if hw["gpu_error"] else ""),
        "rdma": None if hw["rdma"] else "needs an RDMA NIC; /sys/class/infiniband is empty or missing",
    }
    for item in items:
        for marker, reason in reasons.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
    ray_modules = frozenset(item.path for item in items if "ray_local" in item.fixturenames)
    config.stash[_RAY_MODULES] = ray_modules
    items[:] = _shared_ray_modules_last(items, ray_modules)


_TESTS = pathlib.Path(__file__).resolve().parent


def _room(item: pytest.Item) -> tuple[str, ...]:
    """The top-level folder of ``tests/`` an item is in (``collectives``, ``runtime``, ...);
    outside ``tests/`` (``benchmarks/``), its own folder."""
    path = item.path.resolve()
    return path.relative_to(_TESTS).parts[:1] if path.is_relative_to(_TESTS) else (str(path.parent),)


def _shared_ray_modules_last(items: list[pytest.Item], ray_modules: frozenset[pathlib.Path]) -> list[pytest.Item]:
    """In each top-level folder of ``tests/`` (with its sub-folders), the modules that share a
    local Ray instance (``ray_local``) after the others, so that the instance starts once per
    folder (tests/helpers/ray_sessions.py)."""
    ordered: list[pytest.Item] = []
    for _room_name, group in itertools.groupby(items, key=_room):
        run = list(group)  # consecutive items of one folder
        ordered += [i for i in run if i.path not in ray_modules] + [i for i in run if i.path in ray_modules]
    return ordered


@pytest.fixture(scope="module", autouse=True)
def shared_ray_only_where_asked(request: pytest.FixtureRequest):
    """Before a module that does not share the local Ray instance: stop it (its processes would
    only load the machine, and the module may start its own)."""
    if request.path not in request.config.stash.get(_RAY_MODULES, frozenset()):
        from tests.helpers.ray_sessions import stop_shared_ray

        stop_shared_ray()


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_CALL_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    """After each test (its fixtures torn down, nothing else cleaned up): no object still owned
    by this process's agent, no tensorwire segment or segment descriptor left. The rules for
    what counts are in ``tests/helpers/leaks.py``. A test that failed is not checked again (its
    traceback keeps its references alive)."""
    from tests.helpers import leaks

    before = leaks.snapshot()
    yield
    if request.node.stash.get(_CALL_FAILED, False):
        return
    problems = leaks.leaks_since(before)
    if problems:
        pytest.fail(f"{request.node.nodeid} leaked: " + "; ".join(problems), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def clean_up_after_the_session():
    """Clean-up only (the checks are per test, in ``no_leaks``): stop the shared Ray instance and
    this process's agent.
    (Segments are anonymous: the kernel frees those of workers that tests killed on purpose.)"""
    yield
    from tensorwire.transport.agent.core import shutdown_agent
    from tests.helpers.ray_sessions import stop_shared_ray

    stop_shared_ray()
    shutdown_agent()


@pytest.fixture
def agent():
    """This process's agent, with its settings restored after the test."""
    from tensorwire.transport.agent.core import get_agent

    instance = get_agent()
    config = instance.config
    yield instance
    instance.set_config(config)


@pytest.fixture
def worker(request: pytest.FixtureRequest):
    """A worker process (closed after the test); a ``spawn`` one for ``gpu`` tests."""
    from tests.helpers.procs import Worker, start_method_for

    w = Worker(start_method=start_method_for(request.node))
    yield w
    w.close()


@pytest.fixture
def remote_worker():
    """A worker that claims another node (``TENSORWIRE_NODE_ID``): cross-node paths."""
    from tests.helpers.procs import Worker

    w = Worker(env={"TENSORWIRE_NODE_ID": "test-node-b"})
    yield w
    w.close()


@pytest.fixture
def over_null(agent):
    """Every fetch in this process forced through the test-only ``null`` transport (plain
    copies inside this process): the layers above the transports with no real one under them."""
    from dataclasses import replace

    from tensorwire.transport import register_transport, registered_transports, unregister_transport
    from tensorwire.transport.backends.null import NullTransport

    added = "null" not in registered_transports()
    if added:
        register_transport("null", NullTransport)
    agent.set_config(replace(agent.config, transport="null"))
    yield agent
    if added:
        unregister_transport("null")
