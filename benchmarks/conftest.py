"""The regression suite talks over loopback only."""

import os

os.environ.setdefault("TENSORWIRE_HOST", "127.0.0.1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
