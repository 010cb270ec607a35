"""Collectives over actor groups and weight sync (not built yet; see docs/architecture.md)."""
