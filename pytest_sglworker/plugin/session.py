"""The plugin's session object: one per pytest process, registered as a plugin whose hooks are its methods (the way
pytest-xdist registers its ``DSession``).

It holds the session's registry, settings, worker source, run records, watchdog and terminal: parametrization over
the selected models, per-test worker configurations (:meth:`SglSession.resolve_config`, the one place every entry
point resolves one), the choice of the worker source (:func:`make_source`), launching ahead, sglang's own flag
check, the signals that interrupt a run, and the run report at the end. Collection-time work is
:mod:`.collection`, the per-test hooks :mod:`.run_hooks`, the xdist hooks :mod:`.xdist_hooks`, options
:mod:`.options`, markers :mod:`.markers`, output :mod:`.terminal` and :mod:`.reporter`, the fixtures
:mod:`.fixtures`; this module imports none of them but the first and the lowest.

Why one module of this size: it is the one object that holds a pytest process's state and the hooks that read it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pytest

from ..engine import budget
from ..engine.specs import ModelSpec, SpecRegistry, set_active_registry
from ..errors import SglWorkerError, SpecError
from ..workers.records import RunRecords
from .keys import CONFIG_KEY, NEXT_KEY, RUN_INPUT, is_xdist_worker, xdist_worker_id
from .markers import MarkerError, WorkerMarker, WorkersMarker, launchable, opt_out_reason, required_features
from .options import Settings
from .terminal import Terminal

if TYPE_CHECKING:
    from ..resources.warm_records import Party
    from ..workers.config import GroupShape, WorkerConfig
    from ..workers.kinds import WorkerKind
    from ..workers.launcher import LaunchOptions
    from ..workers.router import RouterOptions
    from ..workers.sources.base import WorkerSource

__all__ = ["OPT_OUT_FIX", "STATE_KEY", "SglSession", "active_session", "make_source", "state_of", "when_session_starts"]

OPT_OUT_FIX = ("drop the args that loosen the budget, or add "
               "@pytest.mark.sgl_budget_opt_out(reason='why this test needs it')")


#: the session object of this pytest process
STATE_KEY = pytest.StashKey["SglSession"]()
#: while a worker starts, the controller's unchanged launch-ahead word is tried again this often (a launch it names
#: may not have fitted the GPUs free a moment ago; a try on GPUs that are not free starts nothing)
FOLLOW_RETRY_S = 0.1


def state_of(config: pytest.Config) -> SglSession:
    return config.stash[STATE_KEY]


#: the sessions of this process that have started and are not yet unconfigured, innermost last (a pytester run
#: in the same process nests one); read by code that has no pytest config at hand (the drop-ins of
#: :mod:`pytest_sglworker.compat`, called from a unittest ``setUpClass``)
_ACTIVE: list[SglSession] = []
#: told of every session that starts (:func:`when_session_starts`)
_ON_START: list[Callable[[SglSession], object]] = []


def active_session() -> SglSession | None:
    """The session of the pytest run in progress in this process (the innermost one), or None outside a run."""
    return _ACTIVE[-1] if _ACTIVE else None


def when_session_starts(callback: Callable[[SglSession], object]) -> None:
    """Call ``callback(session)`` for the session in progress, if any, and for every session that starts later in
    this process (at its ``pytest_sessionstart``, before collection)."""
    if callback not in _ON_START:
        _ON_START.append(callback)
    session = active_session()
    if session is not None:
        callback(session)


class SessionRuntime(Protocol):
    """A drop-in's runtime: a plugin object made for one session (:func:`session_plugin`)."""

    session: SglSession

    def __init__(self, session: SglSession) -> None: ...


_Runtime = TypeVar("_Runtime", bound=SessionRuntime)


def session_plugin(session: SglSession, name: str, kind: type[_Runtime]) -> _Runtime:
    """The plugin registered as ``name`` for ``session`` (a drop-in's runtime: one per session), made as
    ``kind(session)`` and registered on first call; one left by an earlier session of this process is replaced."""
    manager = session.config.pluginmanager
    plugin = manager.get_plugin(name)
    if not isinstance(plugin, kind) or plugin.session is not session:
        plugin = kind(session)
        if manager.get_plugin(name) is not None:
            manager.unregister(name=name)
        manager.register(plugin, name)
    return plugin


def _plugin_name(plugin: object) -> str:
    return getattr(plugin, "__file__", None) or getattr(plugin, "__name__", None) or repr(plugin)


def _has_line(entry: Any) -> bool:
    """Whether a traceback entry has a source line (pytest's ``TracebackEntry.lineno`` raises TypeError for one
    whose ``tb_lineno`` is None)."""
    try:
        return isinstance(entry.lineno, int)
    except TypeError:
        return False


def _workerinput(config: pytest.Config) -> dict[str, Any]:
    found = getattr(config, "workerinput", None)
    return found if isinstance(found, dict) else {}


def _run_of(config: pytest.Config) -> Party | None:
    """An xdist worker's run, when the controller hands groups over within it (``sglworker_run``: its pid, start
    time and session id)."""
    raw = _workerinput(config).get(RUN_INPUT)
    if not isinstance(raw, list) or len(raw) != 3:
        return None
    from ..resources.warm_records import Party

    return Party(int(raw[0]), float(raw[1]), str(raw[2]), "the xdist controller")


