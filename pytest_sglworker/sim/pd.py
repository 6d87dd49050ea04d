"""Prefill/decode disaggregation for the simulated engine: the prefill side's KV bootstrap server and the
handshake the two sides make for each request.

Part of :mod:`pytest_sglworker.sim`; stdlib only. What sglang 0.5.23 does (``srt/disaggregation/common/
conn.py``, ``decode.py``, ``prefill.py``, ``managers/scheduler.py``) and what the sim keeps of it:

- A prefill server (``--disaggregation-mode prefill``) serves an HTTP bootstrap server on
  ``--disaggregation-bootstrap-port`` (default 8998) of its ``--host``, started before the weights load
  (``CommonKVBootstrapServer started successfully on HOST:PORT``). Its routes are the real ones:
  ``GET /health`` (``OK``); ``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=``
  (400 ``Missing inputs for bootstrap server.`` without them; 503 ``Prefill server not fully registered yet
  (N workers registered).`` until every rank has registered, which happens when the KV pool is allocated;
  ``-1`` for all four: the ``PrefillServerInfo`` of the server, else one rank's ``{"rank_ip", "rank_port"}``);
  ``PUT /route`` (a rank registers); ``POST /register_dp_rank``, ``POST /query_dp_ranks``; other methods on
  ``/route`` answer 405 ``Method not allowed``. One route is the sim's own: ``GET /_sim/room?room=N``, the
  stand-in for the KV transfer (see below).
- Both sides refuse a generation request without ``bootstrap_room`` (unless
  ``--disaggregation-transfer-backend fake``): 400 ``Invalid request: Disaggregated request received without
  bootstrap room id. req.rid=...``. ``bootstrap_host`` ``2.2.2.2`` (sglang's ``FAKE_BOOTSTRAP_HOST``, used by
  the warmup and ``/health_generate``) needs no peer.
- The decode side fetches the prefill's parallel info from ``http://bootstrap_host:bootstrap_port/route``
  (retried once a second, 15 attempts in sglang; here spread over ``SGLSIM_PD_WAIT_SECONDS``, default 15),
  then waits for the prefill side to have taken the same room (the KV transfer: it polls
  ``/_sim/room``, bounded by the same budget). The prefill side answers its request only once the decode side
  took the room (sglang's prefill finishes after the transfer), also bounded. Either timeout is sglang's
  500 (``Decode handshake failed ...``, ``Decode transfer failed ... KVPoll.WaitingForInput``, ``Prefill
  transfer failed ... KVPoll.Bootstrapping``).
- The prefill side answers with ``finish_reason {"type": "length", "length": 0}``, the first output token and
  the prompt's logprobs (``input_token_logprobs`` and, with ``top_logprobs_num``, ``input_top_logprobs``, the
  first position null); the decode side with the whole output and its logprobs, and no prompt logprobs:
  ``input_token_logprobs`` is ``[]`` and so is ``input_top_logprobs`` with ``top_logprobs_num`` (0.5.23's
  ``scheduler_components/output_streamer.py``: "Decode server does not send input logprobs"). The routers
  (sglang-router 0.3.2, the gateway's ``merge_logprobs_in_json``) put the prefill's ``input_token_logprobs``
  in front of the decode's and merge nothing else, so a merged answer's ``input_top_logprobs`` stays ``[]``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from .core import Log

#: sglang's ``FAKE_BOOTSTRAP_HOST``: a request that needs no peer (warmup, health checks).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
#: sglang's decode side retries fetching the prefill info this many times, once a second.
ENSURE_RETRIES = 15


class PDError(Exception):
    """A PD handshake failed: sglang's abort, with its status code."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Rooms:
    """The prefill side's rooms: prefilled (waiting for the decode side) and taken (transferred)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.prefilled: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.taken: set[int] = set()

    def prefill(self, room: int, info: dict[str, Any]) -> None:
        with self.cond:
            self.prefilled[room] = info
            while len(self.prefilled) > 4096:
                old, _ = self.prefilled.popitem(last=False)
                self.taken.discard(old)
            self.cond.notify_all()

    def take(self, room: int) -> dict[str, Any] | None:
        with self.cond:
            info = self.prefilled.get(room)
            if info is not None:
                self.taken.add(room)
                self.cond.notify_all()
            return info

    def wait_taken(self, room: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while room not in self.taken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return True


class BootstrapState:
    """What the bootstrap server knows: the registered ranks and the server's parallel info."""

    def __init__(self, info: dict[str, Any], expected: int) -> None:
        self.lock = threading.Lock()
        self.info = info
        self.expected = expected
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.dp_ranks: dict[int, int] = {}
        self.rooms = Rooms()

    def register(self, data: dict[str, Any]) -> None:
        key = (int(data.get("system_dp_rank", data.get("attn_dp_rank", 0)) or 0), int(data.get("attn_cp_rank", 0)),
               int(data.get("attn_tp_rank", 0)), int(data.get("pp_rank", 0)))
        with self.lock:
            self.ranks[key] = {"rank_ip": str(data["rank_ip"]), "rank_port": int(data["rank_port"])}

    def registered(self) -> int:
        with self.lock:
            return len(self.ranks)


