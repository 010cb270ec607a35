"""References and the actor runtime (the only layer that may import Ray)."""
