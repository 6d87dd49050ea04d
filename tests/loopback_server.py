"""A raw TCP server on loopback for tests that need a server misbehaving in a precise way: a thread accepts
connections one at a time and hands each to :meth:`LoopbackServer.handle`, with a per-connection timeout."""

from __future__ import annotations

import socket
import threading


class LoopbackServer:
    """Subclasses implement :meth:`handle`; the connection is closed after it returns (or raises ``OSError``)."""

    #: seconds each socket operation of a connection may block
    timeout = 10.0

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=32)
        self.port: int = self.sock.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, name=type(self).__name__, daemon=True)
        self.thread.start()

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(self.timeout)
                try:
                    self.handle(conn)
                except OSError:
                    continue

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the serving thread's accept() (close alone does not)
        self.sock.close()
        self.thread.join(10)
        assert not self.thread.is_alive()
