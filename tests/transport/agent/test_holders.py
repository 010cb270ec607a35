"""The holder side of the protocol when references come and go on several threads: the
owner must never see this process release an object it references again."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

from tensorwire.transport.agent.holders import LINGER_MAX, Holders
from tensorwire.transport.agent.wire import HolderOpKind
from tensorwire.transport.config import Config
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


class _Forgets:
    """Transports that note which objects they were told to forget."""

    def __init__(self) -> None:
        self.forgotten: list[bytes] = []

    def each(self, what, fn, level=None) -> None:
        fn(SimpleNamespace(forget_object=self.forgotten.append))


def _holders(linger_s: float = 0.0, transports=None) -> tuple[Holders, _Outbox, object]:
    outbox, transports = _Outbox(), transports or _SlowForget()
    holders = Holders(
        lock=threading.RLock(),
        store=SimpleNamespace(owned=lambda desc: None),
        transports=transports,
        client=SimpleNamespace(outbox=lambda: outbox),
        peer=lambda: ME,
        config=lambda: Config(hold_linger_s=linger_s),
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


def test_a_reference_received_anew_within_the_linger_takes_the_hold_over():
    """A consumer that gets a new reference to the same object in every message: while the
    last one lingers, the next takes its hold (no RELEASE then REGISTER at the owner, the
    transports keep their state of the object); an idle hold goes after the linger."""
    holders, outbox, transports = _holders(linger_s=5.0, transports=_Forgets())
    holders.ref_attached(DESC)
    for round_ in range(3):
        holders.ref_detached(DESC)  # the message's reference is dropped...
        assert not holders.holds(DESC.object_id)
        holders.ref_attached(DESC, b"pin%d" % round_)  # ...and the next message brings a new one
    assert outbox.sent == [(HolderOpKind.REGISTER, b"")] + [(HolderOpKind.UNPIN, b"pin%d" % r) for r in range(3)]
    assert transports.forgotten == []
    holders.ref_detached(DESC)
    assert holders.let_go_idle() == 0  # not idle long enough
    assert holders.let_go_idle(now=time.monotonic() + 5.0) == 1
    assert outbox.sent[-1] == (HolderOpKind.RELEASE, b"") and transports.forgotten == [DESC.object_id]


def test_without_a_linger_the_last_reference_lets_go_at_once():
    holders, outbox, transports = _holders(linger_s=0.0, transports=_Forgets())
    holders.ref_attached(DESC)
    holders.ref_detached(DESC)
    assert outbox.sent == [(HolderOpKind.REGISTER, b""), (HolderOpKind.RELEASE, b"")]
    assert transports.forgotten == [DESC.object_id]


def test_at_most_linger_max_idle_holds_are_kept_the_oldest_goes_first():
    holders, outbox, _transports = _holders(linger_s=60.0, transports=_Forgets())
    descs = [replace(DESC, object_id=bytes([i]) * 16) for i in range(LINGER_MAX + 2)]
    for desc in descs:
        holders.ref_attached(desc)
        holders.ref_detached(desc)
    released = [kind for kind, _pin in outbox.sent if kind is HolderOpKind.RELEASE]
    assert len(released) == 2 and holders.counts()[0] == LINGER_MAX
    holders.ref_attached(descs[0])  # the oldest was let go: a new reference registers again
    assert outbox.sent[-1] == (HolderOpKind.REGISTER, b"")


def test_a_large_object_is_let_go_at_once_and_idle_bytes_are_capped():
    """Lingering must not keep much memory at the owners: an object of more than
    LINGER_MAX_NBYTES is released at its last reference, and the idle holds' bytes stay under it."""
    from tensorwire.transport.agent.holders import LINGER_MAX_NBYTES
    from tensorwire.transport.metadata import TensorMeta

    def sized(i: int, nbytes: int) -> ObjectDescriptor:
        meta = TensorMeta((nbytes,), "uint8", "cpu", nbytes, 0)
        return replace(DESC, object_id=bytes([i]) * 16, metas=(meta,))

    holders, outbox, _transports = _holders(linger_s=60.0, transports=_Forgets())
    big = sized(1, LINGER_MAX_NBYTES + 1)
    holders.ref_attached(big)
    holders.ref_detached(big)
    assert outbox.sent[-1] == (HolderOpKind.RELEASE, b"")
    half = LINGER_MAX_NBYTES // 2 + 1  # two of these are over the cap together
    for i in (2, 3):
        holders.ref_attached(sized(i, half))
        holders.ref_detached(sized(i, half))
    assert [kind for kind, _ in outbox.sent].count(HolderOpKind.RELEASE) == 2  # the big one, then the older half
    assert holders.counts()[0] == 1
