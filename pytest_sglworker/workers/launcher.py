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
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.cpu_engine import cpu_rank_env
from ..engine.diagnosis import Kind, diagnose
from ..engine.engine_args import python_module
from ..engine.sglang_facts import (
    LAUNCH_MODULE,
    LOOPBACK_HOST,
    LOOPBACK_NAMES,
    dp_ranks_bind_one_nccl_port,
    flag_table,
)
from ..engine.specs import ModelSpec
from ..resources import state
from ..resources.ports import PORT_BLOCK_SIZE, reserve_port_block
from ..resources.processes import signal_name
from .config import default_kind
from .errors import LaunchCancelled, LaunchError, WorkerDied, WorkerStartupError
from .health import ProgressCallback as ProgressCallback
from .health import wait_until_ready
from .kinds import HttpWorker, WorkerKind
from .process import (
    DEFAULT_TAIL_LINES,
    SIM_ENGINE_HINT,
    ManagedProcess,
    inherited_environ,
    log_name,
    start_process,
)

if TYPE_CHECKING:
    from ..engine.diagnosis import Diagnosis
    from ..engine.log_lines import ServedCounter


#: the simulated engine's module (``python -m pytest_sglworker.sim``)
SIM_MODULE = "pytest_sglworker.sim"


def default_launcher() -> list[str]:
    """``<this python> -m sglang.launch_server``."""
    return [sys.executable, "-m", LAUNCH_MODULE]


def sim_launcher() -> list[str]:
    """The simulated engine shipped with this package."""
    return [sys.executable, "-m", SIM_MODULE]


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


