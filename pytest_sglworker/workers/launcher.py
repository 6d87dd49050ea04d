"""Launching an sglang worker, waiting for real health while watching the process, and tearing the whole
process tree down.

Plain Python: no pytest here. Usable outside pytest::

    with spawn_worker(get_model_spec("qwen3-0.6b")) as worker:
        worker.client.post("/generate", json={...})

Promises kept here:
- the argv is a list (never a shell string) and binds 127.0.0.1 only;
- stdout and stderr go to one log file per port, ``sglang-worker-<port>.log``; the parent closes its
  handle right after ``Popen`` so that a chatty engine can never block on a pipe;
- the health wait probes ``GET /ready`` (``/health_generate`` for an engine that answers ``/ready`` 404) and
  checks the process on every iteration: an exit fails at once with :class:`WorkerStartupError` (code, signal,
  diagnosis, log tail), the deadline with :class:`WorkerStartupTimeout`; a 200 counts only if the listening
  socket belongs to our process tree, so a stale server left on the port is never mistaken for ours;
- teardown sends SIGTERM to the process group, waits, SIGKILLs, then sweeps every process that carries
  this worker's environment marker (schedulers that left the group or were re-parented to PID 1).

Why one module of this size: what a launch must get right happens in one order (argv, secrets masked, private log
file, Popen with no pipe, the wait, the report of a failure with its log) and the objects a test holds
(``ModelInstance``, ``ManagedProcess``) are the ones that order produces; process ownership is in :mod:`processes`,
readiness in :mod:`health`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine.engine_args import python_module
from ..engine.sglang_facts import LAUNCH_MODULE, LOOPBACK_HOST, LOOPBACK_NAMES, SECRET_FLAG, flag_table
from ..engine.specs import ModelSpec
from ..errors import LaunchCancelled, LaunchError, WorkerDied, WorkerError, WorkerStartupError
from ..resources.processes import (
    OWNER_ENV,
    end_process,
    held_socket_inodes,
    listeners,
    listening_inodes,
    listening_pids,
    owner_tag,
    process_tree,
    signal_name,
    socket_inodes,
    terminate_tree,
)
from .health import ProgressCallback as ProgressCallback
from .health import wait_until_ready
from .kinds import HttpWorker, WorkerKind, default_kind

if TYPE_CHECKING:
    import httpx
    import psutil
    from typing_extensions import Self

    from ..engine.diagnosis import Diagnosis
    from ..resources.ports import PortBlock

#: Environment variables whose values never appear in a message, report or JSON the plugin writes.
SECRET_ENV_PATTERN = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIAL|AUTH", re.IGNORECASE)
DEFAULT_TAIL_LINES = 40
E = TypeVar("E", bound=WorkerError)


def default_launcher() -> list[str]:
    """``<this python> -m sglang.launch_server``."""
    return [sys.executable, "-m", LAUNCH_MODULE]


def sim_launcher() -> list[str]:
    """The simulated engine shipped with this package."""
    return [sys.executable, "-m", "pytest_sglworker.sim"]


def environment_launcher(environ: Mapping[str, str] | None = None) -> list[str]:
    """The launcher outside pytest, as the plugin's options would pick it: ``SGLWORKER_LAUNCHER`` (shlex-split),
    else the simulated engine when ``SGLWORKER_ENGINE=sim``, else :func:`default_launcher`."""
    environ = os.environ if environ is None else environ
    if environ.get("SGLWORKER_LAUNCHER", "").strip():
        return parse_launcher(environ["SGLWORKER_LAUNCHER"])
    if environ.get("SGLWORKER_ENGINE", "").strip() == "sim":
        return sim_launcher()
    return default_launcher()


def parse_launcher(value: str) -> list[str]:
    """A ``--sgl-launcher`` value, shlex-split. Raises ``ValueError`` on an empty or unbalanced value."""
    try:
        parts = shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"cannot split launcher {value!r}: {exc}") from None
    if not parts:
        raise ValueError("the launcher is empty; give a command such as 'python -m sglang.launch_server'")
    return parts


def foreign_hosts(argv: Sequence[str]) -> list[str]:
    """Hosts other than loopback that ``argv`` would bind (``--host`` and every abbreviation of it)."""
    return [value or "" for value in flag_table().parse(argv).all("host") if value not in LOOPBACK_NAMES]


def build_argv(
    spec: ModelSpec,
    *,
    port: int,
    nccl_port: int | None = None,
    launcher: Sequence[str] | None = None,
    extra_args: Sequence[str] = (),
    model_path: str | None = None,
    allow_foreign_host: bool = False,
    role_args: Sequence[str] = (),
) -> list[str]:
    """The full worker argv: launcher, model, 127.0.0.1, port, tp, the spec's args, the test's extra args,
    then the args of its kind (``--disaggregation-mode prefill --disaggregation-bootstrap-port N``)."""
    for where, args in (("extra args", extra_args), (f"the worker_args of spec {spec.name!r}", spec.worker_args)):
        hosts = foreign_hosts(args)
        if hosts and not allow_foreign_host:
            raise LaunchError(
                f"worker {spec.name}: {where} would bind {', '.join(map(repr, hosts))}, not loopback; workers "
                "listen on 127.0.0.1 only (opt out with allow_foreign_host=True / "
                "@pytest.mark.sgl_worker(allow_foreign_host='reason'))"
            )
    argv = list(launcher if launcher is not None else environment_launcher())
    argv += ["--model-path", model_path or spec.resolve_model_path(), "--host", LOOPBACK_HOST, "--port", str(port)]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    argv += ["--tp-size", str(spec.tp)]
    argv += list(spec.worker_args)
    argv += list(extra_args)
    argv += list(role_args)
    return argv


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


def read_head(path: Path | str, max_bytes: int = 4 * 1024 * 1024) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(max_bytes).decode("utf-8", errors="replace")
    except OSError:
        return ""


#: The secret word must stand as a whole word of the name (HF_TOKEN, OPENAI_API_KEY, AWS_SECRET_ACCESS_KEY), so
#: that TOKENIZERS_PARALLELISM=false does not turn every "false" of a log into "***".
_SECRET_NAME_WORD = re.compile(r"(?:^|_)(?:TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIALS?|AUTH)(?:_|$)",
                               re.IGNORECASE)
_NOT_SECRET_VALUES = frozenset({"true", "false", "none", "null", "auto"})
MASK = "***"


def _secret_positions(argv: Sequence[str]) -> list[tuple[int, bool]]:
    """``(index, inline)`` of every secret value in ``argv``: the values of sglang's secret flags (resolved
    with their abbreviations, ``--api-k``), and of other programs' ``--api-key``-like options (a router's)."""
    table = flag_table()
    found: list[tuple[int, bool]] = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, _ = arg.partition("=")
        try:
            flag = table.resolve(name)
        except ValueError:  # ambiguous: not a flag sglang would take
            flag = None
        secret = flag.secret if flag is not None else SECRET_FLAG.fullmatch(name) is not None
        if secret:
            if eq:
                found.append((i, True))
            elif i + 1 < len(argv):
                found.append((i + 1, False))
    return found


def mask_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every secret flag replaced by ``***``, whatever its length."""
    out = list(argv)
    for i, inline in _secret_positions(argv):
        out[i] = out[i].partition("=")[0] + "=" + MASK if inline else MASK
    return out


