"""Anonymous shared memory handed to other processes only after a capability check.

Same-node shared memory is made with ``memfd_create``: it has no name (nothing in
``/dev/shm``), and the kernel frees it when the last descriptor and mapping are gone, so a
producer killed with SIGKILL leaves nothing behind. Another process gets a descriptor only
from the producer's :class:`FdServer`, over a Unix socket in the user's private socket
directory (``SCM_RIGHTS``), after presenting the segment's key and its capability token; the
server also checks that the connecting process runs as the same user (``SO_PEERCRED``).

Wire format (fixed binary, never pickled): a request is ``b"TWFD"``, a kind byte (1: the
descriptor, 2: the segment's *addresses*), then the key and the token, each as a 2-byte
big-endian length and its bytes. The reply is a status byte and a size as 8 bytes; with
status ``OK`` a descriptor request gets one descriptor (the size is the segment's), an
address request the size's bytes of the owner's address list (:mod:`tensorwire.transport.backends.shm.cma`).
A connection serves any number of requests, one at a time.

A segment may be offered *lazily* (:meth:`FdServer.offer_lazy`): it is made on the first
descriptor request, so an object only ever read through its addresses is never packed.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from tensorwire.errors import PermissionDeniedError, TransferTimeoutError, TransportError, TransportUnavailableError

__all__ = [
    "FdClient",
    "FdServer",
    "FdStatus",
    "SegmentUnknownError",
    "close_all",
    "create_memfd",
    "fd_client",
    "fd_server",
]

logger = logging.getLogger(__name__)

_MAGIC = b"TWFD"
_DESCRIPTOR, _ADDRESSES = 1, 2  # request kinds
_REPLY = struct.Struct("!BQ")
_MAX_FIELD = 256  # bytes of a key or token


class FdStatus(enum.IntEnum):
    """The server's answer to one request."""

    OK = 0
    UNKNOWN = 1  # no such segment (freed, or never offered)
    DENIED = 2  # wrong token
    BAD_REQUEST = 3


class SegmentUnknownError(TransportError):
    """The server has no segment under that key (freed, or never offered)."""


