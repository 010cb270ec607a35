"""shm: same-node transfers through host shared memory.

:mod:`.transport` is the transport; :mod:`.memfd` its anonymous segments and descriptor
server; :mod:`.cma` its direct reads (``process_vm_readv``, one copy); :mod:`.segment_reuse`
the segments shared by objects of unchanged tensors; :mod:`.staging` the reusable staging
rings it offers weight sync.
"""

from tensorwire.transport.backends.shm.transport import ShmTransport

__all__ = ["ShmTransport"]
