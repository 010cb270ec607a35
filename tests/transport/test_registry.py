from __future__ import annotations

import pytest

from tensorwire.transport import registry
from tensorwire.transport.contract import Capabilities, Transport


class Dummy(Transport):
    name = "dummy"
    capabilities = Capabilities(one_sided=False, same_process=False, same_node=True, cross_node=True)

    def fetch(self, request, dst):
        raise AssertionError("not used")

    def serve(self, obj, params):
        raise AssertionError("not used")


def test_builtins_load_lazily_by_name():
    assert registry.get_transport_class("shm").__name__ == "ShmTransport"
    assert set(registry.BUILTIN_TRANSPORTS) <= set(registry.registered_transports())


def test_unknown_name_suggests_and_lists():
    with pytest.raises(ValueError, match=r"did you mean 'shm'\?.*available: \[.*'host'.*forget to call"):
        registry.get_transport_class("shn")


def test_register_class_and_string_then_unregister():
    registry.register_transport("dummy", Dummy)
    try:
        assert registry.get_transport_class("dummy") is Dummy
        with pytest.raises(ValueError, match="already registered"):
            registry.register_transport("dummy", Dummy)
        registry.register_transport("dummy", f"{__name__}:Dummy", replace=True)
        assert registry.get_transport_class("dummy") is Dummy
    finally:
        registry.unregister_transport("dummy")
    assert "dummy" not in registry.registered_transports()


def test_bad_registrations_raise():
    with pytest.raises(ValueError, match="module:Class"):
        registry.register_transport("x1", "no_colon")
    with pytest.raises(TypeError):
        registry.register_transport("x2", object)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alphanumeric"):
        registry.register_transport("bad name", Dummy)
    registry.register_transport("other_name", Dummy)
    try:
        with pytest.raises(ValueError, match="has name 'dummy'"):
            registry.get_transport_class("other_name")
    finally:
        registry.unregister_transport("other_name")
