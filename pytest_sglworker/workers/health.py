"""Waiting until a started process is ready, while watching it: one wait loop, readiness checks as classes.

Plain Python, no pytest, stdlib only (no httpx in the wait: probes are plain sockets, so that every request
is bounded by a whole-request deadline, not a per-read timeout that a trickling server can extend forever).

:func:`wait_until_ready` is the loop every kind of process shares: it checks the process on every iteration
(an exit fails at once), watches its log (a fatal error fails after a short grace; the engine's ready line
triggers an immediate probe), enforces the startup deadline whatever the process does on the wire, reports
progress, and asks a :class:`Readiness` whether the process is ready. A readiness check differs only in
:meth:`Readiness.probe`: :class:`HttpHealth` is the one workers use (sglang's ``GET /ready``, ``/health_generate``
for an engine that answers ``/ready`` 404; a 200 counts only from our own process); a router or a gRPC worker
brings its own subclass.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# What a failure or a log line needs is imported with this module, never inside the wait: a Ctrl-C that lands in
# a module's dataclass creation (an exec of generated code) makes CPython 3.11 end the process with SIGINT at exit
# even after pytest handled the interrupt, so the run would exit -2 instead of 2.
from ..engine.diagnosis import looks_like_error
from ..engine.sglang_facts import HEALTH_PATH, READY_LINE, READY_PATH
from ..resources.processes import ProcessHandle, signal_name
from .errors import LaunchCancelled, WorkerError, WorkerStartupError, WorkerStartupTimeout

__all__ = [
    "FATAL_GRACE_SECONDS",
    "HttpHealth",
    "HttpResponse",
    "Probe",
    "ProbeTimeout",
    "ProtocolError",
    "Readiness",
    "Watched",
    "http_request",
    "wait_until_ready",
]

#: How long a process that logged a fatal error may take to exit by itself before the wait gives up on it.
FATAL_GRACE_SECONDS = 5.0
#: A probe first gets this long; each probe that runs out of time doubles it (up to the startup deadline),
#: so that a health endpoint slower than this is still seen healthy, and a trickling one cannot hang the wait.
FIRST_PROBE_SECONDS = 5.0
#: Pauses between probes: while nothing listens (a refused connect on loopback costs microseconds), and
#: after a "not ready" answer (each answer of sglang's health endpoint may cost it work).
POLL_NOT_LISTENING = 0.01
POLL_NOT_READY = 0.1
#: How often the log is looked at between probes (a stat, and a read only when it grew).
LOG_WATCH_INTERVAL = 0.005


class ProbeTimeout(OSError):
    """A request did not complete before its deadline."""


class ProtocolError(ConnectionError):
    """An answer that is not well-formed HTTP (its status line, a chunked body): the server's fault, an ``OSError``
    like a connection that broke, so that every caller counts it as the server failing to answer."""


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def http_request(
    host: str,
    port: int,
    path: str,
    *,
    deadline: float,
    method: str = "GET",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    abort: Callable[[], bool] | None = None,
    max_bytes: int = 4 * 1024 * 1024,
    tls: bool = False,
) -> HttpResponse:
    """One HTTP/1.1 request on a fresh connection, complete (status, headers and body) before ``deadline``
    (``time.monotonic()`` seconds) or :class:`ProbeTimeout`. ``abort`` is asked between reads (e.g. "has the
    process exited?"); when it says so the request ends with :class:`ProbeTimeout` at once. ``tls``: HTTPS, with
    the certificate checked against the system's trust store (an attached worker behind TLS)."""

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0 or (abort is not None and abort()):
            raise ProbeTimeout(f"no complete answer to {method} {path} in time")
        return min(left, 0.25)

    # No "Connection: close": the side that closes first keeps the port in TIME_WAIT, and that must be our
    # ephemeral port, never the worker's (a port block in TIME_WAIT cannot be handed out again at once).
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Accept: */*"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    with socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 1.0), 0.001)) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = raw
        if tls:
            import ssl

            sock = ssl.create_default_context().wrap_socket(raw, server_hostname=host)
        sock.settimeout(remaining())
        sock.sendall(request)
        data = b""
        head_end = -1
        while head_end < 0:
            data += _recv(sock, remaining)
            head_end = data.find(b"\r\n\r\n")
            if len(data) > max_bytes:
                raise ProbeTimeout("oversized answer")
        head, rest = data[:head_end].decode("latin-1"), data[head_end + 4:]
        status_line, *header_lines = head.split("\r\n")
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            raise ProtocolError(f"not an HTTP answer: {status_line[:80]!r}") from None
        fields = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        length = fields.get("content-length")
        if length is not None and length.isdigit():
            while len(rest) < int(length):
                rest += _recv(sock, remaining)
        elif "chunked" in fields.get("transfer-encoding", "").lower():
            while not rest.endswith(b"0\r\n\r\n"):
                rest += _recv(sock, remaining)
                if len(rest) > max_bytes:
                    raise ProbeTimeout("oversized answer")
            rest = _dechunk(rest)
        else:  # until the server closes the connection
            with contextlib.suppress(_Closed):
                while len(rest) <= max_bytes:
                    rest += _recv(sock, remaining)
        return HttpResponse(status, fields, rest)


class _Closed(ConnectionError):
    pass


def _recv(sock: socket.socket, remaining: Callable[[], float]) -> bytes:
    while True:
        sock.settimeout(remaining())
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue  # remaining() raises once the deadline has passed
        if not chunk:
            raise _Closed("the connection closed before the answer was complete")
        return chunk


def _dechunk(data: bytes) -> bytes:
    """The body of a chunked answer; :class:`ProtocolError` for a malformed one (a size that is not hex, a chunk
    shorter than its size or not ended by CRLF)."""
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        text = size_line.split(b";")[0].strip() or b"0"
        if not all(c in b"0123456789abcdefABCDEF" for c in text) or len(text) > 16:
            raise ProtocolError(f"malformed chunked body: chunk size {size_line[:40]!r} is not a hex number")
        size = int(text, 16)
        if size == 0:
            break
        if len(data) < size + 2 or data[size:size + 2] != b"\r\n":
            raise ProtocolError(f"malformed chunked body: a chunk of {size} bytes is cut short or not ended by CRLF")
        out, data = out + data[:size], data[size + 2:]
    return out


# ---------------------------------------------------------------------------------------------- readiness


@dataclass(frozen=True)
class Probe:
    """One readiness probe's answer. ``listening``: something answered at all (a refused connection is
    not yet listening); ``stale``: an answer came from a process that is not ours; ``complete``: False when the probe
    ran out of time before a whole answer came."""

    ready: bool
    status: str
    listening: bool = True
    stale: bool = False
    complete: bool = True


class Watched(Protocol):
    """What the wait needs of a started process (a :class:`~pytest_sglworker.workers.launcher.ModelInstance`)."""

    host: str
    port: int
    started_at: float
    ready_at: float | None
    ready_log_offset: int | None
    ready_probe_seconds: float
    log_path: Path

    @property
    def process(self) -> ProcessHandle: ...

    def owns_port(self) -> bool: ...

    def failure(self, kind: type[WorkerError], event: str, *, alive: bool = False) -> WorkerError: ...

    def fatal_in_log(self) -> bool: ...


class Readiness(ABC):
    """How to tell that a process is ready. Subclasses implement :meth:`probe`; the wait loop is shared."""

    #: names for messages: "did not become <ready_word> ... (last <what> answer: ...)"
    what = "health"
    ready_word = "healthy"

    @abstractmethod
    def probe(self, target: Watched, deadline: float, abort: Callable[[], bool]) -> Probe:
        """Ask once, finishing before ``deadline`` (monotonic) whatever the process does on the wire."""


class HttpHealth(Readiness):
    """sglang's ``GET /ready``: 200 once the server has answered its warmup request (no generation, no 1 s
    wait, unlike ``/health_generate``), and only counted when the listening socket belongs to the process's own
    tree (a stale server on the port is not ours). An engine that answers ``/ready`` 404 (an sglang without
    it, another launcher) is asked ``/health_generate`` from then on. ``path`` given: that path only."""

    def __init__(self, path: str | None = None, headers: dict[str, str] | None = None) -> None:
        self.path = path or READY_PATH
        self.fallback = HEALTH_PATH if path is None else None
        self.headers = headers

    def probe(self, target: Watched, deadline: float, abort: Callable[[], bool]) -> Probe:
        answer = self._probe(target, deadline, abort)
        if answer.status == "HTTP 404" and self.fallback is not None:
            self.path, self.fallback = self.fallback, None
            return self._probe(target, deadline, abort)
        return answer

    def _probe(self, target: Watched, deadline: float, abort: Callable[[], bool]) -> Probe:
        try:
            resp = http_request(target.host, target.port, self.path, deadline=deadline, headers=self.headers,
                                abort=abort)
        except ConnectionRefusedError:
            return Probe(False, "not listening yet", listening=False)
        except ProbeTimeout:
            return Probe(False, f"no complete answer to GET {self.path} in time", complete=False)
        except OSError as exc:
            return Probe(False, type(exc).__name__)
        if resp.status != 200:
            return Probe(False, f"HTTP {resp.status}")
        if not target.owns_port():
            return Probe(False, "HTTP 200 from a process that is not this worker (stale server on the port?)",
                         stale=True)
        return Probe(True, "HTTP 200")


class _LogWatch:
    """Follows a growing log: fatal errors (through the diagnosis) and the engine's ready line."""

    def __init__(self, path: Path, ready_line: str | None) -> None:
        self.path = path
        self.ready_line = ready_line.encode() if ready_line else None
        self.offset = 0
        self.carry = b""
        self.fatal_since: float | None = None
        self.ready_seen = False

    def poll(self, target: Watched) -> bool:
        """Read what is new; True when it showed the ready line."""
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return False
        if size <= self.offset:
            return False
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                new = fh.read(size - self.offset)
        except OSError:
            return False
        self.offset += len(new)
        text = self.carry + new
        self.carry = text[-256:]
        # Diagnosing reads the whole log: only when the new text may hold an error.
        if (self.fatal_since is None and looks_like_error(new.decode("utf-8", errors="replace"))
                and target.fatal_in_log()):
            self.fatal_since = time.monotonic()
        if self.ready_line is not None and not self.ready_seen and self.ready_line in text:
            self.ready_seen = True
            return True
        return False

    def fatal_for(self, seconds: float) -> bool:
        return self.fatal_since is not None and time.monotonic() - self.fatal_since >= seconds


#: ``on_progress(target, elapsed_seconds)``, about once a second while waiting
ProgressCallback = Callable[[Any, float], None]


def log_size(path: Path) -> int | None:
    """How many bytes ``path`` holds now (None when it cannot be read)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def wait_until_ready(
    target: Watched,
    readiness: Readiness | None = None,
    *,
    timeout: float,
    on_progress: ProgressCallback | None = None,
    progress_interval: float = 1.0,
    ready_line: str | None = READY_LINE,
    cancel: threading.Event | None = None,
) -> None:
    """Wait until ``readiness`` (default :class:`HttpHealth`) says ``target`` is ready, checking the process
    all the while. Raises :class:`WorkerStartupError` at once if it exits (or logs a fatal error and does not
    exit within :data:`FATAL_GRACE_SECONDS`), :class:`WorkerStartupTimeout` at ``started_at + timeout``,
    whatever the process does on the wire; both carry the diagnosis and the log tail. The log line
    ``ready_line`` makes the next probe happen at once (the probe stays the truth). ``cancel``, set by another
    thread, ends the wait with :class:`LaunchCancelled` (a member of the same group failed)."""

    readiness = readiness or HttpHealth()
    deadline = target.started_at + timeout
    last_progress = 0.0
    last_status = "not listening yet"
    probed = False  # a probe has answered something (last_status is no longer the default)
    stale_seen = False
    probe_budget = FIRST_PROBE_SECONDS
    watch = _LogWatch(target.log_path, ready_line)

    def exited() -> bool:
        return target.process.poll() is not None or (cancel is not None and cancel.is_set())

    while True:
        if cancel is not None and cancel.is_set():
            raise LaunchCancelled("another member of the worker group failed to start")
        code = target.process.poll()
        now = time.monotonic()
        elapsed = now - target.started_at
        if code is not None:
            raise target.failure(WorkerStartupError,
                                 f"exited during startup with {signal_name(code)} after {elapsed:.1f} s")
        watch.poll(target)
        if watch.fatal_for(FATAL_GRACE_SECONDS):
            raise target.failure(
                WorkerStartupError,
                f"logged a fatal error during startup and did not exit within {FATAL_GRACE_SECONDS:g} s "
                f"(after {elapsed:.1f} s)", alive=True)
        if now >= deadline:
            error = target.failure(WorkerStartupTimeout, f"did not become {readiness.ready_word} within "
                                   f"{timeout:g} s (last {readiness.what} answer: {last_status})", alive=True)
            if stale_seen:
                error.extra = "a server that is not ours answers on this port"
            raise error
        if on_progress is not None and now - last_progress >= progress_interval:
            last_progress = now
            on_progress(target, elapsed)
        probe_deadline = min(deadline, time.monotonic() + probe_budget)
        probed_at = time.monotonic()
        probe = readiness.probe(target, probe_deadline, exited)
        if probe.ready:
            target.ready_at = time.monotonic()
            target.ready_probe_seconds = target.ready_at - probed_at
            target.ready_log_offset = log_size(target.log_path)
            return
        # A probe the startup's own deadline cut short says nothing of the server: the answer before it stays the
        # last one (on a busy machine the last probe was cut where a quiet one had its 503)
        cut_short = not probe.complete and probe_deadline >= deadline and time.monotonic() >= deadline
        if not cut_short or not probed:
            last_status = probe.status
        probed = True
        stale_seen = stale_seen or probe.stale
        if time.monotonic() >= probe_deadline and not exited():
            probe_budget *= 2  # a slow endpoint gets more time next round (still bounded by the deadline)
        pause = POLL_NOT_READY if probe.listening else POLL_NOT_LISTENING
        pause_until = min(deadline, time.monotonic() + pause)
        while time.monotonic() < pause_until:
            if watch.poll(target) or exited():
                break
            time.sleep(min(LOG_WATCH_INTERVAL, max(0.0, pause_until - time.monotonic())))
