"""Spawned peer processes (the benchmarks' and doctor's workers): answers, failures, a peer
that dies."""

from __future__ import annotations

import pytest

from tensorwire.peers import Peer


def test_a_peer_answers_and_reports_a_failure_by_name():
    with Peer() as peer:
        assert peer.call("math:gcd", 12, 18) == 6
        with pytest.raises(RuntimeError, match=r"peer: math:sqrt failed: ValueError"):
            peer.call("math:sqrt", -1)


def test_a_peer_that_dies_is_reported_dead_not_waited_for():
    # the call ends when the process does, named as such, not at the end of the deadline
    with Peer() as peer, pytest.raises(RuntimeError, match="the peer process exited before answering"):
        peer.call("os:_exit", 3, timeout_s=600)