def create_memfd(nbytes: int, *, reserve: bool = False) -> int:
    """A new anonymous segment of ``nbytes`` (at least 1): an open read-write descriptor the
    caller owns. ``reserve`` allocates the pages now, so that later stores through a mapping
    cannot fail for want of memory (a SIGBUS). Raises ``TransportUnavailableError`` when the
    memory cannot be had."""
    size = max(nbytes, 1)
    fd = os.memfd_create("tensorwire", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        if reserve:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise TransportUnavailableError(f"no memory for a {size}-byte shared segment: {e}") from e
        raise
    return fd


def _read_exact(connection: socket.socket, nbytes: int) -> bytes:
    """``nbytes`` from a stream socket; b"" when the peer closed before the first byte."""
    data = b""
    while len(data) < nbytes:
        more = connection.recv(nbytes - len(data))
        if not more:
            if data:
                raise ValueError("truncated request")
            return b""
        data += more
    return data


def _read_request(connection: socket.socket) -> tuple[int, bytes, bytes] | None:
    """One request's kind, key and token; None when the peer closed. ``ValueError`` if malformed."""
    magic = _read_exact(connection, len(_MAGIC) + 1)
    if not magic:
        return None
    if magic[:-1] != _MAGIC or magic[-1] not in (_DESCRIPTOR, _ADDRESSES):
        raise ValueError("not a tensorwire descriptor request")
    fields = []
    for _ in range(2):
        header = _read_exact(connection, 2)
        if not header:
            raise ValueError("truncated request")
        (length,) = struct.unpack("!H", header)
        if length > _MAX_FIELD:
            raise ValueError("field too long")
        fields.append(_read_exact(connection, length) if length else b"")
    return magic[-1], fields[0], fields[1]


def _request(key: bytes, token: bytes, kind: int = _DESCRIPTOR) -> bytes:
    return _MAGIC + bytes([kind]) + struct.pack("!H", len(key)) + key + struct.pack("!H", len(token)) + token


class _Offer:
    """One offered segment: its token, descriptor (-1 until made), size, maker, addresses."""

    __slots__ = ("addresses", "fd", "lock", "make", "nbytes", "token")

    def __init__(
        self, token: bytes, fd: int, nbytes: int, make: Callable[[], tuple[int, int]] | None, addresses: bytes
    ) -> None:
        self.token, self.fd, self.nbytes, self.make, self.addresses = token, fd, nbytes, make, addresses
        self.lock = threading.RLock()  # a finalizer run inside make() may withdraw this offer


class FdServer:
    """Producer side: hands out descriptors of offered segments to same-user processes that
    present the segment's token. One per process (:func:`fd_server`); its threads are daemons
    and each connection is served by its own thread."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"{secrets.token_hex(8)}.fds")
        self._segments: dict[bytes, _Offer] = {}
        self._lock = threading.RLock()  # withdraw() runs in finalizers
        self._closed = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self._listener.listen(64)
        self._thread = threading.Thread(target=self._accept_loop, name="tensorwire-fd-server", daemon=True)
        self._thread.start()

    def offer(self, key: bytes, token: bytes, fd: int, nbytes: int, *, addresses: bytes = b"") -> None:
        """Owner: serve ``fd`` (this server now owns it) to whoever presents ``token``."""
        self._put(key, _Offer(token, fd, nbytes, None, addresses))

    def offer_lazy(self, key: bytes, token: bytes, make: Callable[[], tuple[int, int]], *, addresses: bytes) -> None:
        """Owner: serve ``addresses`` to whoever presents ``token``, and a segment that
        ``make()`` returns (descriptor, which this server then owns, and size) on the first
        descriptor request; an error it raises answers that request ``UNKNOWN``."""
        self._put(key, _Offer(token, -1, 0, make, addresses))

    def _put(self, key: bytes, offer: _Offer) -> None:
        with self._lock:
            old = self._segments.pop(key, None)
            self._segments[key] = offer
        if old is not None and old.fd >= 0:
            os.close(old.fd)

    def withdraw(self, key: bytes) -> None:
        """Owner: stop serving ``key`` and close its descriptor; mappings stay valid."""
        with self._lock:
            entry = self._segments.pop(key, None)
        if entry is not None:
            with entry.lock:  # not while a lazy segment is being made
                if entry.fd >= 0:
                    os.close(entry.fd)
                entry.fd = -2

    def _lookup(self, kind: int, key: bytes, token: bytes) -> tuple[FdStatus, int, int, bytes]:
        """The status, a duplicate descriptor (-1 unless OK; the caller closes it), the size
        and the address list (address requests)."""
        with self._lock:
            entry = self._segments.get(key)
        if entry is None:
            return FdStatus.UNKNOWN, -1, 0, b""
        if not hmac.compare_digest(entry.token, token):
            return FdStatus.DENIED, -1, 0, b""
        if kind == _ADDRESSES:
            if not entry.addresses:
                return FdStatus.UNKNOWN, -1, 0, b""
            return FdStatus.OK, -1, len(entry.addresses), entry.addresses
        with entry.lock:  # withdraw() cannot close the descriptor while it is duplicated
            if entry.fd == -1 and entry.make is not None:
                try:
                    fd, nbytes = entry.make()
                except Exception as e:  # noqa: BLE001 - the consumer falls back to another transport
                    logger.warning("fd server: could not make a segment: %s", e)
                    return FdStatus.UNKNOWN, -1, 0, b""
                if entry.fd == -2:  # withdrawn meanwhile (a finalizer ran inside make())
                    os.close(fd)
                    return FdStatus.UNKNOWN, -1, 0, b""
                entry.fd, entry.nbytes = fd, nbytes
            if entry.fd < 0:
                return FdStatus.UNKNOWN, -1, 0, b""
            return FdStatus.OK, os.dup(entry.fd), entry.nbytes, b""

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(connection,), name="tensorwire-fd-conn", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            uid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():
                logger.warning("fd server: refused a connection from uid %d", uid)
                return
            while not self._closed.is_set():
                try:
                    request = _read_request(connection)
                except ValueError:
                    with contextlib.suppress(OSError):
                        connection.sendall(_REPLY.pack(FdStatus.BAD_REQUEST, 0))
                    return  # the stream is out of step: end the connection
                except OSError:
                    return
                if request is None:
                    return
                status, fd, nbytes, addresses = self._lookup(*request)
                try:
                    if fd >= 0:
                        socket.send_fds(connection, [_REPLY.pack(status, nbytes)], [fd])
                    else:
                        connection.sendall(_REPLY.pack(status, len(addresses)) + addresses)
                except OSError:
                    return
                finally:
                    if fd >= 0:
                        os.close(fd)

    def close(self) -> None:
        """Stop serving; close every offered descriptor and remove the socket file."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            entries, self._segments = list(self._segments.values()), {}
        for entry in entries:
            with entry.lock:
                if entry.fd >= 0:
                    os.close(entry.fd)
                entry.fd = -2


class FdClient:
    """Consumer side: one connection per server, kept; requests on it one at a time."""

    def __init__(self) -> None:
        self._connections: dict[str, tuple[socket.socket, threading.Lock]] = {}
        self._lock = threading.Lock()

    def _connection(self, path: str, timeout_s: float) -> tuple[socket.socket, threading.Lock]:
        with self._lock:
            found = self._connections.get(path)
            if found is not None:
                return found
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(timeout_s)
        try:
            connection.connect(path)
        except OSError:
            connection.close()
            raise
        with self._lock:
            found = self._connections.setdefault(path, (connection, threading.Lock()))
        if found[0] is not connection:
            connection.close()
        return found

    def _drop(self, path: str) -> None:
        with self._lock:
            found = self._connections.pop(path, None)
        if found is not None:
            found[0].close()

    def receive(self, path: str, key: bytes, token: bytes, *, deadline: float) -> tuple[int, int]:
        """A descriptor of the segment ``key`` served at ``path`` (the caller closes it) and
        its size. Blocks for one round trip, bounded by ``deadline`` (``time.monotonic()``).

        Raises:
            OSError: The server is gone (its process exited or closed it).
            SegmentUnknownError: It has no such segment. PermissionDeniedError: wrong token.
            TransferTimeoutError: No answer before the deadline.
        """
        nbytes, fds, _ = self._ask(path, _DESCRIPTOR, key, token, deadline)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"descriptor server {path} sent {len(fds)} descriptors, not one")
        return fds[0], nbytes

    def addresses(self, path: str, key: bytes, token: bytes, *, deadline: float) -> bytes:
        """The address list the owner offered with segment ``key`` (raises like :meth:`receive`;
        ``SegmentUnknownError`` also when it offered none)."""
        return self._ask(path, _ADDRESSES, key, token, deadline)[2]

    def _ask(self, path: str, kind: int, key: bytes, token: bytes, deadline: float) -> tuple[int, list[int], bytes]:
        """One request answered OK: (size, descriptors, address bytes); raises otherwise."""
        if not path.endswith(".fds") or "\0" in path:
            raise TransportError(f"invalid descriptor server address {path!r}")
        for attempt in range(2):  # a kept connection the server closed is made again once
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"no descriptor from {path} before the deadline")
            connection, lock = self._connection(path, left)
            extra = b""
            try:
                with lock:
                    connection.settimeout(left)
                    connection.sendall(_request(key, token, kind))
                    message, fds, _, _ = socket.recv_fds(connection, _REPLY.size, 1)
                    if len(message) == _REPLY.size and kind == _ADDRESSES and message[0] == FdStatus.OK:
                        extra = _read_exact(connection, _REPLY.unpack(message)[1])
                        if len(extra) != _REPLY.unpack(message)[1]:
                            message = b""  # closed mid-reply
            except (TimeoutError, ValueError) as e:
                self._drop(path)
                if isinstance(e, ValueError):
                    raise ConnectionResetError(f"descriptor server {path} closed the connection") from None
                raise TransferTimeoutError(f"no descriptor from {path} before the deadline") from None
            except OSError:
                self._drop(path)
                if attempt:
                    raise
                continue
            if len(message) != _REPLY.size:
                for fd in fds:
                    os.close(fd)
                self._drop(path)
                if attempt:
                    raise ConnectionResetError(f"descriptor server {path} closed the connection")
                continue
            status, nbytes = _REPLY.unpack(message)
            if status == FdStatus.OK:
                return nbytes, fds, extra
            for fd in fds:
                os.close(fd)
            if status == FdStatus.UNKNOWN:
                raise SegmentUnknownError(f"descriptor server {path} has no such segment")
            if status == FdStatus.DENIED:
                raise PermissionDeniedError("wrong capability token for a shared-memory segment")
            raise TransportError(f"descriptor server {path} answered status {status}")
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
        for connection, _ in connections:
            connection.close()


_server: FdServer | None = None
_client: FdClient | None = None
_owner_pid = 0
_singleton_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _server, _client, _owner_pid
    if _owner_pid != os.getpid():
        _server, _client, _owner_pid = None, None, os.getpid()


def fd_server(directory: str) -> FdServer:
    """This process's descriptor server, started on first use (again in a forked child)."""
    global _server
    with _singleton_lock:
        _reset_after_fork()
        if _server is None:
            _server = FdServer(directory)
        return _server


def fd_client() -> FdClient:
    """This process's descriptor client."""
    global _client
    with _singleton_lock:
        _reset_after_fork()
        if _client is None:
            _client = FdClient()
        return _client


def close_all() -> None:
    """Close this process's server and client (they start again on next use)."""
    global _server, _client
    with _singleton_lock:
        if _owner_pid != os.getpid():
            return
        server, client, _server, _client = _server, _client, None, None
    if server is not None:
        server.close()
    if client is not None:
        client.close()
