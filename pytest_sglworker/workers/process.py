"""A process the plugin started and owns (a worker or a router): :class:`ManagedProcess`, with its argv, its log
file, its process tree and its teardown; :func:`start_process`, the one way every such process starts (a session
of its own, the owner tag, stdout and stderr into a private log file per port, never a pipe).

Plain Python, no pytest. Process ownership (tags, tree scans, teardown) is :mod:`pytest_sglworker.resources.processes`;
what a worker adds (its spec, kind and diagnosis) is :class:`~pytest_sglworker.workers.launcher.ModelInstance`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine.diagnosis import Kind
from ..engine.log_lines import parse_memory
from ..engine.log_tail import CondensedTail, condense
from ..engine.redaction import mask_argv, redact, secret_values
from ..resources.owned_files import FileId
from ..resources.processes import (
    OWNER_ENV,
    ChildProcess,
    ProcessHandle,
    end_process,
    held_socket_inodes,
    listeners,
    listening_inodes,
    listening_pids,
    owner_tag,
    process_ref,
    process_tree,
    signal_name,
    socket_inodes,
    terminate_tree,
)
from .errors import LaunchError, WorkerDied, WorkerError, quoted_lines

if TYPE_CHECKING:
    import httpx
    import psutil
    from typing_extensions import Self

    from ..engine.diagnosis import Diagnosis
    from ..resources.ports import PortBlock

DEFAULT_TAIL_LINES = 40
E = TypeVar("E", bound=WorkerError)
#: What pytest sets for the test being run: no process of the plugin inherits it (a pooled worker outlives the test,
#: and pytest's main thread sets and deletes it around every test phase).
PER_TEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})

__all__ = [
    "DEFAULT_TAIL_LINES",
    "PER_TEST_VARIABLES",
    "SIM_ENGINE_HINT",
    "ManagedProcess",
    "http_client",
    "inherited_environ",
    "log_name",
    "popen",
    "read_head",
    "read_log_end",
    "read_tail",
    "start_process",
    "unused_log_path",
]

#: The end of a launch error's fix: the simulated engine, named for pytest and for a script outside it.
SIM_ENGINE_HINT = ("or use the simulated engine (pytest: --sgl-engine sim; a script outside pytest: "
                   "SGLWORKER_ENGINE=sim)")


def inherited_environ() -> dict[str, str]:
    """This process's environment as a started process inherits it, read now (pytest's per-test variables left
    out). Call it on the thread that owns the environment, pytest's main thread: a background thread is handed
    this snapshot and never reads ``os.environ`` (the main thread changes it around every test, and a copy made
    while it does raises ``KeyError``)."""
    return {k: v for k, v in os.environ.items() if k not in PER_TEST_VARIABLES}


def read_tail(path: Path | str, lines: int = DEFAULT_TAIL_LINES, *, max_bytes: int = 256 * 1024) -> str:
    """The last ``lines`` lines of a file, reading at most ``max_bytes`` from its end."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError as exc:
        return f"<log unreadable: {exc.strerror}>"
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:]) if lines > 0 else ""


