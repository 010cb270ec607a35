"""The ``ray_local`` fixture of the integration and collective tests."""

from __future__ import annotations

import gc

import pytest

from tests.helpers.ray_sessions import ensure_shared_ray, stop_shared_ray


@pytest.fixture(scope="module")
def ray_local(request: pytest.FixtureRequest):
    """``tw.init`` on a local Ray (no dashboard), shared with the other modules that ask for it
    (``tests/helpers/ray_sessions.py``); stopped after a module in which a test failed."""
    import ray

    ensure_shared_ray()
    failed_before = request.session.testsfailed
    yield ray
    gc.collect()  # this module's actors go with their last handles
    if request.session.testsfailed > failed_before:  # a traceback may keep some: start afresh
        stop_shared_ray()
