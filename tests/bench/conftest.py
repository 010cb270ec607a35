"""The integration tests' Ray fixtures, shared here."""

from tests.integration.conftest import ray_local  # noqa: F401 - a fixture
