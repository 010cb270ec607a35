"""``tensorwire.progress.ProgressBar``: tqdm on stderr, nothing when disabled, stdout untouched."""

from __future__ import annotations

import re

from tensorwire.progress import ProgressBar


def test_an_enabled_bar_draws_every_step_on_stderr_and_follows_a_changed_total(capsys):
    with ProgressBar(2, desc="work", unit="item") as bar:
        bar.step("first")
        bar.total = 3  # learnt while running (the bench adds forced transports once known)
        bar.step("second")
        bar.advance_to(3, "third")
        bar.advance_to(1)  # never goes back
    out, err = capsys.readouterr()
    assert out == ""
    drawn = re.findall(r"work: +\d+%\|[^|]*\| (\d+)/(\d+) \[[^]]*?(?:, (\w+))?\]", err)
    assert [(int(n), int(t)) for n, t, _ in drawn] == [(0, 2), (1, 2), (1, 3), (2, 3), (3, 3), (3, 3)], err
    assert [w for _, _, w in drawn][-1] == "third"
    assert bar.done == 3


def test_a_disabled_bar_writes_nothing_but_counts(capsys):
    bar = ProgressBar(5, desc="quiet", enabled=False)
    bar.step("a")
    bar.total = 6
    bar.advance_to(4)
    bar.close()
    assert capsys.readouterr() == ("", "")
    assert (bar.done, bar.total) == (4, 6)