class _BootstrapHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "Python/3.12 aiohttp/3.13.2"
    sys_version = ""
    disable_nagle_algorithm = True

    @property
    def state(self) -> BootstrapState:
        server = self.server
        assert isinstance(server, BootstrapServer)
        return server.state

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: Any, content_type: str = "text/plain; charset=utf-8") -> None:
        data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
        if not isinstance(body, str):
            content_type = "application/json; charset=utf-8"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        return json.loads(raw or b"null")

    def _route(self) -> None:
        url = urlsplit(self.path)
        path, query = url.path, {k: v[-1] for k, v in parse_qs(url.query).items()}
        state = self.state
        try:
            if path == "/health" and self.command == "GET":
                self._reply(200, "OK")
            elif path == "/route":
                if self.command == "PUT":
                    state.register(self._body())
                    self._reply(200, "OK")
                elif self.command == "GET":
                    self._route_get(query)
                else:
                    self._reply(405, "Method not allowed", "application/json")
            elif path == "/register_dp_rank" and self.command == "POST":
                data = self._body()
                with state.lock:
                    state.dp_ranks[int(data["bootstrap_room"])] = int(data["dp_rank"])
                self._reply(200, "OK")
            elif path == "/query_dp_ranks" and self.command == "POST":
                rooms = self._body()["bootstrap_rooms"]
                with state.lock:
                    found = {str(int(r)): state.dp_ranks[int(r)] for r in rooms if int(r) in state.dp_ranks}
                self._reply(200, found)
            elif path == "/_sim/room" and self.command == "GET":
                room = int(query.get("room", ""))
                info = state.rooms.take(room)
                if info is None:
                    self._reply(404, f"room {room} not prefilled")
                else:
                    self._reply(200, {"room": room, **info})
            elif path in ("/health", "/register_dp_rank", "/query_dp_ranks", "/_sim/room"):
                self._reply(405, "405: Method Not Allowed")
            else:
                self._reply(404, "404: Not Found")
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(500, f"500 Internal Server Error\n\nServer got itself in trouble ({exc!r})")

    def _route_get(self, query: dict[str, str]) -> None:
        state = self.state
        names = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        values = [query.get(n) for n in names]
        if not all(values):
            self._reply(400, "Missing inputs for bootstrap server.")
            return
        ranks = [int(v or 0) for v in values]
        registered = state.registered()
        if registered < state.expected:
            self._reply(503, f"Prefill server not fully registered yet ({registered} workers registered).")
            return
        if ranks == [-1, -1, -1, -1]:
            self._reply(200, state.info)
            return
        with state.lock:
            found = state.ranks.get((ranks[0], ranks[1], ranks[2], ranks[3]))
        if found is None:
            self._reply(404, f"Bootstrap info not found for dp_rank={values[0]} cp_rank={values[1]} "
                             f"tp_rank={values[2]} pp_rank={values[3]}")
            return
        self._reply(200, found)

    def do_GET(self) -> None:
        self._route()

    def do_PUT(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def do_DELETE(self) -> None:
        self._route()


class BootstrapServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], state: BootstrapState) -> None:
        self.state = state
        super().__init__(address, _BootstrapHandler)

    def server_bind(self) -> None:
        import socketserver

        socketserver.TCPServer.server_bind(self)


