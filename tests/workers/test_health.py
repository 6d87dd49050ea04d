"""Unit tests of :mod:`pytest_sglworker.workers.health`: whole-request deadlines against hostile servers on loopback,
and the wait loop's promises (process exit, fatal log line, deadline, ready line, cancel) against a fake
target."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_sglworker.workers.errors import LaunchCancelled, WorkerError, WorkerStartupError, WorkerStartupTimeout
from pytest_sglworker.workers.health import (
    HttpHealth,
    Probe,
    ProbeTimeout,
    Readiness,
    http_request,
    wait_until_ready,
)
from pytest_sglworker.workers.process import ManagedProcess


class _Server:
    """A loopback TCP server whose every connection is handled by ``handler(conn)`` in a thread."""

    def __init__(self, handler) -> None:  # type: ignore[no-untyped-def]
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.handler = handler
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                self.handler(conn, self.stop)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def serve() -> Iterator:  # type: ignore[type-arg]
    servers: list[_Server] = []

    def start(handler):  # type: ignore[no-untyped-def]
        server = _Server(handler)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _trickle_headers(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not stop.wait(0.2):
        conn.sendall(b"X-Trickle: 1\r\n")


def _trickle_body(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    while not stop.wait(0.2):
        conn.sendall(b"x")


def _raised(call: Callable[[], object], within: float = 60.0) -> BaseException | None:
    """What ``call`` raised, run on a thread. The test fails if it has not ended after ``within`` seconds: a
    deadline on the condition "it ended", which without the bound under test never happens (a trickling server,
    a worker that never becomes ready)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"the request was still going after {within:g} s"
    return raised[0] if raised else None


@pytest.mark.parametrize("handler", [_trickle_headers, _trickle_body], ids=["headers", "body"])
def test_a_trickling_answer_cannot_outlive_the_deadline(serve, handler) -> None:  # type: ignore[no-untyped-def]
    # the server sends a byte every 0.2 s for ever: every read is quick, only the whole request's deadline ends it
    server = serve(handler)
    raised = _raised(lambda: http_request("127.0.0.1", server.port, "/health", deadline=time.monotonic() + 1.0))
    assert isinstance(raised, ProbeTimeout), raised
    assert not server.stop.is_set()  # the server was still trickling: the deadline, not the server, ended it


def test_abort_ends_a_request_at_once(serve) -> None:  # type: ignore[no-untyped-def]
    # the deadline is an hour away: only the abort can end the request while the server trickles
    server = serve(_trickle_body)
    asked, aborting = threading.Event(), threading.Event()

    def abort() -> bool:
        asked.set()
        return aborting.is_set()

    def request() -> None:
        http_request("127.0.0.1", server.port, "/", deadline=time.monotonic() + 3600, abort=abort)

    def abort_once_asked() -> None:
        asked.wait(30)
        aborting.set()

    threading.Thread(target=abort_once_asked, daemon=True).start()
    raised = _raised(request)
    assert isinstance(raised, ProbeTimeout) and aborting.is_set(), raised


