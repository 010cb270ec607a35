"""Which registrations a READ of some rows may resolve to (:mod:`tensorwire.transport.backends.nixl.overlaps`)."""

from __future__ import annotations

from types import SimpleNamespace

from tensorwire.transport.backends.nixl.overlaps import overlapping


def _reg(address: int, nbytes: int, vram: bool = False) -> SimpleNamespace:
    return SimpleNamespace(key=(address, nbytes, vram, 0))


def test_registrations_that_share_a_byte_with_a_row_and_no_others():
    regs = {
        "before": _reg(0, 100),  # ends where the first row starts
        "into_first": _reg(50, 60),  # its last 10 bytes are the first row's first
        "inside_gap": _reg(260, 20),  # between the rows, touching neither
        "around_second": _reg(250, 1000),  # covers the second row
        "inside_second": _reg(310, 8),
        "after": _reg(400, 50),  # starts where the second row ends
        "vram_same_bytes": _reg(100, 100, vram=True),  # other memory kind
    }
    rows = [(300, 100, 0), (100, 150, 0)]  # unsorted on purpose: [300, 400) and [100, 250)
    found = overlapping(regs.values(), rows, vram=False)
    assert sorted(name for name, r in regs.items() if r in found) == ["around_second", "inside_second", "into_first"]
    assert overlapping(regs.values(), rows, vram=True) == [regs["vram_same_bytes"]]


def test_a_long_row_ending_late_is_seen_past_shorter_rows_after_it():
    # the row starting first reaches furthest: a registration after the later rows still overlaps it
    rows = [(0, 1000, 0), (10, 5, 0), (20, 5, 0)]
    late = _reg(900, 10)
    assert overlapping([late], rows, vram=False) == [late]
    assert overlapping([_reg(1000, 10)], rows, vram=False) == []


def test_no_rows_or_no_registrations():
    assert overlapping([_reg(0, 10)], [], vram=False) == []
    assert overlapping([], [(0, 10, 0)], vram=False) == []
