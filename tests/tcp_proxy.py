"""A TCP proxy in front of the test Redis that a test can cut and restore: a network outage
between one worker and Redis, while the test itself still reaches Redis directly."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Listens on 127.0.0.1 and forwards each connection to ``upstream``: a unix socket
    path, or a (host, port) pair. ``accepted`` counts the connections clients made.

    ``cut()`` closes every forwarded connection and refuses new ones (accepted, then
    closed at once) until ``restore()``.
    """

    def __init__(self, upstream: str | tuple[str, int]) -> None:
        self.upstream = upstream
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._down = False
        self._closed = False
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut(self) -> None:
        with self._lock:
            self._down = True
            self._close_all()

    def restore(self) -> None:
        with self._lock:
            self._down = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._close_all()
        self._listener.close()

    def _close_all(self) -> None:
        for s in self._open:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._open.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.accepted += 1
                if self._down or self._closed:
                    client.close()
                    continue
                family = socket.AF_UNIX if isinstance(self.upstream, str) else socket.AF_INET
                upstream = socket.socket(family, socket.SOCK_STREAM)
                try:
                    upstream.connect(self.upstream)
                except OSError:
                    client.close()
                    continue
                self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