def _secret_name(name: str) -> bool:
    return bool(SECRET_ENV_PATTERN.search(name) and _SECRET_NAME_WORD.search(name))


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the value of every secret-looking variable (``HF_TOKEN``, ``OPENAI_API_KEY``) masked."""
    return {k: MASK if _secret_name(k) and v.lower() not in _NOT_SECRET_VALUES else v for k, v in env.items()}


def secret_values(env: Mapping[str, str], argv: Sequence[str] = ()) -> list[str]:
    """Values to redact from free text (log tails, messages): secret-looking env vars and secret flag values,
    4+ characters (a shorter one would mangle unrelated text; argvs are masked structurally by
    :func:`mask_argv` instead)."""
    values = [v for k, v in env.items() if _secret_name(k) and len(v) >= 4 and v.lower() not in _NOT_SECRET_VALUES]
    for i, inline in _secret_positions(argv):
        value = argv[i].partition("=")[2] if inline else argv[i]
        if len(value) >= 4:
            values.append(value)
    return sorted(set(values), key=len, reverse=True)


def redact(text: str, secrets: Sequence[str]) -> str:
    for value in secrets:
        text = text.replace(value, "***")
    return text


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


@dataclass(kw_only=True)
class ManagedProcess:
    """A process the plugin started and owns (a worker or a router): its argv, its log file, its tree, its
    teardown. Use as a context manager, or call :meth:`stop`."""

    argv: list[str]
    host: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]
    owner_tag: str
    secrets: list[str] = field(default_factory=list, repr=False)
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    #: how long the readiness probe that found it ready took (a slow health endpoint stays slow)
    ready_probe_seconds: float = 0.0
    port_block: PortBlock | None = field(default=None, repr=False)
    pids_seen: set[int] = field(default_factory=set)
    #: log lines a failure report quotes
    tail_lines: int = DEFAULT_TAIL_LINES
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

    def log_text(self, max_bytes: int = 4 * 1024 * 1024) -> str:
        return redact(read_head(self.log_path, max_bytes), self.secrets)

    def diagnosis(self, *, alive: bool = False) -> Diagnosis | None:
        """What went wrong, read off the log (None where no diagnosis applies)."""
        return None

    def failure(self, kind: type[E], event: str, *, lines: int | None = None, extra: str = "",
                alive: bool = False) -> E:
        """An error of ``kind`` about this process: ``event`` with the diagnosis of its log (``alive``: of a
        running process), the argv, the log path and the last ``lines`` lines (default: :attr:`tail_lines`)."""
        lines = self.tail_lines if lines is None else lines
        try:
            diagnosis = self.diagnosis(alive=alive)
        except Exception:  # a diagnosis must never hide the log
            diagnosis = None
        return kind(worker=self.describe(), event=event, diagnosis=diagnosis, extra=extra,
                    argv=redact(shlex.join(mask_argv(self.argv)), self.secrets), log_path=str(self.log_path),
                    tail=self.log_tail(lines), tail_lines=lines)

    def failure_message(self, what: str, *, lines: int | None = None, extra: str = "") -> str:
        """``<process> <what>`` + diagnosis + log path + the last ``lines`` lines."""
        return str(self.failure(WorkerError, what, lines=lines, extra=extra))

    @property
    def client(self) -> httpx.Client:
        """An ``httpx.Client`` bound to :attr:`url` (created on first use, closed by :meth:`stop`)."""
        if self._client is None:
            import httpx

            self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(60.0, connect=5.0))
        return self._client

    # -- tree ---------------------------------------------------------------------------------------------
    def _tree(self, *, sweep: bool = True) -> list[psutil.Process]:
        """The processes of this tree (see :func:`processes.process_tree`); every pid seen is remembered, for
        the GPU lease's memory-release wait."""
        procs = process_tree(self.pid, self.owner_tag, sweep=sweep)
        self.pids_seen.update(p.pid for p in procs)
        return procs

    def remember_tree(self) -> None:
        """Remember the pids of the tree as it is now (the root's at least, even when it has exited)."""
        import psutil

        self.pids_seen.add(self.pid)
        with contextlib.suppress(psutil.Error, OSError):
            self._tree(sweep=False)

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


