"""References and reading them, without Ray: ``Ref`` and what it carries, fetching a value
(reading, placement, repeats), the value walker, registering tensors, and ``put``/``get``/
``wait``/``free``/``stats``. Nothing here imports Ray (``api`` looks for a Ray reference only
when Ray is already imported)."""

__all__: list[str] = []