def worker_env(spec: ModelSpec, env: Mapping[str, str] | None, *, argv: Sequence[str],
               environ: Mapping[str, str]) -> dict[str, str]:
    """What a worker's process launched with ``argv`` gets on top of the environment ``environ`` it inherits: the
    spec's ``env``, then the member's own (its GPUs, its tag, ...), then, on sglang's CPU engine, each rank's cores
    when ``argv`` runs several ranks (``--dp-size 2``, ``--tp-size 2``; :func:`~..engine.cpu_engine.cpu_rank_env`,
    unless a binding is named already). One definition, so that adoption expects what a launch gave."""
    own = {**spec.env, **(env or {})}
    return {**own, **cpu_rank_env(argv, own, environ)}


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
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The full worker argv: launcher, model, 127.0.0.1, port, the NCCL port (not for ``--dp-size`` N > 1 without
    DP attention, whose ranks would each bind it: they pick their own), tp, the spec's args, the test's extra args,
    then the args of its kind (``--disaggregation-mode prefill --disaggregation-bootstrap-port N``). ``environ``
    (default: this process's) names the launcher and the model roots when they are not given."""
    for where, args in (("extra args", extra_args), (f"the worker_args of spec {spec.name!r}", spec.worker_args)):
        hosts = foreign_hosts(args)
        if hosts and not allow_foreign_host:
            raise LaunchError(
                f"worker {spec.name}: {where} would bind {', '.join(map(repr, hosts))}, not loopback; workers "
                "listen on 127.0.0.1 only (opt out with allow_foreign_host=True / "
                "@pytest.mark.sgl_worker(allow_foreign_host='reason'))"
            )
    argv = list(launcher if launcher is not None else environment_launcher(environ))
    model = model_path or spec.resolve_model_path(environ)
    argv += ["--model-path", model, "--host", LOOPBACK_HOST, "--port", str(port)]
    if nccl_port is not None and not dp_ranks_bind_one_nccl_port([*spec.worker_args, *extra_args, *role_args]):
        argv += ["--nccl-port", str(nccl_port)]  # data-parallel ranks each pick their own instead
    argv += ["--tp-size", str(spec.tp)]
    argv += list(spec.worker_args)
    argv += list(extra_args)
    argv += list(role_args)
    return argv


@dataclass(kw_only=True)
class ModelInstance(ManagedProcess):
    """A running sglang worker (a member of a worker group has a role other than ``worker``)."""

    spec: ModelSpec
    gpus: str | None = None
    #: the kind of worker process (regular, prefill, decode, ...) and its role in a group
    kind: WorkerKind = field(default_factory=HttpWorker, repr=False)
    #: index of this member among the group members of its role
    index: int = 0
    _served: ServedCounter | None = field(default=None, init=False, repr=False, compare=False)
    _served_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

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

    @property
    def simulated(self) -> bool:
        """Whether this worker is the simulated engine (``python -m pytest_sglworker.sim``): its request faults can
        be switched at run time through its control endpoint (``/_sim/faults``)."""
        return python_module(self.argv) == SIM_MODULE

    def describe(self) -> str:
        gpus = f", GPUs {self.gpus}" if self.gpus else ""
        role = "" if self.role == "worker" else f" ({self.role} {self.index})"
        return f"worker {self.spec.name}{role} on {self.host}:{self.port} (pid {self.pid}{gpus})"

    # -- state --------------------------------------------------------------------------------------------
    def answer_timeout(self) -> float:
        """The whole-request deadline for asking this worker something between tests (its readiness, its run-time
        state): 2 s, or three times what its ready probe took, whichever is longer (a slow endpoint stays slow)."""
        return max(2.0, 3 * self.ready_probe_seconds)

    def responds(self, timeout: float | None = None) -> bool:
        """Alive and answering its readiness check within ``timeout`` seconds (the whole request; default 2 s,
        or three times what its ready probe took, whichever is longer): the pool's check before it hands a
        pooled worker to the next test. A frozen (SIGSTOPped, wedged) worker accepts connections but answers
        nothing, and fails this."""
        if not self.is_alive():
            return False
        if timeout is None:
            timeout = self.answer_timeout()
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
        return diagnose(self.log_text(), None if alive else self.returncode, self.argv)

    # -- what it served -----------------------------------------------------------------------------------
    def requests_served(self) -> int:
        """The inference requests (``/generate``, ``/v1/chat/completions``, ...) this worker has answered with a
        2xx status since it became ready, counted from the access lines of its own log: the same on the real
        engine and the simulated one, so a routing test can compare workers' counts before and after (a pooled
        worker's count runs on across the tests that use it). Needs the engine's access lines: an HTTP worker at
        log level info (the default); a :class:`ValueError` says why otherwise."""
        from ..engine.log_lines import ServedCounter

        with self._served_lock:
            if self._served is None:
                self._check_access_lines()
                self._served = ServedCounter(self.log_path, self.ready_log_offset)
            return self._served.update()

    def _check_access_lines(self) -> None:
        if not self.url.startswith("http"):
            raise ValueError(f"{self.describe()} serves {self.url.split(':', 1)[0]}, which logs no access line per "
                             "request: requests_served() counts HTTP workers' requests")
        parsed = flag_table().parse(self.argv)
        levels = [v for dest in ("log_level_http", "log_level") if parsed.given(dest)
                  for v in parsed.all(dest)[-1:] if v]
        level = levels[0].lower() if levels else "info"
        if level not in ("info", "debug"):
            flag = "--log-level-http" if parsed.given("log_level_http") else "--log-level"
            raise ValueError(f"{self.describe()} runs with {flag} {level}, which hides the access lines "
                             "requests_served() counts: leave its HTTP log level at info")


#: Below this much free space (or with no free inode) in the log directory a launch fails at once: an engine
#: that cannot write its log dies or hangs with nothing to show.
MIN_LOG_FREE_BYTES = 1024 * 1024
#: launcher checks made by this process (launches ahead check from their own threads: guarded)
_LAUNCHER_CHECKS: dict[tuple[str, ...], str | None] = {}
_LAUNCHER_CHECKS_LOCK = threading.Lock()
#: this process's own module search settings, read at import (on the main thread): a launcher that is this python
#: with the same settings finds what this process finds
_OWN_PYTHON_PATHS = (os.environ.get("PYTHONPATH", ""), os.environ.get("PYTHONHOME", ""))


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
    the module (sglang not installed there). The module check runs once per process and launcher. ``env`` is the
    environment the engine would get (default: this process's)."""
    import shutil

    env = os.environ if env is None else env
    exe = launcher[0]
    found = shutil.which(exe, path=env.get("PATH", os.defpath))
    if found is None:
        if os.sep in exe and os.path.exists(exe):
            raise LaunchError(f"launcher {exe!r} is not executable")
        raise LaunchError(f"launcher {exe!r} not found; install sglang, or set --sgl-launcher / SGLWORKER_LAUNCHER, "
                          f"{SIM_ENGINE_HINT}")
    module = python_module(launcher)
    if module is None:
        return
    top = module.split(".", 1)[0]
    key = (found, top, env.get("PYTHONPATH", ""), env.get("PYTHONHOME", ""))
    with _LAUNCHER_CHECKS_LOCK:
        known = key in _LAUNCHER_CHECKS
    if not known:
        me = os.path.abspath(sys.executable)
        same_python = os.path.abspath(found) == me or (
            os.path.dirname(os.path.abspath(found)) == os.path.dirname(me)  # python/python3 of one venv
            and os.path.realpath(found) == os.path.realpath(me))
        if same_python and (env.get("PYTHONPATH", ""), env.get("PYTHONHOME", "")) == _OWN_PYTHON_PATHS:
            import importlib.util

            code: int | None = 0 if importlib.util.find_spec(top) is not None else 3  # finds, does not import
        else:
            probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
            try:
                code = subprocess.run([found, "-c", probe, top], env=dict(env), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode
            except (OSError, subprocess.TimeoutExpired):
                code = None  # cannot tell: let the launch itself show what happens
        verdict = (
            f"{exe} cannot import {top!r}, so '{shlex.join(launcher)}' cannot start: {top} is not installed for "
            f"that python. Install it there (for sglang: pip install sglang, or sglworker install-real-engine), "
            f"point --sgl-launcher / SGLWORKER_LAUNCHER at a python that has it, {SIM_ENGINE_HINT}"
        ) if code == 3 else None
        with _LAUNCHER_CHECKS_LOCK:
            _LAUNCHER_CHECKS[key] = verdict
    with _LAUNCHER_CHECKS_LOCK:
        message = _LAUNCHER_CHECKS[key]
    if message is not None:
        raise LaunchError(message)


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
    #: check the port block the way the engine binds it (``SO_REUSEADDR``): a port holding only closed connections
    #: of an earlier server is free (for a port pinned by a test's URL, which the previous server just left)
    reuse_addr: bool = False
    #: the session id the workers' owner tags name (None: this pytest process's); a group that may be kept warm
    #: (``--sgl-keep-warm``) names its keeper's, so that no janitor takes it for an orphan once the session ends
    owner_session: str | None = field(default=None, compare=False)


def spawn_worker(
    spec: ModelSpec,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    options: LaunchOptions | None = None,
    on_progress: ProgressCallback | None = None,
    progress_interval: float = 1.0,
    gpus: str | None = None,
    kind: WorkerKind | None = None,
    index: int = 0,
    cancel: threading.Event | None = None,
    starter: Callable[..., ModelInstance] | None = None,
    environ: Mapping[str, str] | None = None,
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
    ``environ`` is the environment the worker inherits (default: this process's, read now); a caller on a
    background thread must pass the snapshot the main thread made (:func:`~.process.inherited_environ`).
    ``on_progress(instance, elapsed)`` is called while it waits for health, every ``progress_interval`` seconds.

    Outside pytest the launcher follows ``SGLWORKER_LAUNCHER`` / ``SGLWORKER_ENGINE=sim`` (see
    :func:`environment_launcher`) unless ``options.launcher`` is given. It takes **no GPU lease**: pass the
    GPUs yourself in ``env`` (``CUDA_VISIBLE_DEVICES``); inside pytest, the fixtures lease them.
    """
    environ = inherited_environ() if environ is None else environ
    kind = kind or default_kind("worker", (*spec.worker_args, *extra_args))
    kind.check_available(spec)
    options = options or LaunchOptions()
    check_launcher(options.launcher or environment_launcher(environ), {**environ, **spec.env, **(env or {})})
    log_dir = state.ensure_private_dir(options.log_dir or state.default_log_dir(), what="log directory")
    _check_free_space(log_dir)
    if port is not None and len(kind.port_names) > 2:
        raise LaunchError(f"worker {spec.name}: a {kind.name} worker pins {len(kind.port_names)} ports "
                          f"({', '.join(kind.port_names)}); let it reserve a port block instead of giving port=")
    attempts = 1 if port is not None else max(1, options.port_retries)
    taken: list[int] = []  # blocks a port of which was taken between the reservation and the bind
    for attempt in range(1, attempts + 1):
        block = None
        if port is None:
            block = reserve_port_block(
                state.ensure_private_dir(options.lock_dir or state.default_lock_dir(), what="lock directory",
                                         shared_ok=options.lock_dir is not None),  # as the plugin's GPU leases
                port_range=options.port_range, size=PORT_BLOCK_SIZE, timeout=options.port_wait_timeout,
                on_wait=options.on_port_wait, reuse_addr=options.reuse_addr, last=taken,
            )
            ports = dict(zip(kind.port_names, block.ports, strict=False))
        else:
            ports = {kind.port_names[0]: port}
        try:
            instance = (starter or _start)(spec, ports, extra_args, env, options, log_dir, gpus, kind, index,
                                           environ=environ)
        except BaseException:
            if block is not None:
                block.release()
            raise
        instance.port_block = block
        try:
            wait_until_ready(instance, kind.readiness(), timeout=options.startup_timeout, on_progress=on_progress,
                             progress_interval=progress_interval, cancel=cancel)
            instance.times["ready"] = time.time()
            # The tree as it serves (sglang's scheduler and detokenizer included) is remembered now: a worker
            # that is SIGKILLed later still has its pids in the lease's memory-release wait.
            instance.remember_tree()
            return instance
        except WorkerStartupError as exc:
            instance.stop()
            if exc.diagnosis is not None and exc.diagnosis.kind is Kind.PORT_IN_USE and attempt < attempts:
                if block is not None:
                    taken.append(block.port)  # another block first: this one's taker may come back
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
    *,
    environ: Mapping[str, str],
) -> ModelInstance:
    port = ports[kind.port_names[0]]
    argv = build_argv(spec, port=port, nccl_port=ports.get("nccl"), launcher=options.launcher,
                      extra_args=extra_args, allow_foreign_host=options.allow_foreign_host,
                      role_args=kind.role_args(ports), environ=environ)
    started = start_process(argv, worker_env(spec, env, argv=argv, environ=environ),
                            log_dir / log_name("sglang-worker", port), environ=environ,
                            session_id=options.owner_session)
    return ModelInstance(
        spec=spec, host=LOOPBACK_HOST, port=port, tail_lines=options.tail_lines, kind=kind, index=index,
        ports=dict(ports), gpus=gpus, **started,
    )


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
    "worker_env",
]
