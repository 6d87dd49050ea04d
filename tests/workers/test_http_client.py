"""The client a worker and a router hand out (``ModelInstance.client``, ``Router.client``): a request never goes out on
a connection the server has given up on.

The real router answers a request it rejects early (a wrong API key) before it has read the request's body, and
when the body arrives after its answer it closes the connection, without a ``Connection: close``. A client that
keeps connections then sends its next request on that connection and gets "Server disconnected without sending a
response" (seen in a loaded full run of the gateway scenarios; reproduced against the real router by sending the
body after its 401). The server here does the same deterministically: it answers the first request on a connection
and drops the connection when a second one arrives on it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
from loopback_server import LoopbackServer

from pytest_sglworker.workers.process import http_client


class OneRequestPerConnection(LoopbackServer):
    """Answers the first request of each connection (200, keep-alive implied), closes at the next one's headers."""

    def _read_request(self, conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            rest += chunk
        return True

    def handle(self, conn: socket.socket) -> None:
        if self._read_request(conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            self._read_request(conn)  # the next request on this connection: dropped unanswered


@pytest.fixture
def server() -> Iterator[OneRequestPerConnection]:
    srv = OneRequestPerConnection()
    yield srv
    srv.close()


def test_a_client_that_keeps_connections_meets_the_dropped_one(server: OneRequestPerConnection) -> None:
    """The failure the plugin's client avoids, shown with httpx's defaults."""
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
        assert client.post("/generate", json={"text": "a"}).text == "ok"
        with pytest.raises(httpx.RemoteProtocolError, match="Server disconnected without sending a response"):
            client.post("/generate", json={"text": "b"})


def test_the_plugins_client_sends_each_request_on_a_new_connection(server: OneRequestPerConnection) -> None:
    with http_client(f"http://127.0.0.1:{server.port}", connect=5.0) as client:
        for text in ("a", "b", "c"):
            assert client.post("/generate", json={"text": text}).text == "ok"
    assert server.connections == 3
