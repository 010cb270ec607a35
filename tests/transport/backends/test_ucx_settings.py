"""The UCX settings importing ucxx writes into the environment stay out of NIXL's UCX."""

from __future__ import annotations

import os
import sys
import types

import pytest

from tensorwire.transport.backends.nixl import engine as nixl_engine
from tensorwire.transport.config import ucxx_settings_hidden


@pytest.fixture
def ucxx_imported(monkeypatch):
    """As after ``import ucxx``: the module loaded and its settings in the environment."""
    monkeypatch.setitem(sys.modules, "ucxx", sys.modules.get("ucxx") or types.ModuleType("ucxx"))
    monkeypatch.setenv("UCX_RNDV_THRESH", "8192")
    monkeypatch.setenv("UCX_MAX_RNDV_RAILS", "1")


def test_ucxx_settings_are_hidden_meanwhile_and_restored(ucxx_imported, monkeypatch):
    monkeypatch.setenv("UCX_RNDV_FRAG_MEM_TYPE", "host")  # not ucxx's value: the user's, kept
    with ucxx_settings_hidden():
        assert "UCX_RNDV_THRESH" not in os.environ and "UCX_MAX_RNDV_RAILS" not in os.environ
        assert os.environ["UCX_RNDV_FRAG_MEM_TYPE"] == "host"
    assert (os.environ["UCX_RNDV_THRESH"], os.environ["UCX_MAX_RNDV_RAILS"]) == ("8192", "1")


def test_without_ucxx_the_same_values_are_the_users(monkeypatch):
    monkeypatch.delitem(sys.modules, "ucxx", raising=False)
    monkeypatch.setenv("UCX_RNDV_THRESH", "8192")
    with ucxx_settings_hidden():
        assert os.environ["UCX_RNDV_THRESH"] == "8192"


def test_a_nixl_agent_is_made_without_them(ucxx_imported, monkeypatch):
    seen = {}

    class Config:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    def made(name, config):
        seen.update(name=name, thresh=os.environ.get("UCX_RNDV_THRESH"), pause=config.pthrDelay)
        return "agent"

    bind = types.SimpleNamespace(nixlAgent=made)

    def agent(name, config):  # as NIXL's API does: builds its config, then calls the binding
        return bind.nixlAgent(name, types.SimpleNamespace(pthrDelay=0))

    api = types.SimpleNamespace(nixlBind=bind, nixl_agent_config=Config, nixl_agent=agent)
    monkeypatch.setattr(nixl_engine, "nixl_api", lambda: api)
    assert nixl_engine.new_agent("tw-test", ["UCX"]) == "agent"
    assert seen == {"name": "tw-test", "thresh": None, "pause": nixl_engine._PROGRESS_US}
    assert os.environ["UCX_RNDV_THRESH"] == "8192"