def make_source(session: SglSession) -> WorkerSource:
    """The worker source the settings select: attached workers (``--sgl-worker-url``) for the specs they serve, in
    front of a Ray cluster (``--sgl-cluster ray``) or this machine's file-locked leases (the default). A new source
    is one line here and the option that selects it."""
    from ..workers.sources.local import LocalSource, PoolHooks, PoolSettings
    from .launch_hints import RunHandOver

    s = session.settings
    terminal = session.terminal
    launch = session.launch_options()
    log_dir = launch.log_dir
    settings = PoolSettings(launch=launch, lock_dir=session.lock_dir(),
                            lease_timeout=s.lease_timeout, reuse=s.reuse, log_policy=s.log_policy,
                            tail_lines=s.tail_lines, gpus=s.gpus, environ=session.worker_environ(),
                            cluster=s.cluster, keep_warm=s.keep_warm, adopt_warm=s.reuse and s.cluster is None,
                            session_log_dir=log_dir if s.log_dir is None and log_dir is not None
                            and (log_dir / ".lock").is_file() else None,
                            holder=f"{session.config.rootpath.name} (pid {os.getpid()})",
                            ray_ahead=_workerinput(session.config).get("sglworker_ray_ahead"),
                            run=_run_of(session.config) if s.reuse and s.cluster is None else None)
    hooks = PoolHooks(on_message=terminal.message, on_progress=terminal.progress,
                      on_progress_end=terminal.progress_end, worker_env=session.worker_env,
                      choose_kind=session.choose_kind, on_leased=session.on_leased, on_tick=terminal.flush,
                      finished=session.finished_configs if is_xdist_worker(session.config) else None,
                      follow=session.follow_controller if is_xdist_worker(session.config) else None,
                      xdist_worker=xdist_worker_id(session.config), handover=RunHandOver(session.config),
                      env_hooked=session.env_hooked)
    source: WorkerSource
    if s.cluster is not None:
        from ..workers.sources.ray import RaySource

        source = RaySource(settings, session.records, hooks)
    else:
        source = LocalSource(settings, session.records, hooks)
    if s.worker_urls:
        from ..workers.sources.attached import AttachedSource

        source = AttachedSource(s.worker_urls, source, session.records,
                                option=s.sources.get("worker-url", "--sgl-worker-url"), tail_lines=s.tail_lines)
    return source