@dataclass(kw_only=True)
class ModelInstance(ManagedProcess):
    """A running sglang worker (a member of a worker group has a role other than ``worker``)."""

    spec: ModelSpec
    gpus: str | None = None
    #: the kind of worker process (regular, prefill, decode, ...) and its role in a group
    kind: WorkerKind = field(default_factory=HttpWorker, repr=False)
    #: index of this member among the group members of its role
    index: int = 0

    # -- identity -----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.kind.url(self.host, self.port)

    @property
    def role(self) -> str:
        """``worker``, ``prefill`` or ``decode``."""
        return self.kind.role

    @property
    def bootstrap_port(self) -> int | None:
        """The KV bootstrap port of a prefill worker (the router passes it to the decode side)."""
        return self.ports.get("bootstrap")

    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self) -> str:
        gpus = f", GPUs {self.gpus}" if self.gpus else ""
        role = "" if self.role == "worker" else f" ({self.role} {self.index})"
        return f"worker {self.spec.name}{role} on {self.host}:{self.port} (pid {self.pid}{gpus})"

    # -- state --------------------------------------------------------------------------------------------
    def responds(self, timeout: float | None = None) -> bool:
        """Alive and answering its readiness check within ``timeout`` seconds (the whole request; default 2 s,
        or three times what its ready probe took, whichever is longer): the pool's check before it hands a
        pooled worker to the next test. A frozen (SIGSTOPped, wedged) worker accepts connections but answers
        nothing, and fails this."""
        if not self.is_alive():
            return False
        if timeout is None:
            timeout = max(2.0, 3 * self.ready_probe_seconds)
        return self.kind.readiness().probe(self, time.monotonic() + timeout, lambda: not self.is_alive()).ready

    def fatal_in_log(self) -> bool:
        """Whether the log of this (running) worker shows a fatal first error (sglang may then stay alive
        without ever serving)."""
        return self.diagnosis(alive=True).fatal

    def check_alive(self) -> None:
        """Raise :class:`WorkerDied` (diagnosis and tail included) if the worker has exited."""
        if not self.is_alive():
            raise self.failure(WorkerDied, f"exited with {signal_name(self.returncode)}")

    def diagnosis(self, *, alive: bool = False) -> Diagnosis:
        """The first error in the log, classified. ``alive``: diagnose the log of a running worker."""
        from ..engine.diagnosis import diagnose

        return diagnose(self.log_text(), None if alive else self.returncode)


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()) or prefix + "<empty log>"


