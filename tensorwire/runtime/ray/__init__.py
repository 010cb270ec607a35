"""The Ray integration (public Ray API only): starting Ray, waiting for calls, ``tw.remote``
actors and their handles, references in arguments, actor hooks, the registered Ray tensor
transport (``transport``, ``transport_metadata``, ``transport_options``), transport
registrations reaching workers, and every part of Ray used beyond its documented API
(``surface``)."""

__all__: list[str] = []
