"""``tensorwire bench``: transports and their alternatives measured side by side, in one run.

One core for two front ends: the command line (``tensorwire bench``, ``python -m benchmarks``)
and the pytest-benchmark suite in ``benchmarks/``. See :mod:`tensorwire.bench.runner`.
"""
