"""The pytest face of pytest-sglworker: options, markers, fixtures, collection checks, reports.

This is the only module that knows pytest (with ``hookspecs.py``). It is loaded into every pytest run of an
environment that installs the package, so it imports nothing heavy at module level: httpx, psutil,
pynvml, filelock and sglang are imported when a worker is first needed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from . import budget
from .errors import SglWorkerError, SpecError
from .specs import ModelSpec, SpecRegistry, set_active_registry

if TYPE_CHECKING:
    from .launcher import ModelInstance
    from .pool import WorkerConfig, WorkerPool

# --------------------------------------------------------------------------------------------------------
# Options: every option is --sgl-*, with an ini twin and an SGLWORKER_* environment variable.
# Precedence: command line > environment > ini > default.
# --------------------------------------------------------------------------------------------------------

MODEL_DESC = "model spec(s) to run worker tests against; repeatable or comma-separated (see --sgl-list-models)"
ENGINE_DESC = "'real' (python -m sglang.launch_server, default) or 'sim' (the simulated engine, CPU only)"
LAUNCHER_DESC = "command that starts the engine, shlex-split (default: '<python> -m sglang.launch_server')"
LOG_DIR_DESC = "directory for sglang-worker-<port>.log files (default: <tmp>/pytest-sglworker-<uid>/logs)"
LOCK_DIR_DESC = "directory for GPU and port lock files shared by every pytest process of the machine"
STARTUP_TIMEOUT_DESC = "seconds a worker may take to become healthy (default 600)"
LEASE_TIMEOUT_DESC = "seconds to wait for a free GPU lease before failing (default 1800)"
GPUS_DESC = "GPUs to use: NVML indices '0,2', UUIDs, or a declared inventory 'sim:N' / 'sim:NxGiB' (e.g. sim:4x80)"
PORT_RANGE_DESC = "port range for worker port blocks, 'LOW-HIGH' (default: below the ephemeral range)"
KEEP_LOGS_DESC = "keep the logs of workers whose tests passed too (default: only failed runs' logs are kept)"
REUSE_DESC = "reuse a running worker across tests of the same configuration: 'on' (default) or 'off'"
REORDER_DESC = "reorder tests so that tests of one worker configuration run together: 'on' (default) or 'off'"
REPORT_DESC = "write the run report (launches, reuses, startup times, failures) as JSON to this path"
TAIL_DESC = "log lines shown in failure reports (default 40)"
CARD_DESC = "GPU card for the memory ledger of --sgl-list-models, e.g. H100-80G, H200, A100-40G, L4"


@dataclass(frozen=True)
class _Opt:
    name: str  # --sgl-<name>
    env: str
    ini: str
    help: str
    default: Any
    parse: Callable[[str], Any] | None = None


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if not number > 0:
        raise ValueError(f"{value!r} must be greater than 0")
    return number


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an integer") from None
    if number < 0:
        raise ValueError(f"{value!r} must be 0 or more")
    return number


def _on_off(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"on", "1", "true", "yes"}:
        return True
    if lowered in {"off", "0", "false", "no"}:
        return False
    raise ValueError(f"{value!r} is not 'on' or 'off'")


def _engine(value: str) -> str:
    if value not in {"real", "sim"}:
        raise ValueError(f"{value!r} is not an engine; choose 'real' or 'sim'")
    return value


def _launcher(value: str) -> tuple[str, ...]:
    from .launcher import parse_launcher

    return tuple(parse_launcher(value))


def _port_range(value: str) -> tuple[int, int]:
    from .ports import parse_port_range

    low, high = parse_port_range(value)
    if high - low + 1 < _PORT_BLOCK:  # one worker reserves a block of 4 ports (HTTP, NCCL, 2 spare)
        raise ValueError(f"{value!r} holds {high - low + 1} port(s), less than one worker's block of {_PORT_BLOCK}")
    return low, high


_PORT_BLOCK = 4


def _path(value: str) -> Path:
    if not value.strip():
        raise ValueError("the path is empty")
    return Path(value)


def _report_path(value: str) -> Path:
    path = _path(value)
    if path.is_dir():
        raise ValueError(f"{value!r} is a directory; give a file path, e.g. {path / 'sglworker-report.json'}")
    return path


def _card(value: str) -> str:
    from .ledger import gpu_card_mib

    gpu_card_mib(value)
    return value


def _gpus(value: str) -> str:
    from .gpus import parse_gpus_option

    parse_gpus_option(value)
    return value


OPTIONS: tuple[_Opt, ...] = (
    _Opt("engine", "SGLWORKER_ENGINE", "sgl_engine", ENGINE_DESC, "real", _engine),
    _Opt("launcher", "SGLWORKER_LAUNCHER", "sgl_launcher", LAUNCHER_DESC, None, _launcher),
    _Opt("log-dir", "SGLWORKER_LOG_DIR", "sgl_log_dir", LOG_DIR_DESC, None, _path),
    _Opt("lock-dir", "SGLWORKER_LOCK_DIR", "sgl_lock_dir", LOCK_DIR_DESC, None, _path),
    _Opt("startup-timeout", "SGLWORKER_STARTUP_TIMEOUT", "sgl_startup_timeout", STARTUP_TIMEOUT_DESC, 600.0,
         _positive_float),
    _Opt("lease-timeout", "SGLWORKER_LEASE_TIMEOUT", "sgl_lease_timeout", LEASE_TIMEOUT_DESC, 1800.0,
         _positive_float),
    _Opt("gpus", "SGLWORKER_GPUS", "sgl_gpus", GPUS_DESC, None, _gpus),
    _Opt("port-range", "SGLWORKER_PORT_RANGE", "sgl_port_range", PORT_RANGE_DESC, None, _port_range),
    _Opt("keep-logs", "SGLWORKER_KEEP_LOGS", "sgl_keep_logs", KEEP_LOGS_DESC, False, _on_off),
    _Opt("reuse", "SGLWORKER_REUSE", "sgl_reuse", REUSE_DESC, True, _on_off),
    _Opt("reorder", "SGLWORKER_REORDER", "sgl_reorder", REORDER_DESC, True, _on_off),
    _Opt("report", "SGLWORKER_REPORT", "sgl_report", REPORT_DESC, None, _report_path),
    _Opt("tail-lines", "SGLWORKER_TAIL_LINES", "sgl_tail_lines", TAIL_DESC, 40, _positive_int),
    _Opt("card", "SGLWORKER_CARD", "sgl_card", CARD_DESC, None, _card),
)


def _dest(name: str) -> str:
    return "sgl_" + name.replace("-", "_")


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sglworker", "sglang workers (pytest-sglworker)")
    group.addoption("--sgl-model", dest="sgl_model", action="append", default=None, metavar="NAME",
                    help=MODEL_DESC + " [env SGLWORKER_MODELS, ini sgl_models]")
    parser.addini("sgl_models", MODEL_DESC, default="")
    group.addoption("--sgl-list-models", dest="sgl_list_models", action="store_true", default=False,
                    help="print the model registry (model, memory, tp, features, budget, memory ledger) and exit")
    for opt in OPTIONS:
        flag = f"--sgl-{opt.name}"
        if opt.default is False and opt.parse is _on_off:
            group.addoption(flag, dest=_dest(opt.name), action="store_const", const="on", default=None,
                            help=f"{opt.help} [env {opt.env}, ini {opt.ini}]")
        else:
            group.addoption(flag, dest=_dest(opt.name), default=None, metavar="VALUE",
                            help=f"{opt.help} [env {opt.env}, ini {opt.ini}]")
        parser.addini(opt.ini, opt.help, default="")


@dataclass(frozen=True)
class Settings:
    """The resolved options of the session."""

    models: tuple[str, ...] = ()
    engine: str = "real"
    launcher: tuple[str, ...] | None = None
    log_dir: Path | None = None
    lock_dir: Path | None = None
    startup_timeout: float = 600.0
    lease_timeout: float = 1800.0
    gpus: str | None = None
    port_range: tuple[int, int] | None = None
    keep_logs: bool = False
    reuse: bool = True
    reorder: bool = True
    report: Path | None = None
    tail_lines: int = 40
    card: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def gpus_explicit(self) -> bool:
        return self.sources.get("gpus", "default") != "default"


def _raw(config: pytest.Config, name: str, env: str, ini: str) -> tuple[str | None, str]:
    cli = config.getoption(_dest(name))
    if cli is not None:
        return str(cli), f"--sgl-{name}"
    if os.environ.get(env, "") != "":
        return os.environ[env], env
    value = config.getini(ini)
    if value not in ("", None, []):
        return str(value), f"ini {ini}"
    return None, "default"


def resolve_settings(config: pytest.Config) -> Settings:
    """Resolve every option (command line > env > ini > default); a bad value is a usage error naming it."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        raw, source = _raw(config, opt.name, opt.env, opt.ini)
        sources[opt.name] = source
        if raw is None:
            values[_dest(opt.name)[4:]] = opt.default
            continue
        try:
            values[_dest(opt.name)[4:]] = opt.parse(raw) if opt.parse else raw
        except (ValueError, SglWorkerError) as exc:
            raise pytest.UsageError(f"{source}: invalid value {raw!r}: {exc}") from None
    models: list[str] = []
    cli_models = config.getoption("sgl_model")
    if cli_models:
        raw_models, sources["model"] = list(cli_models), "--sgl-model"
    elif os.environ.get("SGLWORKER_MODELS"):
        raw_models, sources["model"] = [os.environ["SGLWORKER_MODELS"]], "SGLWORKER_MODELS"
    else:
        raw_models, sources["model"] = [str(config.getini("sgl_models") or "")], "ini sgl_models"
    for chunk in raw_models:
        for name in chunk.replace("\n", ",").split(","):
            name = name.strip()
            if name and name not in models:
                models.append(name)
    if values["engine"] == "sim" and values["gpus"] is None:
        values["gpus"] = "sim:8x80"
    return Settings(models=tuple(models), sources=sources, **values)


