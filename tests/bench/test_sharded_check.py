"""The sharded-sync scenario's check can fail: it compares every round with a reference
computed apart from every method, from trainer values that change every round."""

from __future__ import annotations

from tensorwire.bench.sharded import DEFAULT, EACH, FIRST, NO_ASIDE


def test_the_sharded_check_counts_a_method_that_writes_nothing_every_round(ray_local):
    """The sharded scenario checks each round against the one pass over that round's trainer
    values (new every round), computed in the driver apart from every method: a method that
    leaves the receivers as cleared is wrong by every receiver byte in every kept round; the
    real methods, first pushes included, by none."""
    from tensorwire.bench import sharded

    bench = sharded.Bench(1 << 20, bucket_bytes=1 << 18)
    try:
        real = bench.methods

        def with_a_broken_one() -> dict:
            return {**real(), "writes nothing": (lambda: None, True)}

        bench.methods = with_a_broken_one
        samples, wrong = sharded.measure(bench, 2)
        assert wrong.pop("writes nothing") == 2 * sum(bench.receiver_nbytes) > 0
        assert wrong == dict.fromkeys(wrong, 0) and all(len(times) == 2 for times in samples.values())
        assert {DEFAULT + FIRST, EACH + FIRST, NO_ASIDE + FIRST} <= set(wrong)
    finally:
        bench.close()