def read_log_end(path: Path | str, max_bytes: int = 1024 * 1024) -> tuple[list[str], int]:
    """The lines of the last ``max_bytes`` of a log, and how many lines come before them (so that a log line
    number can be found among them). A first line cut by the window is dropped."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            before = 0
            fh.seek(0)
            while fh.tell() < start:  # count the lines before the window, a chunk at a time
                chunk = fh.read(min(1024 * 1024, start - fh.tell()))
                if not chunk:
                    break
                before += chunk.count(b"\n")
            data = fh.read()
    except OSError as exc:
        return [f"<log unreadable: {exc.strerror}>"], 0
    lines = data.decode("utf-8", errors="replace").split("\n")  # log line numbers count newlines only
    if lines and lines[-1] == "":
        lines.pop()
    if start > 0 and lines:
        lines, before = lines[1:], before + 1  # the window began inside a line
    return lines, before


def read_head(path: Path | str, max_bytes: int = 4 * 1024 * 1024) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(max_bytes).decode("utf-8", errors="replace")
    except OSError:
        return ""


def log_name(prefix: str, port: int) -> str:
    """``<prefix>-<port>.log``: one log file per port (``sglang-worker-20004.log``)."""
    return f"{prefix}-{port}.log"


def unused_log_path(path: Path) -> Path:
    """``path``, or ``<stem>-<n>.log`` when a log is already there (a kept failure): an existing log is never
    renamed or overwritten, so the path a report names stays right."""
    candidate = path
    n = 2
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        n += 1
    return candidate



_tls_lock = threading.Lock()
_tls_context: Any = None


def http_client(url: str, *, connect: float) -> httpx.Client:
    """An ``httpx.Client`` on ``url`` (60 s per read, ``connect`` s to connect) sharing one default TLS context per
    process: httpx builds one per client otherwise, which loads the CA bundle (50-80 ms measured, paid for every
    worker, router and adopted warm worker a session hands out, though their URLs are plain http).

    It keeps no connection between requests (a loopback connect costs well under a millisecond): a server that
    answers before it has read a request's body closes the connection afterwards without saying so, and the next
    request on it fails with "Server disconnected without sending a response". The real router does this to a
    request it rejects early (a wrong API key) whose body arrives after its answer, which a loaded machine makes
    likely: seen in a loaded full run, reproduced by sending the body after the 401."""
    import httpx

    return httpx.Client(base_url=url, timeout=httpx.Timeout(60.0, connect=connect), verify=prepare_http(),
                        limits=httpx.Limits(max_keepalive_connections=0))


def prepare_http() -> Any:
    """The process's one TLS context for :func:`http_client`, made (with httpx imported) on first call: about 0.15 s,
    more on a loaded machine. The pool calls it on the main thread while it waits for a launch, so that the first test
    of an xdist worker does not pay it: its worker's client is then made at once. Not from another thread: httpx
    reads the TLS environment variables (``SSL_CERT_FILE``, ...) from ``os.environ``."""
    global _tls_context
    with _tls_lock:
        if _tls_context is None:
            import httpx

            _tls_context = httpx.create_ssl_context()
        return _tls_context

@dataclass(kw_only=True)
class ManagedProcess:
    """A process the plugin started and owns (a worker or a router): its argv, its log file, its tree, its
    teardown. Use as a context manager, or call :meth:`stop`."""

    argv: list[str]
    host: str
    port: int
    log_path: Path
    #: the process: a ``Popen`` of one this session started, an ``AdoptedProcess`` of a warm worker it adopted
    process: ProcessHandle
    owner_tag: str
    secrets: list[str] = field(default_factory=list, repr=False)
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    #: the size of its log when it was found ready: what it logs from there on is its service to the tests
    ready_log_offset: int | None = None
    #: how long the readiness probe that found it ready took (a slow health endpoint stays slow)
    ready_probe_seconds: float = 0.0
    port_block: PortBlock | None = field(default=None, repr=False)
    pids_seen: set[int] = field(default_factory=set)
    #: log lines a failure report quotes
    tail_lines: int = DEFAULT_TAIL_LINES
    #: its log file's identity when it was created (what a warm record carries, see resources/owned_files.py)
    log_id: FileId | None = None
    #: every port pinned for it, by name (``http``, ``nccl``, ``bootstrap``, ``prometheus``, ...)
    ports: dict[str, int] = field(default_factory=dict)
    #: wall-clock times of its life, for the run report's launch records
    times: dict[str, float] = field(default_factory=dict, repr=False)
    #: what its teardown found worth saying (an escaped listener killed, a port block quarantined)
    warnings: list[str] = field(default_factory=list, repr=False)
    #: inodes of the socket(s) it listened on when it became ready (a process holding one is ours)
    listen_inodes: set[int] = field(default_factory=set, repr=False)
    _client: httpx.Client | None = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _exit_expected: bool = field(default=False, repr=False)

    # -- identity -----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    @property
    def startup_seconds(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.started_at

    @property
    def stopped(self) -> bool:
        """Stopped on purpose (:meth:`stop`, :meth:`kill`, or an exit announced by :meth:`expect_exit`), as
        opposed to an exit of its own (a death)."""
        return self._stopped or (self._exit_expected and self.process.poll() is not None)

    def expect_exit(self) -> None:
        """Say that this process will exit on its own during the test (a crash fault the test switched on,
        e.g. the simulated engine's ``die_after``): its exit is then a deliberate stop, not a death that fails
        the test; teardown still ends the whole tree."""
        self._exit_expected = True

    def describe(self) -> str:
        return f"process on {self.host}:{self.port} (pid {self.pid})"

    def __str__(self) -> str:
        return self.describe()

    # -- state --------------------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return self.process.poll() is None

    def owns_port(self) -> bool:
        """Whether a process of this tree listens on its port (a stale server's answer is not ours); the
        listening sockets are remembered, so that a process that later holds one is known to be ours. The
        kernel names the port's listeners (:func:`processes.listening_inodes`); the root's fds are looked at
        first (sglang's HTTP server and the simulated engine listen in the root), the rest of the tree only
        when the root holds none of them."""
        inodes = listening_inodes(self.port)
        if inodes is not None:
            held = held_socket_inodes(self.pid, inodes)
            if not held and inodes:
                for proc in self._tree(sweep=False):
                    if proc.pid != self.pid:
                        held |= held_socket_inodes(proc.pid, inodes)
            self.listen_inodes |= held
            return bool(held)
        pids = listening_pids(self._tree(sweep=False), self.port)  # no /proc (not Linux): psutil
        for pid in pids:
            self.listen_inodes |= socket_inodes(pid, self.port)
        return bool(pids)

    def fatal_in_log(self) -> bool:
        """Whether the log of this running process shows an error after which it will never serve."""
        return False

    def log_tail(self, lines: int = DEFAULT_TAIL_LINES) -> str:
        """The last lines of the log (secrets redacted)."""
        return redact(read_tail(self.log_path, lines), self.secrets)

    def condensed_tail(self, lines: int | None = None, first_error_line: int | None = None,
                       quoted: Mapping[str, str] | None = None) -> CondensedTail:
        """The log's last lines as a failure report quotes them (:func:`~pytest_sglworker.engine.log_tail.condense`:
        probes and progress bars collapsed, long lines cut, the first error's neighbourhood kept), secrets
        redacted, at most ``lines`` (default: :attr:`tail_lines`)."""
        log_lines, before = self.log_end()
        first = first_error_line if before >= 0 else None
        return condense([redact(line, self.secrets) for line in log_lines], self.tail_lines if lines is None else lines,
                        line_offset=max(before, 0), first_error_line=first, quoted=quoted)

    def log_end(self) -> tuple[list[str], int]:
        """The log's last lines (up to 1 MiB of them) and how many lines come before them, for a failure's tail."""
        return read_log_end(self.log_path)

    def log_text(self, max_bytes: int = 4 * 1024 * 1024) -> str:
        return redact(read_head(self.log_path, max_bytes), self.secrets)

    def diagnosis(self, *, alive: bool = False) -> Diagnosis | None:
        """What went wrong, read off the log (None where no diagnosis applies)."""
        return None

    def failure(self, kind: type[E], event: str, *, lines: int | None = None, extra: str = "",
                alive: bool = False, cause: str | None = None, advice: str | None = None) -> E:
        """An error of ``kind`` about this process: ``event`` with the diagnosis of its log (``alive``: of a
        running process), the argv, the log path and its last lines, condensed, at most ``lines`` (default:
        :attr:`tail_lines`). ``cause`` and ``advice``: when they are not the diagnosis's."""
        lines = self.tail_lines if lines is None else lines
        try:
            diagnosis = self.diagnosis(alive=alive)
        except Exception:  # a diagnosis must never hide the log
            diagnosis = None
        # what the text quotes above the tail (its first error, what is not the cause), unless it names a cause of
        # its own: marked in the tail, not repeated
        quoted = quoted_lines(diagnosis) if cause is None else {}
        tail = self.condensed_tail(lines, diagnosis.first_error_line if diagnosis is not None else None,
                                   quoted=quoted)
        memory = parse_memory(self.log_text()) if diagnosis is not None and diagnosis.memory_related else None
        name, _, where = self.describe().partition(" on ")
        error = kind(worker=name, where=where.replace(" (", ", ").rstrip(")"), event=event, diagnosis=diagnosis,
                     extra=extra,
                     argv=redact(shlex.join(mask_argv(self.argv)), self.secrets), log_path=str(self.log_path),
                     tail=tail.text, tail_lines=lines, tail_notes=tail.notes, log_memory=memory, cause=cause,
                     advice=advice)
        error.process = self
        return error

    def death(self, signals: Sequence[Any] = (), *, lines: int | None = None) -> WorkerDied:
        """The failure of this process that exited during a test: its diagnosis, unless the test sent it the signal
        it died of (``signals``: what the test sent through ``os.kill``/``os.killpg``, records with ``pid``,
        ``signal`` and ``group``): then that is the cause, and the advice is the plugin's way to do it on purpose."""
        code = self.returncode
        event = f"exited with {signal_name(code)} during the test"
        sent = [s for s in signals if s.pid == self.pid and code is not None and code < 0 and s.signal == -code]
        if sent:
            name = signal_name(code).split("(")[-1].rstrip(")")
            call = f"os.killpg({self.pid}, {name})" if sent[0].group else f"os.kill({self.pid}, {name})"
            return self.failure(
                WorkerDied, event, lines=lines,
                cause=f"this test killed it ({call}): a death the test caused, not one of the worker's own",
                advice="to kill a worker on purpose, call worker.kill() (or worker.expect_exit() before causing the "
                       "exit): the plugin then counts a deliberate stop, not a death that fails the test")
        failure = self.failure(WorkerDied, event, lines=lines)
        diagnosis = failure.diagnosis
        if code is not None and code < 0 and diagnosis is not None and diagnosis.kind is Kind.KILLED_BY_SIGNAL:
            failure.extra = ("this test sent it no signal through os.kill/os.killpg; a kill from another process "
                             "(a subprocess's kill, the host's OOM killer, a CI timeout) the plugin cannot see")
        return failure

    def failure_message(self, what: str, *, lines: int | None = None, extra: str = "") -> str:
        """``<process> <what>`` + diagnosis + log path + the last ``lines`` lines."""
        return str(self.failure(WorkerError, what, lines=lines, extra=extra))

    @property
    def client(self) -> httpx.Client:
        """An ``httpx.Client`` bound to :attr:`url` (created on first use, closed by :meth:`stop`)."""
        if self._client is None:
            self._client = http_client(self.url, connect=5.0)
        return self._client

    # -- tree ---------------------------------------------------------------------------------------------
    def _tree(self, *, sweep: bool = True) -> list[psutil.Process]:
        """The processes of this tree (see :func:`processes.process_tree`); every pid seen is remembered, for
        the GPU lease's memory-release wait."""
        procs = process_tree(self.pid, self.owner_tag, sweep=sweep, ref=process_ref(self.process))
        self.pids_seen.update(p.pid for p in procs)
        return procs

    def remember_tree(self) -> None:
        """Remember the pids of the tree as it is now (the root's at least, even when it has exited)."""
        import psutil

        self.pids_seen.add(self.pid)
        with contextlib.suppress(psutil.Error, OSError):
            self._tree(sweep=False)

    def close_client(self) -> None:
        """Close the ``httpx.Client`` of :attr:`client`, if one was made (the process goes on)."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the root process on purpose (a test simulating a crash): the exit that follows
        is a deliberate stop, not a death; teardown still ends the whole tree."""
        self.times.setdefault("stop_requested", time.time())
        self._stopped = True
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)

    def stop(self, *, term_timeout: float = 10.0, kill_timeout: float = 10.0) -> list[int]:
        """Tear the whole process tree down; returns the PIDs that needed SIGKILL. Idempotent."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        if self._stopped and self.port_block is None and self.times.get("stopped"):
            return []
        self.times.setdefault("stop_requested", time.time())
        self._stopped = True
        killed = self._terminate(term_timeout, kill_timeout)
        self.times["stopped"] = time.time()
        if self.port_block is not None:
            if self._clear_ports():
                self.port_block.release()
            self.port_block = None
        return killed

    def _terminate(self, term_timeout: float, kill_timeout: float) -> list[int]:
        """End the whole process tree (:func:`processes.terminate_tree`); the PIDs that needed SIGKILL."""
        return terminate_tree(self.process, self._tree, term_timeout=term_timeout, kill_timeout=kill_timeout)

    def _clear_ports(self) -> bool:
        """After teardown nothing may listen on this process's ports. A listener that provably descends from it
        (a pid its tree had) or holds its own listening socket is killed; another one is left alone and the
        port block is quarantined for the session (never handed out again). True when the block is clear."""
        from ..resources.ports import quarantine_port_block

        assert self.port_block is not None
        clear = True
        for pid, ports in listeners(self.port_block.ports).items():
            ours = pid in self.pids_seen or bool(self.listen_inodes & socket_inodes(pid))
            where = ", ".join(map(str, ports))
            if ours and end_process(pid):
                self.warnings.append(f"killed pid {pid}, which escaped the teardown of {self.describe()} and still "
                                     f"listened on port {where}")
                continue
            clear = False
            quarantine_port_block(self.port_block, reason=f"pid {pid} still listens on {where} after teardown")
            self.warnings.append(f"pid {pid} still listens on port {where} after the teardown of {self.describe()} "
                                 f"and is not provably ours: left alone, its port block "
                                 f"{self.port_block.ports[0]}-{self.port_block.ports[-1]} quarantined for this session")
        return clear

    def remove_log(self) -> None:
        """Delete the log (the retention policy keeps only the logs of failed runs)."""
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _private_file(path: str, flags: int) -> int:
    """Opener for worker logs: 0600 whatever the umask (the engine logs its arguments, --api-key included)."""
    return os.open(path, flags, 0o600)


def popen(argv: list[str], env: dict[str, str], log_path: Path) -> ChildProcess:
    """Start ``argv`` in a session of its own, stdin closed, stdout and stderr appended to ``log_path`` (a
    private file, whose handle the parent closes at once); a missing or unusable log or launcher is a
    :class:`LaunchError`. The handle holds the child's pidfd from its start (:class:`ChildProcess`): no signal
    of the plugin reaches another process that later gets its pid."""
    try:
        log = open(log_path, "ab", buffering=0, opener=_private_file)
    except OSError as exc:
        raise LaunchError(f"cannot write the worker log {log_path}: {exc.strerror}; choose a writable --sgl-log-dir",
                          log_path=str(log_path)) from None
    try:
        return ChildProcess(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, close_fds=True,
        )
    except FileNotFoundError:
        raise LaunchError(
            f"launcher {argv[0]!r} not found; install sglang, or set --sgl-launcher / SGLWORKER_LAUNCHER, "
            + SIM_ENGINE_HINT, log_path=str(log_path),
        ) from None
    except PermissionError:
        raise LaunchError(f"launcher {argv[0]!r} is not executable", log_path=str(log_path)) from None
    finally:
        log.close()


def start_process(argv: list[str], env: Mapping[str, str], log_path: Path, *,
                  environ: Mapping[str, str], session_id: str | None = None) -> dict[str, Any]:
    """Start ``argv`` the way every process of the plugin starts: in a session of its own, tagged with a new
    owner tag, stdout and stderr into ``log_path`` (never a pipe), stdin closed. Its environment is ``environ``
    (:func:`inherited_environ`, read on the main thread) with ``env`` added. ``session_id``: the session its
    tag names (default this pytest process's; a group that may be kept warm: its keeper's). Returns the
    :class:`ManagedProcess` fields it fills."""
    tag = owner_tag() if session_id is None else owner_tag(session_id)
    full_env = {k: v for k, v in environ.items() if k not in PER_TEST_VARIABLES}
    full_env.update(env)
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env[OWNER_ENV] = tag
    log_path = unused_log_path(log_path)
    started = time.time()
    process = popen(argv, full_env, log_path)
    return {"argv": argv, "log_path": log_path, "log_id": FileId.of(log_path), "process": process, "owner_tag": tag,
            "secrets": secret_values(full_env, argv), "times": {"started": started}}
