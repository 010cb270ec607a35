"""Bucket messages of weight sync: a typed kind byte, parsed or refused by name."""

from __future__ import annotations

import pytest

from tensorwire.collectives.fanout import BucketKind, message, mixed_payload, parse_message, parse_mixed
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
