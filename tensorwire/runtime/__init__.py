"""References and the actor runtime (the only layer of the library that imports Ray; the bench's
baselines of Ray's own transports, ``bench/ray_baselines.py``, do too).

``refs/``: what works without Ray (references, reading, placement, repeats, values, ``put``/
``get``); ``ray/``: the Ray integration (start, calls, actors and handles, the registered Ray
tensor transport with its metadata and options, the surface of Ray it relies on); ``agent``:
this process's agent as the layers above the transport reach it.
"""

__all__: list[str] = []
