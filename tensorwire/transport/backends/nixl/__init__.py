"""nixl: one-sided READs through NVIDIA NIXL (extra ``nixl``).

:mod:`.transport` is the transport; :mod:`.engine` imports NIXL's Python API and makes its
agents.
"""

from tensorwire.transport.backends.nixl.transport import NixlTransport

__all__ = ["NixlTransport"]
