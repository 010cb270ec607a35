"""What a push reports: :class:`.summary.SyncReport` (totals, failed receivers, replaced
trainers) and per-pair telemetry with Prometheus totals and a timeline picture
(:mod:`.telemetry`)."""

__all__: list[str] = []
