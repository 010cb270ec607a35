"""A TCP proxy on loopback that drops its first connections: a flaky network for tests."""

from __future__ import annotations

import contextlib
import socket
import threading


class DroppingProxy:
    """Forwards 127.0.0.1:<port> to ``target``; closes the first ``drop`` connections at once."""

    def __init__(self, target: str, drop: int) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.drop = drop
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            self.accepted += 1
            if self.drop > 0:
                self.drop -= 1
                client.close()
                continue
            upstream = socket.create_connection(self._target, timeout=5)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(2)