# --------------------------------------------------------------------------------------------------------
# Markers
# --------------------------------------------------------------------------------------------------------

WORKER_MARKER_DOC = (
    "sgl_worker(args=(), env=None, fresh=False, startup_timeout=None, allow_foreign_host=None): "
    "extra sglang args and env for this test's sgl_worker; fresh=True for an unshared worker"
)
REQUIRES_MARKER_DOC = "sgl_requires(*features): skip models whose spec lacks one of these features"
OPT_OUT_MARKER_DOC = (
    "sgl_budget_opt_out(reason): allow this test's extra args to raise --mem-fraction-static or re-enable "
    "the prefill CUDA graph; the reason is required and shown in the report"
)


@dataclass(frozen=True)
class WorkerMarker:
    """``@pytest.mark.sgl_worker(...)`` as a typed object."""

    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    fresh: bool = False
    startup_timeout: float | None = None
    allow_foreign_host: str | None = None

    @classmethod
    def from_mark(cls, mark: pytest.Mark | None) -> WorkerMarker:
        if mark is None:
            return cls()
        if mark.args:
            raise ValueError("sgl_worker takes keyword arguments only, e.g. @pytest.mark.sgl_worker(args=[...])")
        known = {"args", "env", "fresh", "startup_timeout", "allow_foreign_host"}
        unknown = sorted(set(mark.kwargs) - known)
        if unknown:
            raise ValueError(
                f"sgl_worker got unknown argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        args = mark.kwargs.get("args") or ()
        if isinstance(args, str):
            raise ValueError(f"sgl_worker(args=...) must be a list of arguments, not the string {args!r}")
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"sgl_worker(args=...) must be a list of arguments, got {args!r}")
        if not all(isinstance(a, str) for a in args):
            raise ValueError(f"sgl_worker(args=...) must contain strings only, got {list(args)!r}")
        env = mark.kwargs.get("env") or {}
        if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("sgl_worker(env=...) must be a dict of strings to strings")
        fresh = mark.kwargs.get("fresh", False)
        if not isinstance(fresh, bool):
            raise ValueError(f"sgl_worker(fresh=...) must be True or False, got {fresh!r}")
        timeout = mark.kwargs.get("startup_timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < float("inf")):  # NaN too: it would never time out
            raise ValueError(f"sgl_worker(startup_timeout=...) must be a positive number of seconds, got {timeout!r}")
        foreign = mark.kwargs.get("allow_foreign_host")
        if foreign is not None and (not isinstance(foreign, str) or not foreign.strip()):
            raise ValueError("sgl_worker(allow_foreign_host=...) must be a non-empty reason string")
        return cls(tuple(args), dict(env), fresh, None if timeout is None else float(timeout), foreign)


def _marker_violation(item: pytest.Item, marker: WorkerMarker, found: Sequence[budget.BudgetProblem]) -> str:
    return budget.describe_violation(
        f"test {item.nodeid}: @pytest.mark.sgl_worker(args={list(marker.args)!r})", found,
        fix="drop the args that loosen the budget, or add "
            "@pytest.mark.sgl_budget_opt_out(reason='why this test needs it')")


def _opt_out_reason(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("sgl_budget_opt_out")
    if mark is None:
        return None
    unknown = sorted(set(mark.kwargs) - {"reason"})
    if unknown or len(mark.args) > 1 or (mark.args and "reason" in mark.kwargs):
        raise ValueError(f"sgl_budget_opt_out takes one reason only, got args {mark.args!r} and kwargs "
                         f"{mark.kwargs!r}: @pytest.mark.sgl_budget_opt_out(reason='why')")
    reason = mark.kwargs.get("reason", mark.args[0] if mark.args else None)
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("sgl_budget_opt_out needs a reason: @pytest.mark.sgl_budget_opt_out(reason='why')")
    return reason


# --------------------------------------------------------------------------------------------------------
# Session state, kept in typed stash keys
# --------------------------------------------------------------------------------------------------------


class SessionState:
    """Everything the plugin holds for one session."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.registry = SpecRegistry.with_builtins()
        self.registered_from: set[int] = set()
        self._pool: WorkerPool | None = None
        self._watchdog: Any = None
        self._leases: Any = None
        self.flag_check: str = "not needed (no worker test collected)"
        self.messages: list[str] = []
        self.worker_stats: list[dict[str, Any]] = []  # from xdist workers
        #: node ids of the last test of each worker configuration: its worker is retired after it, not pooled
        self.last_users: set[str] = set()

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

    def check_specs(self) -> None:
        problems = self.spec_problems()
        if problems:
            raise pytest.UsageError("\n".join(problems.values()))

    def selected_specs(self) -> list[ModelSpec]:
        unknown = [m for m in self.settings.models if m not in self.registry]
        if unknown:
            raise pytest.UsageError(
                f"{self.settings.sources.get('model', '--sgl-model')}: "
                f"unknown model(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(self.registry.names())} (register more with pytest_sglworker_register_specs)"
            )
        return [self.registry.get(m) for m in self.settings.models]

    # -- workers ------------------------------------------------------------------------------------------
    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    def _make_pool(self) -> WorkerPool:
        from .launcher import LaunchOptions
        from .pool import WorkerPool
        from .reaper import Watchdog, reap_dead_sessions

        s = self.settings
        leases = self.lease_manager()
        reaped = reap_dead_sessions(s.log_dir or _default_log_dir(), lock_dir=leases.lock_dir)
        if reaped:
            self.message(f"cleaned up after earlier sessions: {reaped}")
        self._watchdog = Watchdog(lock_dir=leases.lock_dir)
        options = LaunchOptions(
            launcher=self.launcher(), log_dir=s.log_dir, lock_dir=s.lock_dir, startup_timeout=s.startup_timeout,
            port_range=s.port_range, tail_lines=s.tail_lines,
        )
        return WorkerPool(
            options, leases=leases, lease_timeout=s.lease_timeout, reuse=s.reuse,
            keep_logs=s.keep_logs, on_progress=self.progress, on_message=self.message,
            worker_env=self._worker_env,
        )

    def _worker_env(self, spec: ModelSpec, lease_env: dict[str, str]) -> dict[str, str]:
        result = self.config.hook.pytest_sglworker_worker_env(spec=spec, lease_env=dict(lease_env))
        return dict(lease_env) if result is None else dict(result)

    def lease_manager(self) -> Any:
        """The session's GPU lease manager (one inventory, one lock directory). Raises InventoryUnavailable
        when the inventory cannot be read, ValueError when --sgl-gpus names GPUs that are not visible, and
        UnsafeDirectory for a lock directory that cannot be used."""
        if self._leases is None:
            from . import state
            from .gpus import LeaseManager, load_inventory, parse_gpus_option

            selection = parse_gpus_option(self.settings.gpus or "")
            inventory = load_inventory(selection, os.environ)
            lock_dir = state.ensure_private_dir(self.settings.lock_dir or state.default_lock_dir(),
                                                what="lock directory", shared_ok=self.settings.lock_dir is not None)
            self._leases = LeaseManager(lock_dir, inventory, namespace=selection.namespace)
        return self._leases

    # -- sglang's own parser ------------------------------------------------------------------------------
    def launcher(self) -> tuple[str, ...]:
        from .launcher import default_launcher, sim_launcher

        s = self.settings
        return s.launcher or tuple(sim_launcher() if s.engine == "sim" else default_launcher())

    def check_flags(self, subjects: Mapping[str, tuple[ModelSpec, tuple[str, ...]]]) -> dict[str, str]:
        """Parse each subject's worker argv with sglang's own parser (in the engine's interpreter, cached).
        Returns ``{subject: message}`` for the argvs sglang rejects (a misspelt flag, an invalid choice)."""
        if not subjects:
            return {}
        import importlib.util

        from . import state as state_dirs
        from .engine_args import check_with_sglang, find_sglang_python
        from .launcher import build_argv
        python = find_sglang_python(self.launcher())
        if python is None and self.settings.engine == "sim":
            python = sys.executable  # the sim engine: check with sglang if this environment has it
        if python is None:
            self.flag_check = f"not checked: cannot tell which python runs the launcher {' '.join(self.launcher())!r}"
            return {}
        if python == sys.executable and importlib.util.find_spec("sglang") is None:
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
        if self._pool is not None:
            self._pool.close()
        if self._watchdog is not None:
            from .processes import sweep_session

            swept = sweep_session()
            if swept:
                self.message(f"killed {len(swept)} worker process(es) left after teardown: {swept}")
            self._watchdog.close()
            self._watchdog = None
        if self._leases is not None:
            self._leases.inventory.close()  # NVML shutdown; a declared inventory has nothing to free

    # -- output -------------------------------------------------------------------------------------------
    def message(self, text: str) -> None:
        self.messages.append(text)
        _terminal_line(self.config, f"[sglworker] {text}")

    def progress(self, instance: ModelInstance, elapsed: float) -> None:
        try:
            _progress_line(self.config, instance, elapsed)
        except Exception as exc:  # a status line must never fail a launch
            self.messages.append(f"status line failed: {exc!r}")


STATE_KEY = pytest.StashKey[SessionState]()
WORKERS_KEY = pytest.StashKey[list["ModelInstance"]]()
ITEM_ERROR_KEY = pytest.StashKey[str]()
CONFIG_KEY = pytest.StashKey["WorkerConfig"]()
REPORTS_KEY = pytest.StashKey[dict[str, pytest.TestReport]]()


def _default_log_dir() -> Path:
    from .state import default_log_dir

    return default_log_dir()


def _plugin_name(plugin: object) -> str:
    return getattr(plugin, "__file__", None) or getattr(plugin, "__name__", None) or repr(plugin)


def _state(config: pytest.Config) -> SessionState:
    return config.stash[STATE_KEY]


# --------------------------------------------------------------------------------------------------------
# Terminal output (live status line, sparse lines off a terminal, quiet under -q)
# --------------------------------------------------------------------------------------------------------

_last_plain_line: dict[str, float] = {}
#: A worker that is healthy sooner than this shows no status line at all.
STATUS_AFTER_SECONDS = 2.0


def _uncaptured(config: pytest.Config) -> contextlib.AbstractContextManager[object]:
    """Write to the real terminal even while a test's output is captured (as live logging does)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    return capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()


def _terminal_line(config: pytest.Config, text: str) -> None:
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or config.get_verbosity() < 0:
        return
    with _uncaptured(config):
        tr.ensure_newline()
        tr.write_line(text)


def _progress_line(config: pytest.Config, instance: ModelInstance, elapsed: float) -> None:
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or config.get_verbosity() < 0 or elapsed < STATUS_AFTER_SECONDS:
        return
    from .diagnosis import startup_phase_from_file

    phase = startup_phase_from_file(instance.log_path) or "starting"
    text = f"[sglworker] waiting for {instance.describe()}: {phase}, {elapsed:.0f} s"
    with _uncaptured(config):
        if getattr(tr, "isatty", False):
            tr.write("\r" + text.ljust(tr._tw.fullwidth - 1)[: tr._tw.fullwidth - 1] if hasattr(tr, "_tw") else text)
        else:
            key = str(instance.port)
            if time.monotonic() - _last_plain_line.get(key, 0.0) >= 30.0:
                _last_plain_line[key] = time.monotonic()
                tr.ensure_newline()
                tr.write_line(text)


# --------------------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", WORKER_MARKER_DOC)
    config.addinivalue_line("markers", REQUIRES_MARKER_DOC)
    config.addinivalue_line("markers", OPT_OUT_MARKER_DOC)
    state = SessionState(config, resolve_settings(config))
    config.stash[STATE_KEY] = state
    state.register_all()
    set_active_registry(state.registry)
    if _xdist_present(config):
        config.pluginmanager.register(XdistHooks(), "sglworker-xdist")


def pytest_plugin_registered(plugin: object, manager: pytest.PytestPluginManager) -> None:
    # Conftests of sub-directories are loaded during collection: register their specs when they arrive.
    config = manager.get_plugin("pytestconfig")
    if isinstance(config, pytest.Config) and STATE_KEY in config.stash:
        config.stash[STATE_KEY].register_from(plugin)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE_KEY, None)
    if state is not None:
        state.close()
        set_active_registry(None)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    if not config.getoption("sgl_list_models"):
        return None
    settings = resolve_settings(config)
    state = SessionState(config, settings)
    state.register_all()
    print(render_registry(state.registry, settings))
    return 0


def _ledger_gpu(settings: Settings) -> tuple[str, int, int | None]:
    """The GPU the ledger of --sgl-list-models is computed for: a named card, a declared inventory, the
    first visible NVML GPU, or an H100 80 GB by default. Returns (label, total MiB, free MiB or None)."""
    from .ledger import gpu_card_mib

    if settings.card:
        return settings.card, gpu_card_mib(settings.card), None
    try:
        from .gpus import load_inventory, parse_gpus_option

        selection = parse_gpus_option(settings.gpus or "")
        if selection.kind == "sim":
            total = selection.sim_total_mib
            return f"declared {settings.gpus} ({total} MiB)", total, None
        inventory = load_inventory(selection, os.environ)
        try:
            gpus = inventory.snapshot()
        finally:
            inventory.close()
        if gpus:
            gpu = gpus[0]
            return f"GPU {gpu.index} {gpu.name} ({gpu.total_mib} MiB, {gpu.free_mib} free)", gpu.total_mib, gpu.free_mib
    except (SglWorkerError, ValueError):
        pass
    return "H100-80G (no GPU visible; choose another with --sgl-card)", gpu_card_mib("H100-80G"), None


def render_registry(registry: SpecRegistry, settings: Settings) -> str:
    from .ledger import ledger_for_spec

    label, total, free = _ledger_gpu(settings)
    lines = ["pytest-sglworker model registry:", f"memory ledger for: {label}"]
    for spec in registry:
        problems = budget.check_spec(spec)
        lines.append(f"  {spec.name}")
        lines.append(f"    model:       {spec.model} -> {spec.resolve_model_path()}")
        lines.append(f"    memory:      {spec.memory_gb:g} GB   tp: {spec.tp}")
        lines.append(f"    features:    {', '.join(sorted(spec.features)) or '-'}")
        lines.append(f"    worker_args: {' '.join(spec.worker_args)}")
        lines.append("    budget:      " + ("ok" if not problems else "VIOLATED: " + "; ".join(map(str, problems))))
        if spec.description:
            lines.append(f"    about:       {spec.description}")
        ledger = ledger_for_spec(spec, total, gpu_free_mib=free)
        if ledger is None:
            lines.append("    ledger:      unknown model dimensions (no local config.json)")
        else:
            lines.append("    ledger:      " + ledger.render().replace("\n", "\n                 "))
    return "\n".join(lines)


def pytest_sessionstart(session: pytest.Session) -> None:
    state = _state(session.config)
    state.check_specs()
    selected = state.selected_specs()
    if selected and getattr(session.config, "workerinput", None) is None:
        # Before any GPU time is spent; a run that selects no model launches nothing and checks nothing.
        # Every registered spec, like the budget check: one batch, cached per sglang install.
        problems = state.check_flags({f"model spec {spec.name!r}": (spec, ()) for spec in state.registry})
        if problems:
            raise pytest.UsageError("\n".join(problems.values()))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sgl_model" not in metafunc.fixturenames:
        return
    state = _state(metafunc.config)
    specs = state.selected_specs()
    if not specs:
        metafunc.parametrize("sgl_model", [pytest.param(None, marks=pytest.mark.skip(
            reason="no sglang model selected: run with --sgl-model NAME (see --sgl-list-models)"))], ids=["no-model"])
        return
    try:
        required = _required_features(metafunc.definition)
    except ValueError:  # reported on each test by pytest_collection_modifyitems, not hidden by a skip
        required = set()
    params = []
    for spec in specs:
        missing = sorted(required - spec.features)
        marks = [pytest.mark.skip(reason=f"model {spec.name} lacks feature(s) {', '.join(missing)} "
                                         "required by @pytest.mark.sgl_requires")] if missing else []
        params.append(pytest.param(spec, id=spec.name, marks=marks))
    metafunc.parametrize("sgl_model", params)


def _required_features(node: pytest.Item | Any) -> set[str]:
    features: set[str] = set()
    for mark in node.iter_markers("sgl_requires"):
        if mark.kwargs:
            raise ValueError(f"sgl_requires takes feature names only, got keyword(s) {', '.join(sorted(mark.kwargs))}: "
                             "@pytest.mark.sgl_requires('streaming', 'chat')")
        for feature in mark.args:
            names = feature if isinstance(feature, (list, tuple, set, frozenset)) else [feature]
            for name in names:
                if not isinstance(name, str) or not name.strip():
                    raise ValueError(f"sgl_requires takes feature names (non-empty strings), got {name!r}: "
                                     "@pytest.mark.sgl_requires('streaming', 'chat')")
                features.add(name)
    return features


def _item_spec(item: pytest.Item) -> ModelSpec | None:
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get("sgl_model") if callspec is not None else None
    return spec if isinstance(spec, ModelSpec) else None


def _is_xdist_worker(config: pytest.Config) -> bool:
    return getattr(config, "workerinput", None) is not None


@pytest.hookimpl(trylast=True)  # after -k/-m/--deselect: deselected tests are neither checked nor counted
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    # A usage error stops the session; an xdist worker cannot stop it cleanly (xdist would report an
    # INTERNALERROR), so there each offending test fails on its own with the same message instead.
    problems: dict[str, str] = {}  # nodeid -> message
    spec_problems = state.spec_problems()  # also specs of conftests loaded during collection
    for item in items:
        if "sgl_model" in getattr(item, "fixturenames", ()):
            try:
                _required_features(item)
            except ValueError as exc:
                item.stash[ITEM_ERROR_KEY] = str(exc)
    for item in items:
        fixturenames = getattr(item, "fixturenames", ())
        if "sgl_worker" not in fixturenames and "sgl_spawn_worker" not in fixturenames:
            continue
        try:
            marker = WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
            reason = _opt_out_reason(item)
        except ValueError as exc:
            item.stash[ITEM_ERROR_KEY] = str(exc)
            continue
        spec = _item_spec(item)
        if spec is None or "sgl_worker" not in fixturenames:
            continue
        from .pool import WorkerConfig

        if spec.name in spec_problems:
            problems[item.nodeid] = spec_problems[spec.name]
            continue
        found = budget.check_argv(list(spec.worker_args) + list(marker.args)) if marker.args else []
        if found and reason is None:
            problems[item.nodeid] = _marker_violation(item, marker, found)
            continue
        item.stash[CONFIG_KEY] = WorkerConfig.of(spec, marker.args, marker.env, opt_out=(reason or "") if found else "")
    with_args = {item.nodeid: item.stash[CONFIG_KEY] for item in items
                 if CONFIG_KEY in item.stash and item.stash[CONFIG_KEY].extra_args}
    flagged = state.check_flags({f"test {nodeid}": (c.spec, c.extra_args) for nodeid, c in with_args.items()})
    for nodeid in with_args:
        if f"test {nodeid}" in flagged:
            problems[nodeid] = flagged[f"test {nodeid}"]
    if spec_problems and not _is_xdist_worker(config):
        raise pytest.UsageError("\n".join(spec_problems.values()))
    if problems:
        if not _is_xdist_worker(config):
            raise pytest.UsageError("\n".join(dict.fromkeys(problems.values())))
        for item in items:
            if item.nodeid in problems:
                item.stash[ITEM_ERROR_KEY] = problems[item.nodeid]
                if CONFIG_KEY in item.stash:
                    del item.stash[CONFIG_KEY]
    _skip_impossible(state, items)
    if state.settings.reorder:
        _reorder(items)
    if not _is_xdist_worker(config):  # an xdist worker does not know which tests it will get
        last_users: dict[Any, str] = {}  # WorkerConfig -> node id
        for item in items:
            if CONFIG_KEY in item.stash:
                last_users[item.stash[CONFIG_KEY]] = item.nodeid
        state.last_users = set(last_users.values())


def _skip_impossible(state: SessionState, items: list[pytest.Item]) -> None:
    """Skip, before anything launches, tests whose worker can never get a GPU lease here."""
    configs = {item.stash[CONFIG_KEY] for item in items if CONFIG_KEY in item.stash}
    if not configs:
        return
    try:
        manager = state.lease_manager()
    except (SglWorkerError, ValueError) as exc:  # ValueError: --sgl-gpus names GPUs that are not visible
        from .errors import InventoryUnavailable

        reason = f"no GPU inventory: {exc}"
        inventory = isinstance(exc, InventoryUnavailable)
        if not inventory or (state.settings.gpus_explicit and _is_xdist_worker(state.config)):
            # An unsafe or unusable lock directory is an error, never a skip (a green run would hide it); an
            # xdist worker cannot stop the session cleanly, so each worker test fails with the message.
            source = f"{state.settings.sources['gpus']}: " if inventory else ""
            for item in items:
                if CONFIG_KEY in item.stash:
                    item.stash[ITEM_ERROR_KEY] = f"{source}{exc}"
            return
        if state.settings.gpus_explicit:
            raise pytest.UsageError(f"{state.settings.sources['gpus']}: {exc}") from None
        for item in items:
            if CONFIG_KEY in item.stash:
                item.add_marker(pytest.mark.skip(reason=reason))
        return
    reasons = {c: manager.can_ever_fit(c.spec.tp, c.spec.memory_mib) for c in configs}
    for item in items:
        worker_config = item.stash.get(CONFIG_KEY, None)
        if worker_config is not None and reasons.get(worker_config):
            item.add_marker(pytest.mark.skip(reason=f"{worker_config.spec.name}: {reasons[worker_config]}"))


def _reorder(items: list[pytest.Item]) -> None:
    """Stable: tests of one worker configuration move up to the first test of that configuration."""
    first: dict[str, int] = {}
    keys: list[tuple[int, int]] = []
    for index, item in enumerate(items):
        worker_config = item.stash.get(CONFIG_KEY, None)
        if worker_config is None:
            keys.append((index, 0))
            continue
        anchor = first.setdefault(worker_config.key, index)
        keys.append((anchor, 1 if anchor != index else 0))
    order = sorted(range(len(items)), key=lambda i: (keys[i], i))
    items[:] = [items[i] for i in order]


def pytest_runtest_setup(item: pytest.Item) -> None:
    error = item.stash.get(ITEM_ERROR_KEY, None)
    if error is not None:
        pytest.fail(error, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    item.stash.setdefault(REPORTS_KEY, {})[report.when] = report
    workers = item.stash.get(WORKERS_KEY, None)
    if workers and report.failed:
        tail = _state(item.config).settings.tail_lines
        for instance in workers:
            if instance.is_alive():
                title = f"sglang worker {instance.spec.name} {instance.host}:{instance.port}"
                body = f"log: {instance.log_path}\nlast {tail} lines:\n{instance.log_tail(tail)}"
            else:
                from .launcher import signal_name

                title = (f"sglang worker {instance.spec.name} {instance.host}:{instance.port} "
                         f"exited with {signal_name(instance.returncode)} during the test")
                body = instance.failure_message("exited during the test", lines=tail)
            report.sections.append((title, body))
    return report


# --------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def sgl_model(request: pytest.FixtureRequest) -> ModelSpec:
    """The model spec of this test: parametrized over ``--sgl-model`` (ids are the spec names)."""
    raise pytest.UsageError("sgl_model is parametrized by pytest-sglworker; it cannot be requested here")


@pytest.fixture(scope="session")
def sgl_registry(pytestconfig: pytest.Config) -> SpecRegistry:
    """The session's model registry (built-ins + specs registered by conftests)."""
    return _state(pytestconfig).registry


def _holder(request: pytest.FixtureRequest) -> str:
    return f"{request.node.nodeid} (pid {os.getpid()})"


def _fail_with(exc: SglWorkerError) -> None:
    # "from None": called inside "except SglWorkerError", the failure would otherwise chain that error as
    # its context, and pytest prints a chain even with pytrace=False: the whole message twice.
    raise pytest.fail.Exception(str(exc), pytrace=False) from None


@pytest.fixture
def sgl_worker(request: pytest.FixtureRequest, sgl_model: ModelSpec) -> Iterator[ModelInstance]:
    """A healthy sglang worker for the current ``sgl_model``, with extra args from
    ``@pytest.mark.sgl_worker(args=[...], env={...})``. Drawn from the session pool (reused by later tests
    of the same configuration unless ``fresh=True``)."""
    from .errors import InventoryUnavailable
    from .pool import WorkerConfig

    state = _state(request.config)
    item = request.node
    marker = WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
    worker_config = item.stash.get(CONFIG_KEY, None)
    if worker_config is None:  # not seen at collection (e.g. request.getfixturevalue): check it here
        reason = _opt_out_reason(item)
        found = budget.check_argv(list(sgl_model.worker_args) + list(marker.args))
        if found and reason is None:
            pytest.fail(_marker_violation(item, marker, found), pytrace=False)
        worker_config = WorkerConfig.of(sgl_model, marker.args, marker.env, opt_out=(reason or "") if found else "")
    try:
        pool = state.pool
    except InventoryUnavailable as exc:
        pytest.skip(f"no GPU inventory: {exc}")
    try:
        instance = _acquire(pool, worker_config, marker, _holder(request))
    except SglWorkerError as exc:
        _fail_with(exc)
        raise
    item.stash.setdefault(WORKERS_KEY, []).append(instance)
    yield instance
    reports = item.stash.get(REPORTS_KEY, {})
    call = reports.get("call")
    # No call report: the test was interrupted (Ctrl-C, pytest.exit) and this teardown runs at session end;
    # keep the log, and do not raise from here (a failure raised at session finish crashes pytest).
    failed = call is None or call.failed
    if not instance.is_alive():
        pool.discard(instance, failed=True)
        if not failed:
            from .launcher import signal_name

            pytest.fail(instance.failure_message(f"exited with {signal_name(instance.returncode)} during the test",
                                                 lines=state.settings.tail_lines), pytrace=False)
    elif marker.fresh or item.nodeid in state.last_users:
        pool.discard(instance, failed=failed)  # unshared, or no later test needs this configuration
    else:
        pool.release(instance, failed=failed)


def _acquire(pool: WorkerPool, worker_config: WorkerConfig, marker: WorkerMarker, holder: str) -> ModelInstance:
    options = None
    if marker.startup_timeout is not None or marker.allow_foreign_host is not None:
        import dataclasses

        options = dataclasses.replace(
            pool.options,
            startup_timeout=marker.startup_timeout or pool.options.startup_timeout,
            allow_foreign_host=marker.allow_foreign_host is not None,
        )
    return pool.acquire(worker_config, holder=holder, fresh=marker.fresh, options=options)


class SpawnWorker:
    """The ``sgl_spawn_worker`` factory: ``sgl_spawn_worker("qwen3-0.6b", args=[...], env={...})``."""

    def __init__(self, state: SessionState, request: pytest.FixtureRequest) -> None:
        self._state = state
        self._request = request
        self.instances: list[ModelInstance] = []

    def __call__(
        self,
        model: str | ModelSpec | None = None,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        budget_opt_out: str | None = None,
    ) -> ModelInstance:
        from .errors import InventoryUnavailable
        from .pool import WorkerConfig

        spec = self._resolve(model)
        if isinstance(args, str):
            raise TypeError(f"sgl_spawn_worker(args=...) must be a list of arguments, not the string {args!r}")
        problems = budget.check_argv(list(spec.worker_args) + list(args))
        if problems and not (budget_opt_out or "").strip():
            raise pytest.UsageError(budget.describe_violation(
                f"sgl_spawn_worker({spec.name!r}, args={list(args)!r}) in {self._request.node.nodeid}", problems,
                fix="drop the args that loosen the budget, or pass budget_opt_out='why this test needs it'"))
        try:
            pool = self._state.pool
        except InventoryUnavailable as exc:
            pytest.skip(f"no GPU inventory: {exc}")
        if args:
            rejected = self._state.check_flags({f"sgl_spawn_worker({spec.name!r}) in {self._request.node.nodeid}":
                                                (spec, tuple(args))})
            if rejected:
                pytest.fail("\n".join(rejected.values()), pytrace=False)
        opt_out = (budget_opt_out or "").strip() if problems else ""
        try:
            instance = pool.acquire(WorkerConfig.of(spec, args, env, opt_out=opt_out), holder=_holder(self._request),
                                    fresh=True)
        except SglWorkerError as exc:
            _fail_with(exc)
            raise
        self.instances.append(instance)
        self._request.node.stash.setdefault(WORKERS_KEY, []).append(instance)
        return instance

    def _resolve(self, model: str | ModelSpec | None) -> ModelSpec:
        if isinstance(model, ModelSpec):
            return model
        if model is None:
            callspec = getattr(self._request.node, "callspec", None)
            spec = callspec.params.get("sgl_model") if callspec is not None else None
            if isinstance(spec, ModelSpec):
                return spec
            selected = self._state.selected_specs()
            if not selected:
                pytest.skip("no sglang model selected: run with --sgl-model NAME, or pass a model name")
            return selected[0]
        try:
            return self._state.registry.get(model)
        except SpecError as exc:
            raise pytest.UsageError(str(exc)) from None

    def close(self, failed: bool) -> None:
        pool = self._state._pool
        for instance in self.instances:
            if pool is not None:
                pool.discard(instance, failed=failed or not instance.is_alive())
            else:
                instance.stop()


@pytest.fixture
def sgl_spawn_worker(request: pytest.FixtureRequest) -> Iterator[SpawnWorker]:
    """A factory for fresh, unshared workers with extra args and env, torn down at the end of the test."""
    factory = SpawnWorker(_state(request.config), request)
    yield factory
    reports = request.node.stash.get(REPORTS_KEY, {})
    call = reports.get("call")
    factory.close(failed=call is None or call.failed)


# --------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    state = config.stash.get(STATE_KEY, None)
    if state is None:
        return None
    s = state.settings
    if not s.models and all(src == "default" for src in s.sources.values() if not src.startswith("ini sgl_models")):
        return None  # a run that does not use the plugin prints nothing
    models = ", ".join(s.models) or "none selected"
    launcher = " ".join(s.launcher) if s.launcher else ("simulated engine" if s.engine == "sim" else
                                                         f"{sys.executable} -m sglang.launch_server")
    return [f"sglworker: models: {models}; engine: {s.engine} ({launcher}); gpus: {s.gpus or 'auto (NVML)'}",
            f"sglworker: worker flags {state.flag_check}"]


@pytest.hookimpl(trylast=True)  # after the runner's, which tears down the fixtures of an interrupted test
def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash.get(STATE_KEY, None)
    if state is None:
        return
    state.close()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and state._pool is not None:
        workeroutput["sglworker_stats"] = {k: v.as_dict() for k, v in state._pool.stats.items()}


def _collected_stats(state: SessionState) -> dict[str, Any]:
    from .pool import merge_stats

    sources = list(state.worker_stats)
    if state._pool is not None:
        sources.append({k: v.as_dict() for k, v in state._pool.stats.items()})
    return merge_stats(sources)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(STATE_KEY, None)
    if state is None or getattr(config, "workerinput", None) is not None:
        return
    stats = _collected_stats(state)
    if state.settings.report is not None:
        from .pool import write_report

        try:
            write_report(state.settings.report, stats, {
                "engine": state.settings.engine, "models": list(state.settings.models), "exitstatus": int(exitstatus),
            })
        except OSError as exc:  # a crash here would end pytest with a traceback instead of its summary
            terminalreporter.write_line(f"sglworker: ERROR: cannot write the run report to {state.settings.report} "
                                        f"({state.settings.sources.get('report', '--sgl-report')}): "
                                        f"{exc.strerror or exc}", red=True)
        else:
            terminalreporter.write_line(f"sglworker: run report written to {state.settings.report}")
    if not stats or config.get_verbosity() < -1:
        return
    import statistics
    terminalreporter.write_sep("-", "sglang workers")
    for st in stats.values():
        times = st.startup_seconds
        span = "-" if not times else f"{min(times):.1f}/{statistics.median(times):.1f}/{max(times):.1f} s"
        kv = ""
        if st.kv_tokens_actual is not None:
            kv = f", KV #tokens {st.kv_tokens_actual}"
            if st.kv_tokens_predicted is not None:
                kv += f" (predicted {st.kv_tokens_predicted})"
        terminalreporter.write_line(
            f"{st.label}: {st.launches} launched, {st.reuses} reused, startup min/median/max {span}, "
            f"lease wait {st.lease_wait_seconds:.1f} s, GPU-seconds {st.gpu_seconds:.1f}, "
            f"{st.failures} failed to start, {st.deaths} died{kv}"
        )
        for log in st.failed_logs:
            terminalreporter.write_line(f"    log kept: {log}")


def _xdist_present(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("xdist")


class XdistHooks:
    """Registered only when pytest-xdist is present."""

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> Generator[None, None, None]:
        # Under --dist loadgroup, xdist's worker appends the xdist_group name to each node id in its own
        # pytest_collection_modifyitems, which pluggy calls before the plugin's (xdist registers it later):
        # the group marks must be in place first. The main hook reports marker errors.
        for item in items:
            spec = _item_spec(item)
            if (spec is None or "sgl_worker" not in getattr(item, "fixturenames", ())
                    or item.get_closest_marker("xdist_group") is not None):
                continue
            from .pool import WorkerConfig  # only once a worker test is seen: unused runs import nothing more

            try:
                marker = WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
            except ValueError:
                continue
            key = WorkerConfig.of(spec, marker.args, marker.env).key
            item.add_marker(pytest.mark.xdist_group(name=f"sgl-{key}"))
        result = yield
        # pytest >= 9.2 derives the node id from the structured item._id, while xdist <= 3.8 still writes the
        # suffixed id to the legacy item._nodeid: the @group suffix is lost and loadgroup silently stops
        # grouping (pytest-dev/pytest-xdist#1386). Carry it over; a no-op once xdist sets the id itself.
        # This is the plugin's one use of pytest internals, guarded so that another pytest cannot break a run.
        for item in items:
            legacy = getattr(item, "_nodeid", None)
            if isinstance(legacy, str) and legacy.startswith(item.nodeid + "@") and hasattr(item, "_id"):
                try:
                    from _pytest.nodeid import NodeId

                    item._id = NodeId.parse(legacy)
                except Exception:  # a workaround must never fail a run
                    break
        return result

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        stats = getattr(node, "workeroutput", {}).get("sglworker_stats")
        if stats:
            _state(node.config).worker_stats.append(stats)
