"""``python -m benchmarks [flags]``: the same as ``tensorwire bench [flags]``."""

import sys

from tensorwire.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
