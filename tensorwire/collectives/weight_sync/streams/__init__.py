"""Serving one stream of buckets to its readers (:mod:`.fanout`: a trainer, or a receiver
relaying to its node), and where a bucket's bytes wait for them (:mod:`.staging`: staging
pools, same-node rings, packing and unpacking a slot)."""

__all__: list[str] = []
