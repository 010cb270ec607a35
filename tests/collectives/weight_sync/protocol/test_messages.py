"""The messages of a weight-sync push (protocol/messages.py): bucket messages with a typed kind
byte, parsed or refused by name; every key distinct; decisions and reasons round-trip."""

from __future__ import annotations

import pytest

from tensorwire.collectives.weight_sync.protocol import messages
from tensorwire.collectives.weight_sync.protocol.messages import (
    BucketKind,
    ReceiverFailure,
    mixed_payload,
    parse_mixed,
)
from tensorwire.collectives.weight_sync.protocol.messages import bucket_message as message
from tensorwire.collectives.weight_sync.protocol.messages import parse_bucket_message as parse_message
from tensorwire.errors import TensorwireError


def test_every_kind_round_trips_with_its_checksum_and_payload():
    for kind in BucketKind:
        assert parse_message(message(kind, 2**64 - 1, b"payload"), "bucket 0") == (kind, 2**64 - 1, b"payload")
    assert [k.value for k in BucketKind] == [b"R", b"O", b"M", b"A"]  # the wire bytes stay what they were


def test_a_mixed_payload_says_which_pieces_come_from_where():
    ring, announcement = b"\x00" * 8 + b"slot-name", b"announced object"
    payload = mixed_payload([True, False, False, True], ring, announcement)
    assert parse_mixed(payload) == ([True, False, False, True], ring, announcement)
    assert parse_mixed(mixed_payload([], b"", b"x")) == ([], b"", b"x")


@pytest.mark.parametrize("data", [b"", b"R", b"X" + bytes(8), b"r" + bytes(8)])
def test_a_malformed_message_names_the_bucket_and_what_was_seen(data):
    with pytest.raises(TensorwireError, match=r"bucket 3 from member 1: not a bucket message \(\d+ bytes, kind "):
        parse_message(data, "bucket 3 from member 1")


def test_every_key_of_a_push_is_distinct_and_names_its_stream_bucket_or_rank():
    keys = [
        messages.bucket_key(1, 2),
        messages.ack_key(1, 2),
        messages.progress_key(1, 2),
        messages.ready_key(1),
        messages.stalled_key(1),
        messages.DECISION_KEY,
    ]
    assert len(set(keys)) == len(keys)
    assert messages.bucket_key(3, 4) == "s3/b4" and messages.ack_key(3, 4) == "s3/b4/ack"  # the wire keys stay
    assert messages.bucket_key(1, 2) != messages.bucket_key(2, 1)
    assert messages.ready_key(1) != messages.ready_key(2) and messages.stalled_key(1) != messages.stalled_key(2)


def test_a_lost_trainer_decision_carries_its_rank_and_why_and_nothing_else_parses_as_one():
    decision = messages.lost_trainer_decision(3, "died during the push")
    assert decision.startswith(messages.TRAINER_LOST_PREFIX)
    assert messages.parse_lost_trainer(decision) == (3, "died during the push")
    assert messages.parse_lost_trainer(messages.lost_trainer_decision(-1, "x" * 10_000))[0] == -1
    assert len(messages.lost_trainer_decision(0, "x" * 10_000)) == messages.MAX_REASON_NBYTES
    assert messages.parse_lost_trainer(messages.COMMIT) is None
    assert messages.parse_lost_trainer(messages.ABORT_PREFIX + b"3 a receiver failed") is None


def test_only_a_receiver_left_out_keeps_a_version_from_failing_and_only_its_own_faults_count():
    assert [kind for kind in ReceiverFailure if not kind.ends_the_version] == [ReceiverFailure.LEFT_OUT]
    own = {kind for kind in ReceiverFailure if kind.fault_of_its_own}
    assert own == {ReceiverFailure.DIED, ReceiverFailure.FAILED}
