"""Deliberately broken transports: they move the bytes, then write none of them into the
consumer's buffers (or only on the first fetches), so every check that claims to look at what
arrived must fail on them.

Any Python process (a ``tensorwire bench`` run, its peer processes, a benchmark script and its
workers, Ray workers) breaks the transports named in ``TENSORWIRE_TEST_BROKEN`` ("shm,host")
when ``tests/helpers/broken_site`` is on its ``PYTHONPATH`` (its ``sitecustomize`` calls
:func:`install` at start-up). ``TENSORWIRE_TEST_BROKEN_AFTER=N`` lets the first N fetches of
each process through intact, which only a check of every round catches.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import torch

ENV = "TENSORWIRE_TEST_BROKEN"
AFTER_ENV = "TENSORWIRE_TEST_BROKEN_AFTER"
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "broken_site")


def environment(transports: str, *, after: int = 0) -> dict[str, str]:
    """The environment a child process needs to break ``transports`` (comma-separated)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (SITE, root, os.environ.get("PYTHONPATH", "")) if p)
    return {ENV: transports, AFTER_ENV: str(after), "PYTHONPATH": path}


_fetches = itertools.count()


def _intact() -> bool:
    return next(_fetches) < int(os.environ.get(AFTER_ENV, "0") or 0)


def _writes_nothing(base: type) -> type:
    def fetch(self, request, dst: Sequence[torch.Tensor]) -> None:
        if _intact():
            return base.fetch(self, request, dst)
        scratch = [torch.empty_like(t) for t in dst]  # the protocol runs to its end, into scratch
        return base.fetch(self, request, scratch)

    def view(self, request) -> list[torch.Tensor]:  # zero-copy views (shm): zeros, not the producer's bytes
        views = base.view(self, request)
        return views if _intact() else [torch.zeros_like(v) for v in views]

    def repeater(self, request, dst: Sequence[torch.Tensor]) -> None:  # repeats go through the broken fetch
        return None

    members = {"fetch": fetch, "repeater": repeater, "__module__": __name__}
    if hasattr(base, "view"):
        members["view"] = view
    return type(f"WritesNothing{base.__name__}", (base,), members)


def install(names: str) -> list[str]:
    """Replace each transport in ``names`` (comma-separated) by its broken twin in this process."""
    from tensorwire.transport import registry

    broken = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        cls = registry.get_transport_class(name)
        registry.register_transport(name, _writes_nothing(cls), replace=True)
        broken.append(name)
    return broken