class SglSession:
    """Everything the plugin holds for one session, and the hooks that use it."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.registry = SpecRegistry.with_builtins()
        self.registered_from: set[int] = set()
        self.terminal = Terminal(config)
        #: this process's figures and launch records (the pool's, the routers', the attached workers')
        self.records = RunRecords(xdist_worker_id(config) or "main")
        self._source: WorkerSource | None = None
        self._watchdog: Any = None
        self.flag_check: str = "checked as each worker is asked for (no model selected up front)"
        self.worker_stats: list[dict[str, Any]] = []  # from xdist workers
        self.worker_launches: list[list[dict[str, Any]]] = []  # from xdist workers
        self.worker_warm: list[dict[str, list[dict[str, Any]]]] = []  # from xdist workers
        #: node ids of the last test of each worker configuration: its workers are retired after it
        self.last_users: set[str] = set()
        self.interrupted_by: int | None = None
        #: a Ctrl-C that landed while the session ended (see pytest_sessionfinish)
        self.late_interrupt = False
        #: a Ctrl-C reached this process (see _on_sigint)
        self.sigint_seen = False
        self._log_dir: Path | None = None
        #: the collected tests in run order (collection sets them; launch ahead reads what comes next)
        self.queue: list[pytest.Item] = []
        self.queue_index: dict[str, int] = {}
        self._configs_by_key: dict[str, WorkerConfig] | None = None  # an xdist worker's, for the controller's hints
        #: the controller's last launch-ahead word that :meth:`follow_controller` acted on, and when
        self._followed: tuple[tuple[str, ...], float] = ((), 0.0)
        #: an xdist worker's thread that starts the controller's launches ahead while a test runs, and what its
        #: launches were worked out from (the environment, whether a plugin hook shapes the workers' env)
        self._follower: Any = None
        self._kits_from: tuple[dict[str, str], bool] | None = None
        #: the test whose fixtures are being set up (its launch triggers the launches ahead)
        self.setting_up: pytest.Item | None = None
        self._session_dir: Any = None
        self._kept_until: float | None = None
        self._previous_handlers: dict[int, Any] = {}
        #: node id -> [seconds of setup + call + teardown, its configuration's key]: the report's "tests"
        self.test_times: dict[str, list[Any]] = {}
        self.shard_note: str | None = None
        self._shard_costs: tuple[Any, list[str]] | None = None
        #: routers of class or module scope, by (scope node id, configuration key, router marker)
        self.routers: dict[Any, Any] = {}
        self.started_at = time.time()
        #: the session's exit status, once pytest_sessionfinish has it (an interrupted run keeps nothing warm)
        self.exitstatus: int | None = None

    @property
    def messages(self) -> list[str]:
        return self.terminal.messages

    # -- registry -----------------------------------------------------------------------------------------
    def register_from(self, plugin: object) -> None:
        hook = getattr(plugin, "pytest_sglworker_register_specs", None)
        if hook is None or id(plugin) in self.registered_from:
            return
        self.registered_from.add(id(plugin))
        try:
            hook(registry=self.registry)
        except SpecError as exc:
            raise pytest.UsageError(f"pytest_sglworker_register_specs in {_plugin_name(plugin)}: {exc}") from None
        except Exception as exc:  # a conftest's bug is a usage error naming it, never an INTERNALERROR
            raise pytest.UsageError(
                f"pytest_sglworker_register_specs in {_plugin_name(plugin)} raised {type(exc).__name__}: {exc} "
                "(fix the hook; it runs once per session to register model specs)") from None

    def register_all(self) -> None:
        for plugin in self.config.pluginmanager.get_plugins():
            self.register_from(plugin)

    def spec_problems(self) -> dict[str, str]:
        """``{spec name: message}`` for every registered spec that breaks the budget."""
        problems = {}
        for spec in self.registry:
            found = budget.check_spec(spec)
            if found:
                problems[spec.name] = budget.describe_violation(f"model spec {spec.name!r} ({spec.model})", found)
        return problems

    def selected_specs(self) -> list[ModelSpec]:
        """The specs ``--sgl-model`` selects: names, ``all`` (every registered spec) and ``feature:<name>``
        (every spec with that feature), in the order given, each once. An unknown name is a usage error that
        suggests the closest known one."""
        import difflib

        source = self.settings.sources.get("model", "--sgl-model")
        chosen: dict[str, ModelSpec] = {}
        if not self.settings.models and self.settings.worker_urls:
            source = self.settings.sources.get("worker-url", "--sgl-worker-url")
        for name in self.settings.models or tuple(self.settings.worker_urls):
            if name == "all":
                chosen.update((spec.name, spec) for spec in self.registry)
            elif name.startswith("feature:"):
                feature = name[len("feature:"):]
                matching = self.registry.with_feature(feature)
                if not matching:
                    known = sorted({f for spec in self.registry for f in spec.features})
                    raise pytest.UsageError(f"{source}: no registered model has feature {feature!r}; features: "
                                            f"{', '.join(known) or '(none)'}")
                chosen.update((spec.name, spec) for spec in matching)
            elif name in self.registry:
                chosen.setdefault(name, self.registry.get(name))
            else:
                close = difflib.get_close_matches(name, self.registry.names(), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise pytest.UsageError(
                    f"{source}: unknown model(s) {name!r}; known: {', '.join(self.registry.names())}{hint} "
                    "(also 'all' and 'feature:<name>'; register more with pytest_sglworker_register_specs)")
        return list(chosen.values())

    # -- worker configurations ----------------------------------------------------------------------------
    def choose_kind(self, role: str, args: Any) -> WorkerKind:
        from ..workers.config import default_kind

        chosen = self.config.hook.pytest_sglworker_worker_kind(role=role, args=tuple(args))
        return chosen if chosen is not None else default_kind(role, args)

    def resolve_config(self, node: Any, spec: ModelSpec, fixture: str) -> WorkerConfig:
        """The worker configuration of a test (``node``) for ``fixture``: its marker read and validated, the
        budget checked for every member. Raises :class:`MarkerError` for a bad marker and
        :class:`BudgetViolation` for args that loosen the budget without an opt-out; callers decide how each
        fails (a usage error at collection, an error of the test otherwise)."""
        from ..workers.config import GroupShape, WorkerConfig

        reason = opt_out_reason(node)
        group: GroupShape | None = None
        if fixture == "sgl_worker":
            marker = WorkerMarker.from_mark(node.get_closest_marker("sgl_worker"))
            args, env, name = marker.args, marker.env, "sgl_worker"
        else:
            group_marker = WorkersMarker.from_mark(node.get_closest_marker("sgl_workers"))
            group = GroupShape(group_marker.count, group_marker.prefill, group_marker.decode, group_marker.role_args,
                               group_marker.member_args, group_marker.member_env)
            args, env, name = group_marker.args, group_marker.env, "sgl_workers"
        subject = f"test {getattr(node, 'nodeid', node)}: @pytest.mark.{name}(args={list(args)!r}"
        subject += "".join(f", {role}_args={list(a)!r}" for role, a in (group.role_args if group else ()))
        members = group.member_args if group else ()
        subject += "".join(f", {role}_args[{i}]={list(a)!r}" for role, i, a in members) + ")"
        return WorkerConfig.resolve(spec, args, env, opt_out=reason, group=group, subject=subject, fix=OPT_OUT_FIX)

    # -- the worker source -------------------------------------------------------------------------------
    @property
    def source(self) -> WorkerSource:
        """Where this session's workers come from (made on first use, with the watchdog that guarantees that
        nothing the plugin starts outlives the session)."""
        if self._source is None:
            self.start_watchdog()
            self._source = make_source(self)
        return self._source

    @property
    def source_if_started(self) -> WorkerSource | None:
        return self._source

    def start_watchdog(self) -> None:
        """Before the first process starts: clean up after dead sessions, and start this session's watchdog
        (it ends every process of the session if this pytest dies without its teardown)."""
        if self._watchdog is not None:
            return
        from ..resources.reaper import Watchdog, reap_dead_sessions
        from ..resources.state import default_log_dir

        lock_dir = self.lock_dir()
        reaped = reap_dead_sessions(self.settings.log_dir or default_log_dir(), lock_dir=lock_dir)
        if reaped:
            self.terminal.message(f"cleaned up after earlier sessions: {reaped}")
        self._watchdog = Watchdog(lock_dir=lock_dir)

    def launch_options(self) -> LaunchOptions:
        from ..workers.launcher import LaunchOptions

        s = self.settings
        return LaunchOptions(
            launcher=self.launcher(), log_dir=self.log_dir, lock_dir=s.lock_dir, startup_timeout=s.startup_timeout,
            port_range=s.port_range, tail_lines=s.tail_lines, port_wait_timeout=s.lease_timeout,
            on_port_wait=self.terminal.message,
        )

    def router_options(self) -> RouterOptions:
        from ..workers.router import RouterOptions

        s = self.settings
        return RouterOptions(log_dir=self.log_dir, launcher=s.router_launcher, lock_dir=s.lock_dir,
                             port_range=s.port_range, port_wait_timeout=s.lease_timeout,
                             startup_timeout=s.startup_timeout, tail_lines=s.tail_lines, log_policy=s.log_policy,
                             on_message=self.terminal.message)

    def worker_environ(self) -> dict[str, str]:
        """The environment a worker started now inherits: this process's, read on the main thread (pytest's
        per-test variables left out). Launch threads get this snapshot; they never read ``os.environ``."""
        from ..workers.process import inherited_environ

        return inherited_environ()

    def env_hooked(self) -> bool:
        """Whether a plugin or conftest implements ``pytest_sglworker_worker_env`` (main thread)."""
        return bool(self.config.hook.pytest_sglworker_worker_env.get_hookimpls())

    def worker_env(self, spec: ModelSpec, lease_env: dict[str, str]) -> dict[str, str]:
        """A worker's environment from its lease, as the ``pytest_sglworker_worker_env`` hook changes it."""
        result = self.config.hook.pytest_sglworker_worker_env(spec=spec, lease_env=dict(lease_env))
        return dict(lease_env) if result is None else dict(result)

    def on_leased(self, config: WorkerConfig) -> None:
        """A test's own launch holds its lease and starts now: the next configurations start alongside it on
        the GPUs left free, instead of one startup later."""
        item = self.setting_up
        if item is not None:
            self.launch_ahead(item)

    def lock_dir(self) -> Path:
        from ..resources import state

        return state.ensure_private_dir(self.settings.lock_dir or state.default_lock_dir(), what="lock directory",
                                        shared_ok=self.settings.lock_dir is not None)

    @property
    def log_dir(self) -> Path:
        """Where this session's worker and router logs go: ``--sgl-log-dir`` as it is, the directory the xdist
        controller chose for its workers, or a new ``session-<N>`` under the default root (see
        :mod:`retention`)."""
        if self._log_dir is None:
            workerinput = getattr(self.config, "workerinput", None)
            if self.settings.log_dir is not None:
                self._log_dir = self.settings.log_dir
            elif isinstance(workerinput, dict) and workerinput.get("sglworker_log_dir"):
                self._log_dir = Path(workerinput["sglworker_log_dir"])
            else:
                from ..resources.retention import make_session_dir
                from ..resources.state import default_log_dir

                self._session_dir = make_session_dir(default_log_dir(), self.settings.log_retention_count)
                self._log_dir = self._session_dir.path
        return self._log_dir

    def logs_kept_until(self) -> float:
        """Until when the logs this run reports as kept stay (seconds since the epoch): its session directory
        was marked when the session ended (:meth:`_mark_kept_logs`); an explicit ``--sgl-log-dir`` loses logs
        unchanged for ``retention.KEEP_DAYS`` days to the janitor."""
        from ..resources.retention import KEEP_SECONDS

        return self._kept_until or time.time() + KEEP_SECONDS

    def _mark_kept_logs(self) -> None:
        """Before the session directory's lock goes: if the run keeps a log it reports (a failed worker's, or
        every log under ``--sgl-keep-logs``), retention leaves the directory ``KEEP_DAYS`` days, whatever the
        sessions of other jobs beside this one count."""
        from ..resources.retention import mark_kept

        keep = self.settings.keep_logs
        if self._session_dir is not None and any(st.failed_logs or (keep and st.kept_logs)
                                                 for st in self.collected_stats().values()):
            self._kept_until = mark_kept(self._session_dir.path)

    # -- sglang's own parser ------------------------------------------------------------------------------
    def launcher(self) -> tuple[str, ...]:
        from ..workers.launcher import default_launcher, sim_launcher

        s = self.settings
        return s.launcher or tuple(sim_launcher() if s.engine == "sim" else default_launcher())

    def check_flags(self, subjects: Mapping[str, tuple[ModelSpec, tuple[str, ...]]]) -> dict[str, str]:
        """Parse each subject's worker argv with sglang's own parser (in the engine's interpreter, cached).
        Returns ``{subject: message}`` for the argvs sglang rejects (a misspelt flag, an invalid choice)."""
        if not subjects:
            return {}
        import importlib.util

        from ..engine.engine_args import check_with_sglang, find_sglang_python
        from ..resources import state as state_dirs
        from ..workers.launcher import build_argv
        python = find_sglang_python(self.launcher())
        if python is None and self.settings.engine == "sim":
            python = sys.executable  # the sim engine: check with sglang if this environment has it
        if python is None:
            self.flag_check = f"not checked: cannot tell which python runs the launcher {' '.join(self.launcher())!r}"
            return {}
        if python == sys.executable and importlib.util.find_spec("sglang") is None:
            if self.settings.engine == "sim" and not self.settings.launcher:
                # information, not a problem: the simulated engine parses sglang's flags as each worker starts
                self.flag_check = ("checked by the simulated engine as each worker starts (sglang's own flags, "
                                   "rebuilt from its flag table; sglang itself is not installed here)")
            else:
                self.flag_check = f"not checked: sglang is not importable by {python}"
            return {}
        argvs = {name: build_argv(spec, port=30000, nccl_port=30001, launcher=(), extra_args=extra,
                                  allow_foreign_host=True) for name, (spec, extra) in subjects.items()}
        try:
            cache_dir = state_dirs.ensure_private_dir(state_dirs.default_root() / "cache", what="cache directory")
        except SglWorkerError:
            cache_dir = None
        env: dict[str, str] = {}
        for spec, _ in subjects.values():
            env.update(spec.env)
        result = check_with_sglang(python, list(argvs.values()), cache_dir=cache_dir, env=env)
        if not result.available:
            self.flag_check = f"not checked: {result.reason}"
            return {}
        self.flag_check = f"checked by sglang {result.version}'s own parser"
        problems = {}
        for name, argv in argvs.items():
            check = result.results.get(tuple(argv))
            if check is not None and not check.ok:
                problems[name] = (f"{name}: sglang {result.version} rejects its worker args:\n  {check.message}\n"
                                  f"  argv: {' '.join(argv)}\n  fix: correct the flag (see "
                                  "'python -m sglang.launch_server --help' of the engine you run)")
        return problems

    def close(self) -> None:
        try:
            for router in list(self.routers.values()):  # scopes an interrupt did not let end
                with contextlib.suppress(Exception):
                    router.close()
            self.routers.clear()
            if self._follower is not None:
                self._follower.stop()  # no launch ahead starts while the source closes
            if self._source is not None:
                interrupted = self.interrupted_by is not None or self.exitstatus == int(pytest.ExitCode.INTERRUPTED)
                if interrupted and hasattr(self._source, "keep_warm_ok"):
                    self._source.keep_warm_ok = False  # an interrupt means stop: nothing is kept warm
                self._source.close()
        finally:
            if self._watchdog is not None:
                from ..resources.processes import sweep_session

                swept = sweep_session()
                if swept:
                    self.terminal.message(f"killed {len(swept)} worker process(es) left after teardown: {swept}")
                self._watchdog.close()
                self._watchdog = None
            if self._session_dir is not None:
                with contextlib.suppress(Exception):  # the logs stay; only their mark is missing
                    self._mark_kept_logs()
                self._session_dir.release()
                self._session_dir = None

    # -- signals: a CI cancel (SIGTERM, SIGHUP) is an orderly interrupt ------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGHUP become a KeyboardInterrupt in the main thread: pytest then tears the workers
        down, the report is written (marked interrupted) and the summary printed; the exit code is
        128 + the signal, as for a process the signal ended. Only where nobody installed a handler."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is signal.SIG_DFL:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """Python's own Ctrl-C (a KeyboardInterrupt), noted: when xdist loses that KeyboardInterrupt (a worker
        spawned a moment before died of the same Ctrl-C, and execnet fails reading from it), the internal error
        that follows is the interrupt it was (:meth:`_as_interrupt`)."""
        self.sigint_seen = True
        raise KeyboardInterrupt

    def _as_interrupt(self, session: pytest.Session) -> bool:
        """Turn an internal error that follows a Ctrl-C into the interrupted run it was; whether it did."""
        if self.sigint_seen and int(session.exitstatus) == int(pytest.ExitCode.INTERNAL_ERROR):
            session.exitstatus = pytest.ExitCode.INTERRUPTED
            return True
        return False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted_by is None:
            self.interrupted_by = signum
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

    def restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)
        self._previous_handlers.clear()

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter renders the traceback
    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """An interrupt lands wherever the main thread is. Where that is an instruction with no source line
        (CPython has many: in ``re``'s parser, which the plugin's session start runs a lot of, or in the cleanup
        of a ``with`` statement), the traceback's entry has no line number and pytest's terminal reporter fails on
        it (``TypeError: unsupported operand type(s) for -: 'NoneType' and 'int'``). That error escaped pytest: a
        Ctrl-C while xdist started its workers ended the run with exit status 1 and no run report. Such entries
        have no source to show; they are left out of the traceback pytest renders."""
        if not all(_has_line(entry) for entry in excinfo.traceback):
            excinfo.traceback = excinfo.traceback.filter(_has_line)

    def launch_ahead(self, item: pytest.Item, nextitem: pytest.Item | None = None) -> None:
        """Start the workers of the next configurations the queue needs after ``item`` (``--sgl-launch-ahead``:
        how many beyond the current test's) on free GPUs, so that they are ready when their first test begins.
        Considered when a test's own launch has its lease, when its workers are in place, and after its
        teardown, where ``nextitem`` is the current test: its configuration is wanted first, then as many
        beyond it. Configurations already pooled or launching count without a new launch. An xdist worker
        knows its queue only one test ahead."""
        count = self.settings.launch_ahead
        source = self._source
        if count <= 0 or source is None or not self.settings.reuse:
            return

        if nextitem is None:
            current, queue = item.stash.get(CONFIG_KEY, None), self._upcoming(item)
        else:
            current, queue, count = None, [nextitem, *self._upcoming(nextitem)], count + 1
        wanted: list[WorkerConfig] = []
        for upcoming in queue:
            config = upcoming.stash.get(CONFIG_KEY, None)
            if config is None or config == current or config in wanted or not launchable(upcoming):
                continue
            wanted.append(config)
            if len(wanted) >= count:
                break
        if is_xdist_worker(self.config):  # the controller may have said which configurations come next here
            wanted += [c for c in self._hinted_configs(item, source) if c != current and c not in wanted]
        self._start_ahead(source, wanted)
        if is_xdist_worker(self.config):
            self._hand_follower(item, source)

    def _hand_follower(self, item: pytest.Item, source: WorkerSource) -> None:
        """On an xdist worker whose controller writes launch hints: the follower thread gets what it launches from,
        worked out here (again when the environment changed); it starts with the first, before any hint came."""
        from .hint_follower import hand_follower
        from .launch_hints import hint_place

        place = hint_place(self.config)
        if place is None or self._source is None:
            return
        basis = (self.worker_environ(), self.env_hooked())
        if basis != self._kits_from:
            self._follower = hand_follower(self._follower, place, self._config_map(item), source, basis,
                                           f"launch ahead for {self.config.rootpath.name} (pid {os.getpid()})",
                                           self.terminal.note)
            # remembered once a follower exists: a pool is made at the first launch (a first test may be attached)
            if self._follower is not None:
                self._kits_from = basis

    def _start_ahead(self, source: WorkerSource, wanted: list[WorkerConfig]) -> None:
        """Launch ``wanted`` ahead, in order, with this process's environment read now (the main thread's)."""
        environ = self.worker_environ() if wanted else {}
        for config in wanted:
            try:
                source.launch_ahead(config, holder=f"launch ahead for {self.config.rootpath.name} (pid {os.getpid()})",
                                    environ=environ, wait_retiring=self._follower is None)  # else it starts it
            except Exception as exc:  # launching ahead is an optimisation: it never fails a test
                self.terminal.note(f"launch ahead of {config.label} failed to start: {exc!r}")

    def finished_configs(self) -> frozenset[str]:
        """On an xdist worker: the configurations the controller says no later test of this worker takes."""
        from .launch_hints import read_launch_hint

        return read_launch_hint(self.config)[1]

    def follow_controller(self, waiting: WorkerConfig) -> None:
        """On an xdist worker, while its pool's main thread waits for ``waiting``'s launch (called about every 0.1 s):
        the configurations the controller has told it since to launch ahead start now, not after this test (issue
        43: a word written while a worker started waited for that whole startup, on GPUs that stood idle)."""
        source = self._source
        if source is None or self._configs_by_key is None or not self.settings.reuse:
            return  # the map of configurations is made at the first test's own launch (:meth:`_hinted_configs`)
        from .launch_hints import read_launch_hint

        keys = read_launch_hint(self.config)[0]
        if keys == self._followed[0] and time.monotonic() - self._followed[1] < FOLLOW_RETRY_S:
            return  # tried a moment ago
        self._followed = (keys, time.monotonic())
        wanted = [self._configs_by_key[k] for k in keys if k in self._configs_by_key and k != waiting.key]
        self._start_ahead(source, wanted)

    def let_go_dropped(self) -> None:
        """On an xdist worker, before a test's setup (and, by the pool, while it waits for a launch): the idle
        workers of the configurations the controller says no later test takes are stopped, so that their GPUs
        serve a launch ahead elsewhere while this test waits for its own workers."""
        if self._source is None or not is_xdist_worker(self.config) or not self.settings.reuse:
            return
        self._follow_controller(self._source)

    def _follow_controller(self, source: WorkerSource) -> tuple[str, ...]:
        """The xdist controller's word: the idle workers of the configurations whose tests have all run are
        stopped; the configurations to launch ahead are returned, in order."""
        from .launch_hints import read_launch_hint

        keys, drop = read_launch_hint(self.config)
        if drop:
            source.retire_idle(drop)
        source.hand_over_ahead()  # those launched ahead here whose tests went to another xdist worker
        return keys

    def _hinted_configs(self, item: pytest.Item, source: WorkerSource) -> list[WorkerConfig]:
        """The configurations the xdist controller told this worker to launch ahead (its own tests'), in order;
        the idle workers of those whose tests are all handed out are let go first."""
        keys = self._follow_controller(source)
        if not keys:
            return []
        self._configs_by_key = self._config_map(item)
        return [self._configs_by_key[key] for key in keys if key in self._configs_by_key]

    def _config_map(self, item: pytest.Item) -> dict[str, WorkerConfig]:
        """This session's pooled configurations by key (made once, from the collected tests)."""
        if self._configs_by_key is None:
            self._configs_by_key = {}
            for collected in item.session.items:
                config = collected.stash.get(CONFIG_KEY, None)
                if config is not None and launchable(collected):
                    self._configs_by_key.setdefault(config.key, config)
        return self._configs_by_key

    def _upcoming(self, item: pytest.Item) -> list[pytest.Item]:
        if self.queue and not is_xdist_worker(self.config):
            at = self.queue_index.get(item.nodeid)
            if at is not None:
                return self.queue[at + 1:]
        nextitem = item.stash.get(NEXT_KEY, None)
        return [nextitem] if nextitem is not None else []

    def shard_costs(self) -> tuple[Any, list[str]]:
        """The costs of --sgl-shard-report (None: balance by test count) and notes for the header, read once; a
        file that is no run report is a usage error naming it."""
        if self._shard_costs is None:
            from .sharding import load_costs

            try:
                self._shard_costs = load_costs(self.settings.shard_report)
            except ValueError as exc:
                raise pytest.UsageError(f"{self.settings.sources.get('shard-report')}: {exc}") from None
        return self._shard_costs

    # ======================================================================================================
    # hooks
    # ======================================================================================================

    def pytest_plugin_registered(self, plugin: object, manager: pytest.PytestPluginManager) -> None:
        # Conftests of sub-directories are loaded during collection: register their specs when they arrive.
        if plugin is not self:
            self.register_from(plugin)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self not in _ACTIVE:
            _ACTIVE.append(self)
            for callback in list(_ON_START):
                callback(self)
        problems = self.spec_problems()
        if problems:
            raise pytest.UsageError("\n".join(problems.values()))
        selected = self.selected_specs()
        names = {spec.name for spec in selected}
        unselected = [name for name in self.settings.worker_urls if name not in names]
        if unselected:
            raise pytest.UsageError(
                f"{self.settings.sources.get('worker-url')}: model spec(s) {', '.join(map(repr, unselected))} are "
                f"attached but not selected by {self.settings.sources.get('model')} ({', '.join(sorted(names))}); "
                "add them to the selection, or drop --sgl-model to run exactly the attached specs")
        if self.settings.shard is not None:
            self.shard_costs()  # a bad report file stops the session here, before any worker starts
        if selected and not is_xdist_worker(session.config):
            # Before any GPU time is spent; a run that selects no model launches nothing and checks nothing.
            # Every registered spec, like the budget check: one batch, cached per sglang install.
            rejected = self.check_flags({f"model spec {spec.name!r}": (spec, ()) for spec in self.registry})
            if rejected:
                raise pytest.UsageError("\n".join(rejected.values()))

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "sgl_model" not in metafunc.fixturenames:
            return
        specs = self.selected_specs()
        if not specs:
            metafunc.parametrize("sgl_model", [pytest.param(None, marks=pytest.mark.skip(
                reason="no sglang model selected: run with --sgl-model NAME (see --sgl-list-models)"))],
                ids=["no-model"])
            return
        try:
            required = required_features(metafunc.definition)
        except MarkerError:  # reported on each test by pytest_collection_modifyitems, not hidden by a skip
            required = set()
        params = []
        for spec in specs:
            missing = sorted(required - spec.features)
            marks = [pytest.mark.skip(reason=f"model {spec.name} lacks feature(s) {', '.join(missing)} "
                                             "required by @pytest.mark.sgl_requires")] if missing else []
            params.append(pytest.param(spec, id=spec.name, marks=marks))
        metafunc.parametrize("sgl_model", params)

    def pytest_report_collectionfinish(self, config: pytest.Config) -> str | None:
        return self.shard_note

    @pytest.hookimpl(trylast=True)  # after the runner's, which tears down the fixtures of an interrupted test
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from ..resources.signals import signals_deferred

        if self._as_interrupt(session):
            exitstatus = int(pytest.ExitCode.INTERRUPTED)
        self.exitstatus = int(exitstatus)
        # The session's end runs whole: an interrupt that lands while the workers are torn down or handed to their
        # keepers is noted (no group more is kept warm) and ends the run as interrupted, with its report and summary,
        # instead of leaving a traceback, a group half handed over and no report.
        with signals_deferred(reraise=False, on_signal=self._late_signal):
            self.close()
        self.restore_signal_handlers()
        if self.interrupted_by is not None:
            session.exitstatus = 128 + self.interrupted_by
        elif self.late_interrupt:
            session.exitstatus = pytest.ExitCode.INTERRUPTED
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None and self._source is not None:
            workeroutput["sglworker_stats"] = self.records.stats_dicts()
            workeroutput["sglworker_launches"] = self.records.launch_dicts()
            workeroutput["sglworker_warm"] = self.warm_events()
        if not is_xdist_worker(session.config):
            with signals_deferred(reraise=False, on_signal=self._late_signal):
                self.write_artifacts(int(session.exitstatus))
            if self.interrupted_by is not None:
                session.exitstatus = 128 + self.interrupted_by

    def _late_signal(self, signum: int) -> None:
        """A signal during the session's end: nothing more is kept warm, and the run ends as interrupted (Ctrl-C:
        pytest's exit status 2; SIGTERM, SIGHUP: 128 + the signal)."""
        if self._source is not None and hasattr(self._source, "keep_warm_ok"):
            self._source.keep_warm_ok = False
        if signum == signal.SIGINT:
            self.late_interrupt = True
        elif self.interrupted_by is None:
            self.interrupted_by = signum

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        # An interrupt that lands while pytest starts its session (xdist starting its workers, say) makes pytest
        # skip pytest_sessionfinish: the session's end (exit status of the signal, the report marked interrupted)
        # is done here instead. pytest registers its Session as the plugin "session".
        found = config.pluginmanager.get_plugin("session") if self.exitstatus is None else None
        session = found if isinstance(found, pytest.Session) else None
        if session is not None:
            self._as_interrupt(session)
        interrupted = session is not None and (self.interrupted_by is not None
                                               or int(session.exitstatus) == int(pytest.ExitCode.INTERRUPTED))
        if session is not None and interrupted:
            self.exitstatus = int(session.exitstatus)
        self.close()
        self.restore_signal_handlers()
        if session is not None and interrupted:
            if self.interrupted_by is not None:
                session.exitstatus = 128 + self.interrupted_by
            if not is_xdist_worker(config):
                self.write_artifacts(int(session.exitstatus))
        set_active_registry(None)

    # -- the run report -----------------------------------------------------------------------------------
    def collected_stats(self) -> dict[str, Any]:
        """Every process's figures, merged; where pytest's outcomes of the tests are known (this process saw their
        reports), each configuration's failed tests are counted from them: a setup error (a failed start), a
        failing call and a teardown error (a worker that died during the test) each make a failed test."""
        from .run_report import merge_stats, test_outcome

        stats = merge_stats([*self.worker_stats, self.records.stats_dicts()])
        if self.test_times:  # [seconds, configuration key, categories] per test (RunHooks.pytest_runtest_logreport)
            failed = [key for _, key, categories in self.test_times.values()
                      if test_outcome(categories) in ("failed", "error")]
            for key, figures in stats.items():
                figures.failed_tests = failed.count(key)
        return stats

    def warm_events(self) -> dict[str, list[dict[str, Any]]]:
        """What happened to warm groups in this process (adopted, kept warm, refused)."""
        events = getattr(self._source, "warm_events", None)
        return events() if callable(events) else {}

    def collected_warm(self) -> dict[str, list[dict[str, Any]]]:
        """This process's warm events and the xdist workers', merged: the report's ``warm``."""
        merged: dict[str, list[dict[str, Any]]] = {"adopted": [], "kept": [], "refused": []}
        for events in [*self.worker_warm, self.warm_events()]:
            for kind, items in events.items():
                merged.setdefault(kind, []).extend(items)
        return merged

    def collected_launches(self) -> list[dict[str, Any]]:
        from .run_report import merge_launches

        return merge_launches([*self.worker_launches, self.records.launch_dicts()])

    def run_report(self, exitstatus: int) -> dict[str, Any]:
        """The run report as one dict (the ``--sgl-report`` JSON; the timeline and the trace are drawn from it):
        the test spans of the launches and the test counts carry pytest's own outcomes."""
        from .run_report import SCHEMA, apply_test_outcomes, outcome_counts, test_outcome

        outcomes = {nodeid: test_outcome(categories) for nodeid, (_, _, categories) in self.test_times.items()}
        launches = self.collected_launches()
        apply_test_outcomes(launches, {n: o for n, o in outcomes.items() if o is not None})
        return {"schema": SCHEMA, "engine": self.settings.engine, "models": list(self.settings.models),
                "exitstatus": exitstatus,
                "interrupted": exitstatus == int(pytest.ExitCode.INTERRUPTED) or self.interrupted_by is not None
                or self.late_interrupt,
                "started_at": round(self.started_at, 3), "finished_at": round(time.time(), 3),
                "workers": {k: v.as_dict() for k, v in sorted(self.collected_stats().items())},
                "launches": launches,
                "outcomes": outcome_counts([categories for _, _, categories in self.test_times.values()]),
                "warm": {"keep_warm_seconds": self.settings.keep_warm, **self.collected_warm()},
                "tests": {nodeid: {"seconds": round(seconds, 3), "config": key, "outcome": outcomes[nodeid]}
                          for nodeid, (seconds, key, _) in self.test_times.items()}}

    def write_artifacts(self, exitstatus: int) -> None:
        """``--sgl-report``, ``--sgl-timeline`` and ``--sgl-trace``, each written atomically; a failure to
        write one is an error line, never a traceback that would hide pytest's own summary."""
        from .run_report import write_artifact

        s = self.settings
        wanted = {name: path for name, path in (("report", s.report), ("timeline", s.timeline), ("trace", s.trace))
                  if path is not None}
        if not wanted:
            return
        report = self.run_report(exitstatus)
        for name, path in wanted.items():
            try:
                write_artifact(name, path, report)
            except (OSError, ValueError) as exc:
                detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                self.terminal.message(f"ERROR: cannot write the run {name} to {path} "
                                      f"({s.sources.get(name, '--sgl-' + name)}): {detail}", always=True)
            else:
                self.terminal.message(f"run {name} written to {path}", always=True)
