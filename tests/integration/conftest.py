"""The ``ray_local`` fixture of the integration and collective tests."""

from __future__ import annotations

import gc

import pytest

from tests.helpers.ray_sessions import shared_ray


@pytest.fixture(scope="module")
def ray_local():
    """``tw.init`` on a local Ray (no dashboard), shared with the other modules that ask for it
    (``tests/helpers/ray_sessions.py``)."""
    import ray

    shared_ray()
    yield ray
    gc.collect()  # this module's actors go with their last handles
