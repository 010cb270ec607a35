"""The built-in transports, one module (or small package) each, found by name through the
registry and imported only when used (:data:`tensorwire.transport.registry.BUILTIN_TRANSPORTS`).

Nothing outside :mod:`tensorwire.transport` imports from here: the layers above see
transports through the registry and the contract only.
"""

__all__: list[str] = []