#: Below this much free space (or with no free inode) in the log directory a launch fails at once: an engine
#: that cannot write its log dies or hangs with nothing to show.
MIN_LOG_FREE_BYTES = 1024 * 1024
_LAUNCHER_CHECKS: dict[tuple[str, ...], str | None] = {}


def _check_free_space(log_dir: Path) -> None:
    try:
        st = os.statvfs(log_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < MIN_LOG_FREE_BYTES or (st.f_files > 0 and st.f_favail == 0):
        what = f"{free // 1024} KiB free" if free < MIN_LOG_FREE_BYTES else "no free inode"
        raise LaunchError(f"log directory {log_dir} is full ({what}; a worker log needs at least "
                          f"{MIN_LOG_FREE_BYTES // (1024 * 1024)} MiB): free some space or choose another "
                          "--sgl-log-dir")


def check_launcher(launcher: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`LaunchError` before anything is launched when the launcher cannot start an engine: its
    executable is missing or not executable, or it is ``<python> -m <module>`` and that python cannot import
    the module (sglang not installed there). The module check runs once per process and launcher."""
    import shutil

    env = os.environ if env is None else env
    exe = launcher[0]
    found = shutil.which(exe, path=env.get("PATH", os.defpath))
    if found is None:
        if os.sep in exe and os.path.exists(exe):
            raise LaunchError(f"launcher {exe!r} is not executable")
        raise LaunchError(f"launcher {exe!r} not found; install sglang, or set --sgl-launcher / SGLWORKER_LAUNCHER, "
                          "or use --sgl-engine sim")
    module = python_module(launcher)
    if module is None:
        return
    top = module.split(".", 1)[0]
    key = (found, top, env.get("PYTHONPATH", ""), env.get("PYTHONHOME", ""))
    if key not in _LAUNCHER_CHECKS:
        me = os.path.abspath(sys.executable)
        same_python = os.path.abspath(found) == me or (
            os.path.dirname(os.path.abspath(found)) == os.path.dirname(me)  # python/python3 of one venv
            and os.path.realpath(found) == os.path.realpath(me))
        if same_python and all(env.get(k) == os.environ.get(k) for k in ("PYTHONPATH", "PYTHONHOME")):
            import importlib.util

            code: int | None = 0 if importlib.util.find_spec(top) is not None else 3  # finds, does not import
        else:
            probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
            try:
                code = subprocess.run([found, "-c", probe, top], env=dict(env), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode
            except (OSError, subprocess.TimeoutExpired):
                code = None  # cannot tell: let the launch itself show what happens
        _LAUNCHER_CHECKS[key] = (
            f"{exe} cannot import {top!r}, so '{shlex.join(launcher)}' cannot start: {top} is not installed for "
            f"that python. Install it there (for sglang: pip install sglang, or bash scripts/install-real-engine.sh), "
            "point --sgl-launcher / SGLWORKER_LAUNCHER at a python that has it, or use --sgl-engine sim"
        ) if code == 3 else None
    message = _LAUNCHER_CHECKS[key]
    if message is not None:
        raise LaunchError(message)


def _private_file(path: str, flags: int) -> int:
    """Opener for worker logs: 0600 whatever the umask (the engine logs its arguments, --api-key included)."""
    return os.open(path, flags, 0o600)


def popen(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own, stdin closed, stdout and stderr appended to ``log_path`` (a
    private file, whose handle the parent closes at once); a missing or unusable log or launcher is a
    :class:`LaunchError`."""
    try:
        log = open(log_path, "ab", buffering=0, opener=_private_file)
    except OSError as exc:
        raise LaunchError(f"cannot write the worker log {log_path}: {exc.strerror}; choose a writable --sgl-log-dir",
                          log_path=str(log_path)) from None
    try:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, close_fds=True,
        )
    except FileNotFoundError:
        raise LaunchError(
            f"launcher {argv[0]!r} not found; install sglang, or set --sgl-launcher / SGLWORKER_LAUNCHER, "
            "or use --sgl-engine sim", log_path=str(log_path),
        ) from None
    except PermissionError:
        raise LaunchError(f"launcher {argv[0]!r} is not executable", log_path=str(log_path)) from None
    finally:
        log.close()


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch: everything that is not the spec or the test's args."""

    launcher: tuple[str, ...] | None = None
    log_dir: Path | None = None
    lock_dir: Path | None = None
    startup_timeout: float = 600.0
    port_range: tuple[int, int] | None = None
    port_retries: int = 3
    allow_foreign_host: bool = False
    #: log lines quoted by failure reports (``--sgl-tail-lines``)
    tail_lines: int = DEFAULT_TAIL_LINES
    #: how long to wait for a free port block when every block is held (the plugin uses the lease timeout)
    port_wait_timeout: float = 0.0
    on_port_wait: Callable[[str], None] | None = field(default=None, compare=False)


def spawn_worker(
    spec: ModelSpec,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    options: LaunchOptions | None = None,
    on_progress: ProgressCallback | None = None,
    gpus: str | None = None,
    kind: WorkerKind | None = None,
    index: int = 0,
    cancel: threading.Event | None = None,
    starter: Callable[..., ModelInstance] | None = None,
) -> ModelInstance:
    """Launch a worker for ``spec`` and return it once it is healthy.

    ``env`` is added to the inherited environment (after the spec's env): a GPU lease's
    ``CUDA_VISIBLE_DEVICES`` goes here. Without ``port``, a port block is reserved across processes (and
    the launch is retried on another block if the port was taken between reservation and bind). ``kind``
    (default: :func:`~pytest_sglworker.workers.kinds.default_kind` of the spec's and the extra args, so
    ``--grpc-mode`` makes a :class:`~pytest_sglworker.workers.grpc_worker.GrpcWorker`) says which ports to pin and
    how readiness is proven. ``cancel`` set by another thread (a group member failed) stops the wait at once.
    ``starter`` replaces how the process is started (``_start``'s signature; ``--sgl-cluster ray`` starts it in
    a Ray actor on another node); the port block, the health wait, the retries and the teardown stay these.

    Outside pytest the launcher follows ``SGLWORKER_LAUNCHER`` / ``SGLWORKER_ENGINE=sim`` (see
    :func:`environment_launcher`) unless ``options.launcher`` is given. It takes **no GPU lease**: pass the
    GPUs yourself in ``env`` (``CUDA_VISIBLE_DEVICES``); inside pytest, the fixtures lease them.
    """
    from ..resources import state

    kind = kind or default_kind("worker", (*spec.worker_args, *extra_args))
    kind.check_available(spec)
    options = options or LaunchOptions()
    check_launcher(options.launcher or environment_launcher(), {**os.environ, **spec.env, **(env or {})})
    log_dir = state.ensure_private_dir(options.log_dir or state.default_log_dir(), what="log directory")
    _check_free_space(log_dir)
    if port is not None and len(kind.port_names) > 2:
        raise LaunchError(f"worker {spec.name}: a {kind.name} worker pins {len(kind.port_names)} ports "
                          f"({', '.join(kind.port_names)}); let it reserve a port block instead of giving port=")
    attempts = 1 if port is not None else max(1, options.port_retries)
    for attempt in range(1, attempts + 1):
        block = None
        if port is None:
            from ..resources.ports import PORT_BLOCK_SIZE, reserve_port_block

            block = reserve_port_block(
                state.ensure_private_dir(options.lock_dir or state.default_lock_dir(), what="lock directory",
                                         shared_ok=options.lock_dir is not None),  # as the plugin's GPU leases
                port_range=options.port_range, size=PORT_BLOCK_SIZE, timeout=options.port_wait_timeout,
                on_wait=options.on_port_wait,
            )
            ports = dict(zip(kind.port_names, block.ports, strict=False))
        else:
            ports = {kind.port_names[0]: port}
        try:
            instance = (starter or _start)(spec, ports, extra_args, env, options, log_dir, gpus, kind, index)
        except BaseException:
            if block is not None:
                block.release()
            raise
        instance.port_block = block
        try:
            wait_until_ready(instance, kind.readiness(), timeout=options.startup_timeout, on_progress=on_progress,
                             cancel=cancel)
            instance.times["ready"] = time.time()
            # The tree as it serves (sglang's scheduler and detokenizer included) is remembered now: a worker
            # that is SIGKILLed later still has its pids in the lease's memory-release wait.
            instance.remember_tree()
            return instance
        except WorkerStartupError as exc:
            instance.stop()
            from ..engine.diagnosis import Kind

            if exc.diagnosis is not None and exc.diagnosis.kind is Kind.PORT_IN_USE and attempt < attempts:
                continue
            raise
        except LaunchCancelled:
            instance.stop()
            instance.remove_log()  # called off before it was needed: nothing to keep
            raise
        except BaseException:
            instance.stop()
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _start(
    spec: ModelSpec,
    ports: Mapping[str, int],
    extra_args: Sequence[str],
    env: Mapping[str, str] | None,
    options: LaunchOptions,
    log_dir: Path,
    gpus: str | None,
    kind: WorkerKind,
    index: int,
) -> ModelInstance:
    port = ports[kind.port_names[0]]
    argv = build_argv(spec, port=port, nccl_port=ports.get("nccl"), launcher=options.launcher,
                      extra_args=extra_args, allow_foreign_host=options.allow_foreign_host,
                      role_args=kind.role_args(ports))
    started = start_process(argv, {**spec.env, **(env or {})}, log_dir / log_name("sglang-worker", port))
    return ModelInstance(
        spec=spec, host=LOOPBACK_HOST, port=port, tail_lines=options.tail_lines, kind=kind, index=index,
        ports=dict(ports), gpus=gpus, **started,
    )


def start_process(argv: list[str], env: Mapping[str, str], log_path: Path) -> dict[str, Any]:
    """Start ``argv`` the way every process of the plugin starts: in a session of its own, tagged with a new
    owner tag, stdout and stderr into ``log_path`` (never a pipe), stdin closed. ``env`` is added to this
    process's environment. Returns the :class:`ManagedProcess` fields it fills."""
    tag = owner_tag()
    full_env = dict(os.environ)
    full_env.update(env)
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env[OWNER_ENV] = tag
    log_path = unused_log_path(log_path)
    started = time.time()
    process = popen(argv, full_env, log_path)
    return {"argv": argv, "log_path": log_path, "process": process, "owner_tag": tag,
            "secrets": secret_values(full_env, argv), "times": {"started": started}}


@contextlib.contextmanager
def running_worker(spec: ModelSpec, **kwargs: Any) -> Iterator[ModelInstance]:
    """``with running_worker(spec) as w:`` — :func:`spawn_worker` and a guaranteed :meth:`stop`."""
    instance = spawn_worker(spec, **kwargs)
    try:
        yield instance
    finally:
        instance.stop()


__all__ = [
    "LaunchOptions",
    "ModelInstance",
    "build_argv",
    "running_worker",
    "spawn_worker",
]
