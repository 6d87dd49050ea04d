"""The simulated engine's HTTP server: uvicorn's manners on the stdlib's ``ThreadingHTTPServer``, and the dispatch
of each request to its route (:mod:`.routes`) through the gates every request passes.

Part of :mod:`pytest_sglworker.sim`; stdlib only. Before a route answers: the ``trickle`` fault, the API key
(``--api-key`` or the ``api_key`` fault; not on ``/health*``, ``/ready*``, ``/metrics*``, ``/_sim/*``), the
``max_payload`` fault, the body (``Content-Length`` or chunked), the route's path (404) and method (405); an
inference route then goes through the request faults (:func:`.routes.common.request_faults`) and counts toward
``die_after``. Every response carries ``X-SGLSim-Worker``; access log lines are uvicorn's; the router's HTTP/2
probe (``PRI * HTTP/2.0``) gets uvicorn's 404 and 400.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .core import ENV_FAULT, WORKER_HEADER
from .routes import ROUTES
from .routes.common import Request, Route, RouteTable, request_faults
from .state import Sim

_PHRASES = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Request Entity Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
#: A body the sim reads and drops before answering 413 (a larger one: the connection is closed instead).
_DISCARD_LIMIT = 64 << 20


class _Trickle:
    """A write-through file that, while ``delay`` > 0, writes one byte every ``delay`` seconds."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.delay = 0.0

    def write(self, data: bytes) -> int:
        if self.delay <= 0:
            return int(self.raw.write(data))
        for i in range(len(data)):
            self.raw.write(data[i:i + 1])
            self.raw.flush()
            time.sleep(self.delay)
        return len(data)

    def flush(self) -> None:
        self.raw.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class Handler(BaseHTTPRequestHandler):
    # Headers and body go out as separate writes: without TCP_NODELAY each response with a body stalls
    # ~40 ms on loopback (Nagle + delayed ACK), as uvicorn does not.
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    wfile: Any
    raw_requestline: bytes

    # ------------------------------------------------------------------ plumbing

    @property
    def sim(self) -> Sim:
        return self._server.sim

    @property
    def _server(self) -> SimHTTPServer:
        server = self.server
        assert isinstance(server, SimHTTPServer)
        return server

    def setup(self) -> None:
        super().setup()
        self._trickle = _Trickle(self.wfile)
        self.wfile = self._trickle

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        status = int(code) if str(code).isdigit() else 0
        phrase = _PHRASES.get(status) or self.responses.get(status, ("",))[0]
        host, port = self.client_address[:2]
        line = self.requestline.replace("PRI * ", "PRI %2A ")
        self.sim.log.uvicorn("INFO", f'{host}:{port} - "{line}" {code} {phrase}')

    def end_headers(self) -> None:
        self.send_header(WORKER_HEADER, self.sim.worker_id)
        super().end_headers()

    def parse_request(self) -> bool:
        # The router's HTTP/2 probe, "PRI * HTTP/2.0" then "SM": uvicorn answers the first line as a request
        # for the path "*" (404) and the "SM" line as an invalid request (400, connection closed).
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        if line == "PRI * HTTP/2.0":
            self.command, self.path, self.request_version = "PRI", "*", "HTTP/1.1"
            self.requestline = line
            self.close_connection = False
            self.headers = self.MessageClass()
            while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
            Request(self, self.sim).json(404, {"detail": "Not Found"})
            rest = self.rfile.readline(65537)
            if rest.strip() == b"SM":
                self.rfile.readline(65537)
                self.sim.log.uvicorn("WARNING", "Invalid HTTP request received.")
                body = b"Invalid HTTP request received."
                self.wfile.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
            self.wfile.flush()
            self.close_connection = True
            return False
        return super().parse_request()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size_line = self.rfile.readline(65537)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _drain(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if 0 < length <= _DISCARD_LIMIT:
                self.rfile.read(length)
        except (ValueError, OSError):
            self.close_connection = True

    def _authorized(self, path: str) -> bool:
        key = self.sim.state.api_key()
        if not key or self.command == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics", "/_sim/")):
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and token == key

    # ------------------------------------------------------------------ dispatch

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        path = self.path.split("?", 1)[0]
        sim = self.sim
        reply = Request(self, sim)
        control = path.startswith("/_sim/")
        faults = sim.state.snapshot()
        self._trickle.delay = 0.0 if control else faults.trickle
        if not self._authorized(path):
            self._drain()
            reply.json(401, {"error": "Unauthorized"})
            return
        if faults.max_payload is not None and not control:
            length = int(self.headers.get("Content-Length") or 0)
            if length > faults.max_payload:
                if length <= _DISCARD_LIMIT:
                    self._drain()
                self.close_connection = True
                reply.openai_error(413, f"Request body of {length} bytes exceeds the limit of {faults.max_payload} "
                                        f"bytes ({ENV_FAULT} max_payload={faults.max_payload})", "413")
                return
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            reply.json(400, {"detail": "Invalid request body"})
            return
        if faults.max_payload is not None and not control and len(body) > faults.max_payload:
            reply.openai_error(413, f"Request body of {len(body)} bytes exceeds the limit of {faults.max_payload} "
                                    f"bytes ({ENV_FAULT} max_payload={faults.max_payload})", "413")
            return
        route = self._server.routes.find(path, self.command)
        if route is None:
            reply.json(404, {"detail": "Not Found"})
            return
        if self.command not in route.methods:
            reply.json(405, {"detail": "Method Not Allowed"})
            return
        ctx = Request(self, sim, body)
        inference = route.inference
        if inference:
            with sim.lock:
                sim.running += 1
        try:
            if not inference:
                route.answer(ctx)
            else:
                with sim.loads.scope():  # what it generates counts in /v1/loads until it ends
                    if not request_faults(ctx, faults):
                        return
                    route.answer(ctx)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        finally:
            if inference:
                with sim.lock:
                    sim.running -= 1
        if inference and sim.count_inference():
            sim.die()


class SimHTTPServer(ThreadingHTTPServer):
    """The simulated engine's HTTP server: ``routes`` (default: every family of :mod:`.routes`) answered by
    ``handler``."""

    daemon_threads = True
    block_on_close = False  # an idle keep-alive connection must not hold up the shutdown
    request_queue_size = 2048
    handler: type[Handler] = Handler

    def __init__(self, address: tuple[str, int], sim: Sim, routes: Iterable[Route] = ROUTES) -> None:
        self.sim = sim
        self.routes = RouteTable(routes, sim)
        super().__init__(address, self.handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(host), a reverse DNS lookup: skip it.
        import socketserver

        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class SimHTTPServer6(SimHTTPServer):
    address_family = socket.AF_INET6
