"""Planning a weight sync (pure metadata, no actors): who holds which piece (:mod:`.layout`),
names and fused parameters (:mod:`.mapping`), which bytes each receiver reads from which
trainer (:mod:`.plan`), and the one bucket policy (:mod:`.buckets`)."""

__all__: list[str] = []
