"""``python -m benchmarks.nixl_compare``: tensorwire nixl against a bare NIXL program, interleaved.

The benchmark itself is :mod:`tensorwire.bench.nixl_compare` (``tensorwire bench --scenarios nixl-compare``
runs it too, with the rows in the bench's table and JSON).
"""

import sys

from tensorwire.bench.nixl_compare import main

if __name__ == "__main__":
    sys.exit(main())