def test_complete_answers_content_length_chunked_and_close(serve) -> None:  # type: ignore[no-untyped-def]
    def fixed(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy!")

    def chunked(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nwiki\r\n5\r\npedia\r\n0\r\n\r\n")

    def closes(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nuntil close")

    for handler, status, body in ((fixed, 503, b"busy!"), (chunked, 200, b"wikipedia"), (closes, 200, b"until close")):
        resp = http_request("127.0.0.1", serve(handler).port, "/x", deadline=time.monotonic() + 5)
        assert (resp.status, resp.body) == (status, body)


def test_refused_is_not_listening() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    target = _Target(port=port)
    probe = HttpHealth().probe(target, time.monotonic() + 1, lambda: False)
    assert probe == Probe(False, "not listening yet", listening=False)


# ---------------------------------------------------------------------------------------------- the wait


@dataclass
class _Target:
    """A fake :class:`~pytest_sglworker.workers.health.Watched`: a real child process and a log file."""

    port: int = 1
    host: str = "127.0.0.1"
    log_path: Path = Path("/nonexistent")
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    proc: subprocess.Popen[bytes] | None = None
    fatal: bool = False
    owns: bool = True

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self.proc is not None
        return self.proc

    def owns_port(self) -> bool:
        return self.owns

    def fatal_in_log(self) -> bool:
        return self.fatal

    def failure(self, kind: type[WorkerError], event: str, *, alive: bool = False) -> WorkerError:
        return kind(worker="fake", event=event)


class _Scripted(Readiness):
    """Not ready until ``ready_at`` (monotonic), counting its probes."""

    def __init__(self, ready_at: float = float("inf")) -> None:
        self.ready_at = ready_at
        self.probes: list[float] = []

    def probe(self, target, deadline, abort):  # type: ignore[no-untyped-def]
        self.probes.append(time.monotonic())
        if time.monotonic() >= self.ready_at:
            return Probe(True, "ok")
        return Probe(False, "HTTP 503")


@pytest.fixture
def child(tmp_path: Path) -> Iterator[_Target]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    target = _Target(proc=proc, log_path=tmp_path / "log")
    target.log_path.write_text("")
    yield target
    proc.kill()
    proc.wait()


class _NeverProbed(Readiness):
    def probe(self, target, deadline, abort):  # type: ignore[no-untyped-def]
        raise AssertionError(f"probed a process that had exited with {target.process.returncode}")


@pytest.mark.timeout(120)  # a backstop far below the 3600 s startup timeout; the assertion comes first
def test_exit_fails_at_once(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    target = _Target(proc=proc, log_path=tmp_path / "log")
    with pytest.raises(WorkerStartupError, match="exited during startup with code 3"):
        wait_until_ready(target, _NeverProbed(), timeout=3600)


def test_deadline_holds_and_says_the_last_answer(child: _Target) -> None:
    readiness = _Scripted()
    child.started_at = time.monotonic()  # the wait's clock starts now, not when the fixture started the child
    raised = _raised(lambda: wait_until_ready(child, readiness, timeout=2))
    assert isinstance(raised, WorkerStartupTimeout), raised
    assert re.search(r"did not become healthy within 2 s \(last health answer: HTTP 503\)", str(raised)), raised
    # no probe began after the deadline: the wait ended there, whatever the answers were
    assert readiness.probes and max(readiness.probes) < child.started_at + 2, readiness.probes


class _AnswersThenHangs(Readiness):
    """Answers ``first`` to its first probe (None: hangs from the start), then hangs until each probe's deadline."""

    def __init__(self, first: str | None) -> None:
        self.first = first
        self.probes = 0

    def probe(self, target, deadline, abort):  # type: ignore[no-untyped-def]
        self.probes += 1
        if self.probes == 1 and self.first is not None:
            return Probe(False, self.first)
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return Probe(False, "no complete answer to GET /ready in time", complete=False)


@pytest.mark.parametrize(("first", "said"), [("HTTP 503", "HTTP 503"),
                                             (None, "no complete answer to GET /ready in time")])
def test_a_probe_the_deadline_cuts_short_is_not_the_last_answer(child: _Target, monkeypatch: pytest.MonkeyPatch,
                                                                first: str | None, said: str) -> None:
    """A probe's budget is made an hour: every probe after the first is cut short by the startup's own deadline. The
    answer before it is the one the timeout names (a busy machine's last probe was cut where a quiet one had its
    503); a wait whose only probe was cut says so."""
    import pytest_sglworker.workers.health as health

    monkeypatch.setattr(health, "FIRST_PROBE_SECONDS", 3600.0)
    readiness = _AnswersThenHangs(first)
    child.started_at = time.monotonic()
    raised = _raised(lambda: wait_until_ready(child, readiness, timeout=3))
    assert isinstance(raised, WorkerStartupTimeout), raised
    assert f"(last health answer: {said})" in str(raised), raised
    assert readiness.probes == (2 if first is not None else 1)


def test_fatal_log_line_fails_after_the_grace(child: _Target, monkeypatch: pytest.MonkeyPatch) -> None:
    import pytest_sglworker.workers.health as health

    monkeypatch.setattr(health, "FATAL_GRACE_SECONDS", 0.3)
    child.log_path.write_text("Traceback (most recent call last):\nOSError: [Errno 98] Address already in use\n")
    child.fatal = True
    with pytest.raises(WorkerStartupError, match="logged a fatal error during startup and did not exit"):
        wait_until_ready(child, _Scripted(), timeout=60)


class _ReadyWhenSet(_Scripted):
    """Not ready until ``ready`` is set, counting its probes (with their times)."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = threading.Event()

    def probe(self, target, deadline, abort):  # type: ignore[no-untyped-def]
        self.probes.append(time.monotonic())
        return Probe(True, "ok") if self.ready.is_set() else Probe(False, "HTTP 503")


def test_the_ready_line_triggers_an_immediate_probe(child: _Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pause after a "not ready" answer is made an hour long: the only probe that can come after the first one,
    within the wait's 20 s, is the one the ready line triggers."""
    import pytest_sglworker.workers.health as health

    monkeypatch.setattr(health, "POLL_NOT_READY", 3600.0)
    readiness = _ReadyWhenSet()
    written: list[float] = []

    def write_ready_line() -> None:
        deadline = time.monotonic() + 20
        while not readiness.probes and time.monotonic() < deadline:  # the wait is in its pause after a probe
            time.sleep(0.01)
        readiness.ready.set()
        written.append(time.monotonic())
        with open(child.log_path, "a") as fh:
            fh.write("[2026-12-02 10:00:00] The server is fired up and ready to roll!\n")

    writer = threading.Thread(target=write_ready_line)
    writer.start()
    try:
        wait_until_ready(child, readiness, timeout=20)
    finally:
        writer.join()
    assert child.ready_at is not None
    # two probes: the first ("not ready"), then the one the ready line caused, after the line and before the
    # next periodic probe (an hour after the first) was due
    assert len(readiness.probes) == 2 and readiness.probes[1] >= written[0], (readiness.probes, written)


def test_cancel_ends_the_wait(child: _Target) -> None:
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    with pytest.raises(LaunchCancelled):
        wait_until_ready(child, _Scripted(), timeout=60, cancel=cancel)


def test_a_stale_server_is_never_ready(serve, child: _Target) -> None:  # type: ignore[no-untyped-def]
    def ok(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    child.port = serve(ok).port
    child.owns = False
    child.started_at = time.monotonic()  # the wait's clock starts now, not when the fixture started the child
    # every probe until the deadline may see the stale server (one is enough): a loaded machine's slow answer
    # costs a probe, not the test
    with pytest.raises(WorkerStartupTimeout, match="stale server on the port"):
        wait_until_ready(child, HttpHealth(), timeout=5)


class _ExitOnSecondProbe(_Scripted):
    """Not ready; its second probe makes the child exit (and waits until it has) before answering: every probe
    after that one is a probe of a process known to have exited, which the wait must never make."""

    def __init__(self, exit_file: Path) -> None:
        super().__init__()
        self.exit_file = exit_file
        self.exited_at: float | None = None

    def probe(self, target, deadline, abort):  # type: ignore[no-untyped-def]
        assert self.exited_at is None, (
            f"probed again after the process exited with {target.process.returncode}: the wait does not see the "
            "exit (it would go on until its startup timeout)")
        self.probes.append(time.monotonic())
        if len(self.probes) == 2:
            self.exit_file.write_text("")
            target.process.wait(60)
            self.exited_at = time.monotonic()
        return Probe(False, "HTTP 503")


@pytest.mark.timeout(120)  # a backstop far below the 3600 s startup timeout; the assertion above comes first
def test_an_exit_during_the_wait_fails_it_at_once(tmp_path: Path) -> None:
    """The process is alive when the wait begins and exits during it (between two probes): the wait fails at its
    next look with the exit named, not at its startup timeout, and probes nothing after the exit."""
    exit_file = tmp_path / "exit-now"
    proc = subprocess.Popen([sys.executable, "-c",
                             "import os, sys, time\n"
                             "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
                             "raise SystemExit(3)\n", str(exit_file)])
    try:
        target = _Target(proc=proc, log_path=tmp_path / "log")
        target.log_path.write_text("")
        readiness = _ExitOnSecondProbe(exit_file)
        with pytest.raises(WorkerStartupError, match=r"exited during startup with code 3 after"):
            wait_until_ready(target, readiness, timeout=3600)
        assert readiness.exited_at is not None and len(readiness.probes) == 2, readiness.probes
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------- the real ownership check


_OWN_SERVER = """
import socket, sys
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(8)
open(sys.argv[1] + ".part", "w").write(str(sock.getsockname()[1]))
__import__("os").rename(sys.argv[1] + ".part", sys.argv[1])
while True:
    conn, _ = sock.accept()
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 0\\r\\nConnection: close\\r\\n\\r\\n")
    conn.close()
"""


def _managed(proc: subprocess.Popen[bytes], port: int, log: Path) -> ManagedProcess:
    log.write_text("")
    return ManagedProcess(argv=[sys.executable], host="127.0.0.1", port=port, log_path=log, process=proc,
                          owner_tag="test:real-owns-port")


def test_a_stale_server_is_not_ours_by_the_real_check(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The same as above with the real :meth:`ManagedProcess.owns_port` (the kernel's listeners of the port and
    the process tree's sockets): a server of another process (this test's) answering 200 on the worker's port is
    a stale one, never the worker's readiness; the worker's own server answering on its port is."""
    def ok(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    stale = serve(ok)
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-c", _OWN_SERVER, str(port_file)])
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        own_port = int(port_file.read_text())
        not_ours = _managed(proc, stale.port, tmp_path / "stale.log")
        probe = HttpHealth().probe(not_ours, time.monotonic() + 30, lambda: False)
        assert not probe.ready and probe.stale and "not this worker" in probe.status, probe
        assert not not_ours.listen_inodes
        ours = _managed(proc, own_port, tmp_path / "own.log")
        probe = HttpHealth().probe(ours, time.monotonic() + 30, lambda: False)
        assert probe.ready and not probe.stale, probe
        assert ours.listen_inodes, "the socket it listens on is remembered as its own"
        wait_until_ready(ours, HttpHealth(), timeout=60)
        assert ours.ready_at is not None
    finally:
        proc.kill()
        proc.wait()
