"""ucx specifics: the settings tensorwire asks UCX for."""

from __future__ import annotations

import importlib.util

import pytest

from tensorwire.transport.backends.ucx import ucx_config
from tests.helpers.procs import Worker

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
)


def test_cma_is_left_out_unless_the_user_chose_the_transports():
    assert ucx_config({}) == {"TLS": "^cma"}
    assert ucx_config({"UCX_TLS": "cma,self"}) == {}


def test_a_default_worker_runs_without_cma_but_keeps_shared_memory():
    producer = Worker(env={"TENSORWIRE_NODE_ID": "ucx-cfg-a"})
    consumer = Worker(env={"TENSORWIRE_NODE_ID": "ucx-cfg-b"})
    try:
        ref, expected = producer.call("tests.helpers.tasks:put_and_return", 4 << 20, seed=2)
        assert consumer.call("tests.helpers.tasks:get_digest", ref, transport="ucx") == expected
        active = set(consumer.call("tests.helpers.tasks:ucx_active_transports"))
        assert "cma" not in active and active & {"posix", "sysv"}, active
    finally:
        producer.close()
        consumer.close()
