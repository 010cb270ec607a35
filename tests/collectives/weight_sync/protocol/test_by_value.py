"""User functions in a push's spec travel by value: one defined in the user's script
(``__main__``) works in the members, where ``__main__`` is another program."""

from __future__ import annotations

import pickle
import sys

import pytest

from tensorwire.collectives.weight_sync.protocol.assign import _serialised
from tensorwire.collectives.weight_sync.protocol.spec import PushSpec

SCRIPT = """
def halve(name, tensor):
    return tensor / 2

def remember(receiver, version):
    receiver.seen = (SCALE, version)

SCALE = 3
"""


@pytest.fixture
def script_functions(monkeypatch):
    """Functions as a user's script defines them: module ``__main__``, reachable there while
    the driver pickles (so a plain pickle writes them by reference), gone when a member
    unpickles (its ``__main__`` is Ray's worker)."""
    namespace = {"__name__": "__main__"}
    exec(SCRIPT, namespace)
    main = sys.modules["__main__"]
    for name in ("halve", "remember", "SCALE"):
        monkeypatch.setattr(main, name, namespace[name], raising=False)
    yield namespace
    # (monkeypatch takes them away again)


def spec(**functions) -> PushSpec:
    return PushSpec("s", "w", 1, "", (), 0, None, (), (), False, "", 10.0, **functions)


def leave_the_script(monkeypatch):
    main = sys.modules["__main__"]
    for name in ("halve", "remember", "SCALE"):
        monkeypatch.delattr(main, name)


def test_a_script_function_unpickles_where_the_script_is_not(script_functions, monkeypatch):
    blob = _serialised(spec(transform=script_functions["halve"], on_commit=script_functions["remember"]))
    by_reference = pickle.dumps(spec(transform=script_functions["halve"]))  # what was sent before
    leave_the_script(monkeypatch)
    with pytest.raises(AttributeError, match="halve"):
        pickle.loads(by_reference)
    arrived = pickle.loads(blob)
    assert arrived.transform("w", 8.0) == 4.0

    class Receiver:
        seen = None

    receiver = Receiver()
    arrived.on_commit(receiver, 7)
    assert receiver.seen == (3, 7)  # with the script's global it read


def test_a_method_name_and_none_stay_as_they_are():
    arrived = pickle.loads(_serialised(spec(on_commit="loaded")))
    assert arrived.on_commit == "loaded" and arrived.transform is None


def test_an_importable_function_still_travels_by_reference():
    """cloudpickle writes a module-level function of an importable module as its name: small."""
    from tensorwire.units import nbytes_text

    arrived = pickle.loads(_serialised(spec(transform=nbytes_text)))
    assert arrived.transform is nbytes_text
