"""The holder side of the protocol when references come and go on several threads: the
owner must never see this process release an object it references again."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

from tensorwire.transport.agent.holders import Holders
from tensorwire.transport.agent.wire import HolderOpKind
from tensorwire.transport.contract import ObjectDescriptor, PeerInfo

ME = PeerInfo(agent_id="me", node_id="n", machine_id="m", hostname="h", pid=1, start_time=1)
OWNER = replace(ME, agent_id="owner", pid=2)
DESC = ObjectDescriptor(b"o" * 16, b"t" * 16, OWNER, (), 0)


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[HolderOpKind, bytes]] = []

    def send(self, owner, kind, object_id, token, pin_id=b"") -> None:
        self.sent.append((kind, pin_id))


class _SlowForget:
    """Transports whose ``forget_object`` waits for the test (a mapping that takes time to close)."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def each(self, what, fn, level=None) -> None:
        self.entered.set()
        assert self.go.wait(30)


def _holders() -> tuple[Holders, _Outbox, _SlowForget]:
    outbox, transports = _Outbox(), _SlowForget()
    holders = Holders(
        lock=threading.RLock(),
        store=SimpleNamespace(owned=lambda desc: None),
        transports=transports,
        client=SimpleNamespace(outbox=lambda: outbox),
        peer=lambda: ME,
        config=lambda: None,
        closed=threading.Event(),
    )
    return holders, outbox, transports


def test_a_reference_back_while_the_last_one_closes_its_mappings_keeps_the_hold():
    holders, outbox, transports = _holders()
    holders.ref_attached(DESC)
    assert outbox.sent == [(HolderOpKind.REGISTER, b"")]
    last_one_goes = threading.Thread(target=holders.ref_detached, args=(DESC,))
    last_one_goes.start()
    assert transports.entered.wait(30)  # the last reference is closing its mappings
    assert not holders.holds(DESC.object_id)  # transports keep nothing new for it meanwhile
    holders.ref_attached(DESC, b"pin")  # another arrives (unpickled on another thread)
    transports.go.set()
    last_one_goes.join(30)
    # still a holder at the owner: no RELEASE, and no REGISTER that a late RELEASE would undo
    assert outbox.sent == [(HolderOpKind.REGISTER, b""), (HolderOpKind.UNPIN, b"pin")]
    assert holders.holds(DESC.object_id)
    holders.ref_detached(DESC)
    assert outbox.sent[-1] == (HolderOpKind.RELEASE, b"") and not holders.holds(DESC.object_id)