def start_bootstrap(host: str, port: int, state: BootstrapState, log: Log) -> BootstrapServer | None:
    """Serve the bootstrap routes on ``host:port`` in a thread; None (logged as sglang does) when the port is
    taken: the real server logs the error in its thread and goes on without a bootstrap server."""
    import socket

    cls: type[BootstrapServer] = BootstrapServer
    if ":" in host:
        class _V6(BootstrapServer):
            address_family = socket.AF_INET6
        cls = _V6
    try:
        server = cls((host, port), state)
    except OSError as exc:
        log.error(f"Server error: [Errno {exc.errno}] error while attempting to bind on address {(host, port)!r}: "
                  f"{(exc.strerror or str(exc)).lower()}")
        return None
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="sim-bootstrap",
                     daemon=True).start()
    log.info(f"CommonKVBootstrapServer started successfully on {host}:{port}")
    return server


# ---------------------------------------------------------------------------------------------- decode side


class PrefillInfoCache:
    """The decode side's cache of prefill infos by bootstrap address (sglang's ``prefill_info_table``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.table: dict[str, dict[str, Any]] = {}

    def get(self, addr: str) -> dict[str, Any] | None:
        with self.lock:
            return self.table.get(addr)

    def put(self, addr: str, info: dict[str, Any]) -> None:
        with self.lock:
            self.table[addr] = info


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def decode_handshake(cache: PrefillInfoCache, host: str, port: int, room: int, rid: str, budget: float,
                     log: Log) -> None:
    """Wait (bounded) for the prefill peer's info, then for the room's KV; raises :class:`PDError`."""
    addr = _addr(host, port)
    deadline = time.monotonic() + budget
    interval = max(budget / ENSURE_RETRIES, 0.01)
    attempts = 0
    while cache.get(addr) is None:
        attempts += 1
        url = f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        try:
            status, body = _get(url, timeout=min(5.0, max(deadline - time.monotonic(), 0.05)))
            if status == 200:
                cache.put(addr, json.loads(body))
                break
            log.error(f"Failed to get prefill server info: {status}, {body.decode(errors='replace')}")
        except (OSError, ValueError) as exc:
            log.error(f"Error fetching prefill server info from bootstrap: {exc}")
        if attempts >= ENSURE_RETRIES or time.monotonic() + interval > deadline:
            message = f"Could not fetch prefill parallel info from {addr} after {attempts} attempts"
            log.error(message)
            raise PDError(f"Decode handshake failed for request rank=0 decode_req.req.rid={rid!r} "
                          f"decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room="
                          f"{room}): {message}", 500)
        time.sleep(interval)
    started = time.monotonic()
    while True:
        try:
            status, _ = _get(f"http://{addr}/_sim/room?room={room}",
                             timeout=min(5.0, max(deadline - time.monotonic(), 0.05)))
            if status == 200:
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            elapsed = time.monotonic() - started
            raise PDError(f"Decode transfer failed for request rank=0 decode_req.req.rid={rid!r} "
                          f"decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room="
                          f"{room}): Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput", 500)
        time.sleep(0.01)


def prefill_handshake(state: BootstrapState, room: int, rid: str, info: dict[str, Any], budget: float) -> None:
    """Offer the room's KV to the decode side and wait (bounded) until it is taken; raises :class:`PDError`."""
    started = time.monotonic()
    state.rooms.prefill(room, info)
    if not state.rooms.wait_taken(room, budget):
        elapsed = time.monotonic() - started
        raise PDError(f"Prefill transfer failed for request rank=0 req.rid={rid!r} req.bootstrap_room={room} "
                      f"with exception KVTransferError(bootstrap_room={room}): Request {room} timed out after "
                      f"{elapsed:.1f}s in KVPoll.Bootstrapping", 500)
