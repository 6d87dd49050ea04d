"""The plugin's session object: one per pytest process, registered as a plugin whose hooks are its methods
(the way pytest-xdist registers its ``DSession``). A pytest-facing module, split from ``plugin.py``.

It holds the session's registry, settings, pool, GPU leases and watchdog, and does the collection-time work:
budget and flag checks, parametrization over the selected models, per-test worker configurations
(:meth:`SglSession.resolve_config`, the one place every entry point resolves one), skipping what the
inventory can never hold, reordering, and the run report at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Generator, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import pytest

from . import budget
from .errors import BudgetViolation, SglWorkerError, SpecError
from .markers import MarkerError, WorkerMarker, WorkersMarker, opt_out_reason, required_features
from .options import Settings
from .specs import ModelSpec, SpecRegistry, set_active_registry

if TYPE_CHECKING:
    from .gpus import LeaseManager
    from .kinds import GroupShape, WorkerConfig, WorkerKind
    from .pool import WorkerPool

STATE_KEY = pytest.StashKey["SglSession"]()
#: the processes a test used (workers and routers): their logs go into the test's failure report
WORKERS_KEY = pytest.StashKey[list[Any]]()
ITEM_ERROR_KEY = pytest.StashKey[str]()
CONFIG_KEY = pytest.StashKey["WorkerConfig"]()
REPORTS_KEY = pytest.StashKey[dict[str, pytest.TestReport]]()
NEXT_KEY = pytest.StashKey["pytest.Item | None"]()

#: The fixtures that launch workers, and the marker each one reads.
WORKER_FIXTURES = ("sgl_worker", "sgl_workers", "sgl_router")
OPT_OUT_FIX = ("drop the args that loosen the budget, or add "
               "@pytest.mark.sgl_budget_opt_out(reason='why this test needs it')")


def is_xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker (it cannot stop the session: per-test errors instead)."""
    return getattr(config, "workerinput", None) is not None


def xdist_worker_id(config: pytest.Config) -> str | None:
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput.get("workerid")) if isinstance(workerinput, dict) else None


def state_of(config: pytest.Config) -> SglSession:
    return config.stash[STATE_KEY]


def item_spec(item: pytest.Item) -> ModelSpec | None:
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get("sgl_model") if callspec is not None else None
    return spec if isinstance(spec, ModelSpec) else None


def _plugin_name(plugin: object) -> str:
    return getattr(plugin, "__file__", None) or getattr(plugin, "__name__", None) or repr(plugin)


class SglSession:
    """Everything the plugin holds for one session, and the hooks that use it."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.registry = SpecRegistry.with_builtins()
        self.registered_from: set[int] = set()
        self._pool: WorkerPool | None = None
        self._watchdog: Any = None
        self._leases: LeaseManager | None = None
        self.flag_check: str = "not needed (no worker test collected)"
        self.messages: list[str] = []
        self.worker_stats: list[dict[str, Any]] = []  # from xdist workers
        self.worker_launches: list[list[dict[str, Any]]] = []  # from xdist workers
        #: node ids of the last test of each worker configuration: its workers are retired after it
        self.last_users: set[str] = set()
        self.interrupted_by: int | None = None
        self._log_dir: Path | None = None
        self._queue: list[pytest.Item] = []
        self._queue_index: dict[str, int] = {}
        self._session_dir: Any = None
        self._previous_handlers: dict[int, Any] = {}
        #: spec name -> its attached workers (--sgl-worker-url), or the error that makes them unusable
        self._attached: dict[str, Any] = {}
        #: node id -> [seconds of setup + call + teardown, its configuration's key]: the report's "tests"
        self.test_times: dict[str, list[Any]] = {}
        self.shard_note: str | None = None
        import time

        self.started_at = time.time()

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
        from .kinds import default_kind

        chosen = self.config.hook.pytest_sglworker_worker_kind(role=role, args=tuple(args))
        return chosen if chosen is not None else default_kind(role, args)

    def resolve_config(self, node: Any, spec: ModelSpec, fixture: str) -> WorkerConfig:
        """The worker configuration of a test (``node``) for ``fixture``: its marker read and validated, the
        budget checked for every member. Raises :class:`MarkerError` for a bad marker and
        :class:`BudgetViolation` for args that loosen the budget without an opt-out; callers decide how each
        fails (a usage error at collection, an error of the test otherwise)."""
        from .kinds import GroupShape, WorkerConfig

        reason = opt_out_reason(node)
        group: GroupShape | None = None
        if fixture == "sgl_worker":
            marker = WorkerMarker.from_mark(node.get_closest_marker("sgl_worker"))
            args, env, name = marker.args, marker.env, "sgl_worker"
        else:
            group_marker = WorkersMarker.from_mark(node.get_closest_marker("sgl_workers"))
            group = GroupShape(group_marker.count, group_marker.prefill, group_marker.decode, group_marker.role_args)
            args, env, name = group_marker.args, group_marker.env, "sgl_workers"
        subject = f"test {getattr(node, 'nodeid', node)}: @pytest.mark.{name}(args={list(args)!r}"
        subject += "".join(f", {role}_args={list(a)!r}" for role, a in (group.role_args if group else ())) + ")"
        return WorkerConfig.resolve(spec, args, env, opt_out=reason, group=group, subject=subject, fix=OPT_OUT_FIX)

    # -- attached workers (--sgl-worker-url, attached.py) -------------------------------------------------
    def attached_workers(self, spec: ModelSpec) -> list[Any] | None:
        """The attached workers of ``spec`` (probed once), None when it has none; AttachedWorkerError when
        they are down or serve another model (remembered: the next test does not wait for it again)."""
        targets = self.settings.worker_urls.get(spec.name)
        if not targets:
            return None
        if spec.name not in self._attached:
            from .attached import AttachedWorkerError, attach

            source = self.settings.sources.get("worker-url", "--sgl-worker-url")
            try:
                tail = self.settings.tail_lines
                self._attached[spec.name] = [attach(t, spec, source=source, index=i, tail_lines=tail)
                                             for i, t in enumerate(targets)]
            except AttachedWorkerError as exc:
                self._attached[spec.name] = exc
        found = self._attached[spec.name]
        if isinstance(found, BaseException):
            raise found
        return list(found)

    def attached_refusal(self, item: Any, config: WorkerConfig) -> tuple[str, str] | None:
        """Why ``item`` cannot run on its spec's attached workers: ``("skip", reason)`` for a shape they cannot
        take, ``("error", message)`` for a budget they break without an opt-out; None when it can."""
        workers = self.attached_workers(config.spec) or []
        where = ", ".join(w.url for w in workers)
        name = config.spec.name
        if config.extra_args or config.env or (config.group is not None and any(a for _, a in config.group.role_args)):
            return "skip", (f"{name} is attached ({where}): it runs as it was started, and this test's extra args or "
                            f"env need a launched worker (drop --sgl-worker-url {name}=... to run it)")
        if config.group is not None and config.group.is_pd:
            return "skip", f"{name} is attached ({where}): this test needs a prefill/decode group"
        wanted = config.group.count if config.group is not None else 1
        if wanted > len(workers):
            return "skip", (f"{name} is attached ({where}): this test needs {wanted} workers, {len(workers)} "
                            f"attached (give --sgl-worker-url {name}=URL once per worker)")
        problems = [p for w in workers[:wanted] for p in w.problems]
        if problems and not opt_out_reason(item):
            subject = "; ".join(f"attached worker {w.url}" for w in workers[:wanted] if w.problems)
            return "error", budget.describe_violation(
                f"{subject} ({name}, {self.settings.sources.get('worker-url', '--sgl-worker-url')})", problems,
                fix="restart it with CI_WORKER_ARGS (--mem-fraction-static 0.6 --cuda-graph-backend-prefill "
                    "disabled), or mark the test @pytest.mark.sgl_budget_opt_out(reason='why')")
        return None

    def _check_attached(self, items: list[pytest.Item], problems: dict[str, str]) -> None:
        from .attached import AttachedWorkerError

        if not self.settings.worker_urls:
            return
        unknown = [n for n in self.settings.worker_urls if n not in self.registry]
        if unknown and not is_xdist_worker(self.config):
            raise pytest.UsageError(f"{self.settings.sources.get('worker-url')}: unknown model spec(s) "
                                    f"{', '.join(map(repr, unknown))}; known: {', '.join(self.registry.names())}")
        for item in items:
            config = item.stash.get(CONFIG_KEY, None)
            if config is None or config.spec.name not in self.settings.worker_urls:
                continue
            try:
                refusal = self.attached_refusal(item, config)
            except AttachedWorkerError as exc:
                if not is_xdist_worker(self.config):
                    raise pytest.UsageError(str(exc)) from None
                refusal = ("error", str(exc))
            except MarkerError as exc:
                refusal = ("error", str(exc))
            if refusal is None:
                continue
            if refusal[0] == "skip":
                item.add_marker(pytest.mark.skip(reason=refusal[1]))
            else:
                problems[item.nodeid] = refusal[1]

    # -- sharding (--sgl-shard, sharding.py) ----------------------------------------------------------------
    def shard_costs(self) -> Any:
        """The costs of --sgl-shard-report (None: balance by test count); a file that is no run report is a
        usage error naming it."""
        if not hasattr(self, "_shard_costs"):
            from .sharding import load_costs

            try:
                costs, notes = load_costs(self.settings.shard_report)
            except ValueError as exc:
                raise pytest.UsageError(f"{self.settings.sources.get('shard-report')}: {exc}") from None
            self._shard_costs = costs
            self._shard_notes = notes
        return self._shard_costs

    def _apply_shard(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        shard = self.settings.shard
        if shard is None:
            return
        from .sharding import plan_shards

        costs = self.shard_costs()
        tests = [(item.nodeid, item.stash[CONFIG_KEY].key if CONFIG_KEY in item.stash else None) for item in items]
        shards = plan_shards(tests, shard.total, costs)
        mine = shards[shard.index - 1]
        keep = mine.nodeids
        dropped = [item for item in items if item.nodeid not in keep]
        items[:] = [item for item in items if item.nodeid in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        total = sum(s.cost for s in shards)
        unit = "s" if costs is not None else " tests"
        basis = (f"balanced by {len(costs.sources)} report(s)" if costs is not None
                 else "balanced by test count" + (f" ({'; '.join(self._shard_notes)})" if self._shard_notes else ""))
        self.shard_note = (f"sglworker: shard {shard}: {len(items)} of {len(tests)} tests, "
                           f"{len(mine.configs)} worker configuration(s), estimated {mine.cost:.1f}{unit} of "
                           f"{total:.1f}{unit} ({basis})")

    # -- workers ------------------------------------------------------------------------------------------
    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    @property
    def pool_if_started(self) -> WorkerPool | None:
        return self._pool

    def _make_pool(self) -> WorkerPool:
        from .launcher import LaunchOptions
        from .pool import WorkerPool
        from .reaper import Watchdog, reap_dead_sessions
        from .reporter import message, progress, progress_end

        s = self.settings
        try:
            leases: Any = self.lease_manager()
        except SglWorkerError as exc:
            from .errors import InventoryUnavailable

            if not (isinstance(exc, InventoryUnavailable) and s.worker_urls):
                raise
            # Attached workers (and a router in front of them) need no GPU: the pool serves them, and any launch
            # it is asked for fails with the inventory's error.
            leases = _NoInventory(exc, self._lock_dir())
        reaped = reap_dead_sessions(s.log_dir or _default_log_dir(), lock_dir=leases.lock_dir)
        if reaped:
            message(self, f"cleaned up after earlier sessions: {reaped}")
        self._watchdog = Watchdog(lock_dir=leases.lock_dir)
        options = LaunchOptions(
            launcher=self.launcher(), log_dir=self.log_dir, lock_dir=s.lock_dir, startup_timeout=s.startup_timeout,
            port_range=s.port_range, tail_lines=s.tail_lines, port_wait_timeout=s.lease_timeout,
            on_port_wait=lambda text: message(self, text),
        )
        return WorkerPool(
            options, leases=leases, lease_timeout=s.lease_timeout, reuse=s.reuse,
            log_policy=s.log_policy, on_progress=lambda instance, elapsed: progress(self, instance, elapsed),
            on_progress_end=lambda: progress_end(self),
            on_message=lambda text: message(self, text), worker_env=self._worker_env,
            choose_kind=self.choose_kind, xdist_worker=xdist_worker_id(self.config),
        )

    def _worker_env(self, spec: ModelSpec, lease_env: dict[str, str]) -> dict[str, str]:
        lease_env = {**self._declared_gpu_env(), **lease_env}
        result = self.config.hook.pytest_sglworker_worker_env(spec=spec, lease_env=dict(lease_env))
        return dict(lease_env) if result is None else dict(result)

    def _declared_gpu_env(self) -> dict[str, str]:
        """For declared GPUs (``--sgl-gpus sim:NxGiB``): the card size and the free memory the ledger predicts
        with, for the simulated engine, so its KV pool and log lines are those of that card (the run report's
        predicted and actual KV figures then agree). A real engine ignores them."""
        from .gpus import DeclaredInventory

        inventory = getattr(self._leases, "inventory", None)
        if not isinstance(inventory, DeclaredInventory):
            return {}
        from .sim_core import ENV_GPU_FREE, ENV_GPU_MEM

        return {ENV_GPU_MEM: f"{inventory.total_mib / 1024:g}", ENV_GPU_FREE: str(inventory.total_mib)}

    def lease_manager(self) -> LeaseManager:
        """The session's GPU lease manager (one inventory, one lock directory). Raises InventoryUnavailable
        when the inventory cannot be read, ValueError when --sgl-gpus names GPUs that are not visible, and
        UnsafeDirectory for a lock directory that cannot be used."""
        if self._leases is None:
            from .gpus import LeaseManager, load_inventory, parse_gpus_option

            selection = parse_gpus_option(self.settings.gpus or "")
            inventory = load_inventory(selection, os.environ)
            lock_dir = self._lock_dir()
            from .reporter import message

            self._leases = LeaseManager(lock_dir, inventory, namespace=selection.namespace,
                                        on_message=lambda text: message(self, text))
        return self._leases

    def _lock_dir(self) -> Path:
        from . import state

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
                from .retention import make_session_dir

                self._session_dir = make_session_dir(_default_log_dir(), self.settings.log_retention_count)
                self._log_dir = self._session_dir.path
        return self._log_dir

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
            from .reporter import message

            swept = sweep_session()
            if swept:
                message(self, f"killed {len(swept)} worker process(es) left after teardown: {swept}")
            self._watchdog.close()
            self._watchdog = None
        if self._leases is not None:
            self._leases.inventory.close()  # NVML shutdown; a declared inventory has nothing to free
        if self._session_dir is not None:
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

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted_by is None:
            self.interrupted_by = signum
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

    def restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)
        self._previous_handlers.clear()

    # ======================================================================================================
    # hooks
    # ======================================================================================================

    def pytest_plugin_registered(self, plugin: object, manager: pytest.PytestPluginManager) -> None:
        # Conftests of sub-directories are loaded during collection: register their specs when they arrive.
        if plugin is not self:
            self.register_from(plugin)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
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

    @pytest.hookimpl(trylast=True)  # after -k/-m/--deselect: deselected tests are neither checked nor counted
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        # A usage error stops the session; an xdist worker cannot stop it cleanly (xdist would report an
        # INTERNALERROR), so there each offending test fails on its own with the same message instead.
        problems: dict[str, str] = {}  # nodeid -> message
        spec_problems = self.spec_problems()  # also specs of conftests loaded during collection
        for item in items:
            if "sgl_model" in getattr(item, "fixturenames", ()):
                try:
                    required_features(item)
                except MarkerError as exc:
                    item.stash[ITEM_ERROR_KEY] = str(exc)
        for item in items:
            fixturenames = getattr(item, "fixturenames", ())
            fixture = next((f for f in WORKER_FIXTURES if f in fixturenames), None)
            if fixture is None and "sgl_spawn_worker" not in fixturenames:
                continue
            try:
                WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
                opt_out_reason(item)
                if fixture is None:
                    continue
                from .markers import RouterMarker

                RouterMarker.from_mark(item.get_closest_marker("sgl_router"))
                spec = item_spec(item)
                if spec is None:
                    continue
                if spec.name in spec_problems:
                    problems[item.nodeid] = spec_problems[spec.name]
                    continue
                item.stash[CONFIG_KEY] = self.resolve_config(item, spec, fixture)
                fault = self._sim_fault_problem(item.stash[CONFIG_KEY])
                if fault:
                    problems[item.nodeid] = f"test {item.nodeid}: {fault}"
            except MarkerError as exc:
                item.stash[ITEM_ERROR_KEY] = str(exc)
            except (BudgetViolation, ValueError) as exc:
                problems[item.nodeid] = str(exc)
        self._check_attached(items, problems)
        with_args = {item.nodeid: item.stash[CONFIG_KEY] for item in items
                     if CONFIG_KEY in item.stash and item.stash[CONFIG_KEY].members()[0].extra_args}
        flagged = self.check_flags({f"test {nodeid}": (c.spec, m.extra_args)
                                    for nodeid, c in with_args.items() for m in c.members()[:1]})
        for nodeid in with_args:
            if f"test {nodeid}" in flagged:
                problems[nodeid] = flagged[f"test {nodeid}"]
        if spec_problems and not is_xdist_worker(config):
            raise pytest.UsageError("\n".join(spec_problems.values()))
        if problems:
            if not is_xdist_worker(config):
                raise pytest.UsageError("\n".join(dict.fromkeys(problems.values())))
            for item in items:
                if item.nodeid in problems:
                    item.stash[ITEM_ERROR_KEY] = problems[item.nodeid]
                    if CONFIG_KEY in item.stash:
                        del item.stash[CONFIG_KEY]
        self._apply_shard(config, items)
        self._skip_impossible(items)
        self._skip_without_router(items)
        if self.settings.reorder:
            _reorder(items)
        self._queue = list(items)
        self._queue_index = {item.nodeid: i for i, item in enumerate(items)}
        if not is_xdist_worker(config):  # an xdist worker does not know which tests it will get
            last_users: dict[Any, str] = {}  # WorkerConfig -> node id
            for item in items:
                if CONFIG_KEY in item.stash:
                    last_users[item.stash[CONFIG_KEY]] = item.nodeid
            self.last_users = set(last_users.values())

    def _sim_fault_problem(self, config: WorkerConfig) -> str | None:
        """With the simulated engine, a fault setting in a spec's or a marker's env that the engine would refuse
        (an unknown fault, a value out of range): said at collection, with the faults it knows."""
        if self.settings.engine != "sim":
            return None
        from .sim_core import ENV_FAULT, FaultError, parse_fault_spec

        value = {**config.spec.env, **dict(config.env)}.get(ENV_FAULT)
        if not value:
            return None
        try:
            parse_fault_spec(value, f"env {ENV_FAULT}={value!r}")
        except FaultError as exc:
            return f"{exc}; the faults and their values: python -m pytest_sglworker.sim --help"
        return None

    def _skip_impossible(self, items: list[pytest.Item]) -> None:
        """Skip, before anything launches, tests whose workers can never get a GPU lease here."""
        attached = self.settings.worker_urls  # never leased: no GPU needed here
        configs = {item.stash[CONFIG_KEY] for item in items
                   if CONFIG_KEY in item.stash and item.stash[CONFIG_KEY].spec.name not in attached}
        if not configs:
            return
        try:
            manager = self.lease_manager()
        except (SglWorkerError, ValueError) as exc:  # ValueError: --sgl-gpus names GPUs that are not visible
            from .errors import InventoryUnavailable

            reason = f"no GPU inventory: {exc}"
            inventory = isinstance(exc, InventoryUnavailable)
            if not inventory or (self.settings.gpus_explicit and is_xdist_worker(self.config)):
                # An unsafe or unusable lock directory is an error, never a skip (a green run would hide it); an
                # xdist worker cannot stop the session cleanly, so each worker test fails with the message.
                source = f"{self.settings.sources['gpus']}: " if inventory else ""
                for item in items:
                    if item.stash.get(CONFIG_KEY, None) in configs:
                        item.stash[ITEM_ERROR_KEY] = f"{source}{exc}"
                return
            if self.settings.gpus_explicit:
                raise pytest.UsageError(f"{self.settings.sources['gpus']}: {exc}") from None
            for item in items:
                if item.stash.get(CONFIG_KEY, None) in configs:
                    item.add_marker(pytest.mark.skip(reason=reason))
            return
        reasons = {}
        for c in configs:
            gpus = c.gpus_needed(self.choose_kind)
            why = manager.can_ever_fit(gpus, c.spec.memory_mib)
            if why and c.group is not None:
                why = f"the group {c.group.describe()} leases {gpus} GPU(s) at once: {why}"
            elif why and gpus != c.spec.tp:
                why = f"the worker leases {gpus} GPU(s) at once (tp x data-parallel replicas): {why}"
            reasons[c] = why
        for item in items:
            worker_config = item.stash.get(CONFIG_KEY, None)
            if worker_config is not None and reasons.get(worker_config):
                item.add_marker(pytest.mark.skip(reason=f"{worker_config.spec.name}: {reasons[worker_config]}"))

    def _skip_without_router(self, items: list[pytest.Item]) -> None:
        """Skip, before their workers launch, the tests of ``sgl_router`` when the router is not installed."""
        users = [item for item in items if "sgl_router" in getattr(item, "fixturenames", ())]
        if not users:
            return
        from .router import RouterUnavailable, router_launcher

        try:
            router_launcher(self.settings)
        except RouterUnavailable as exc:
            for item in users:
                item.add_marker(pytest.mark.skip(reason=str(exc)))

    # -- launching ahead --------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        item.stash[NEXT_KEY] = nextitem

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        """With this test's own workers in place (after its setup), start the workers of the next
        configurations the queue needs (``--sgl-launch-ahead``) on free GPUs, so that they are ready when their
        first test begins. An xdist worker knows its queue only one test ahead."""
        count = self.settings.launch_ahead
        pool = self._pool
        if count <= 0 or pool is None or not self.settings.reuse:
            return
        current = item.stash.get(CONFIG_KEY, None)
        wanted: list[WorkerConfig] = []
        for upcoming in self._upcoming(item):
            config = upcoming.stash.get(CONFIG_KEY, None)
            if config is None or config == current or config in wanted or not _poolable(upcoming):
                continue
            wanted.append(config)
            if len(wanted) >= count:
                break
        for config in wanted:
            try:
                pool.launch_ahead(config, holder=f"launch ahead for {self.config.rootpath.name} (pid {os.getpid()})")
            except Exception as exc:  # launching ahead is an optimisation: it never fails a test
                self.messages.append(f"launch ahead of {config.label} failed to start: {exc!r}")

    def _upcoming(self, item: pytest.Item) -> list[pytest.Item]:
        if self._queue and not is_xdist_worker(self.config):
            at = self._queue_index.get(item.nodeid)
            if at is not None:
                return self._queue[at + 1:]
        nextitem = item.stash.get(NEXT_KEY, None)
        return [nextitem] if nextitem is not None else []

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(ITEM_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        item.stash.setdefault(REPORTS_KEY, {})[report.when] = report
        if CONFIG_KEY in item.stash:  # carried to the xdist controller with the report
            report.sglworker_config = item.stash[CONFIG_KEY].key  # type: ignore[attr-defined]
        workers = item.stash.get(WORKERS_KEY, None)
        if workers and report.failed:
            from .reporter import worker_section

            junit = bool(getattr(self.config.option, "xmlpath", None))
            for instance in workers:
                title, body = worker_section(instance, self.settings.tail_lines)
                report.sections.append((title, body))
                # CI systems read junitxml, which takes properties and captured output from the teardown report:
                # the log path as a property, the tail in the test's system-err (not shown twice in the terminal)
                prop = (f"sglworker_log_{instance.role}_{instance.port}", str(instance.log_path))
                if instance.log_path is not None and prop not in item.user_properties:
                    item.user_properties.append(prop)
                if junit:
                    item.add_report_section(report.when, "stderr", f"{title}\n{body}\n")
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Each test's time (setup, which includes waiting for its workers, call and teardown) and its worker
        configuration, for the run report: what --sgl-shard-report balances shards by."""
        if is_xdist_worker(self.config):
            return
        entry = self.test_times.setdefault(report.nodeid, [0.0, None])
        entry[0] += report.duration
        entry[1] = entry[1] or getattr(report, "sglworker_config", None)

    def pytest_report_collectionfinish(self, config: pytest.Config) -> str | None:
        return self.shard_note

    @pytest.hookimpl(trylast=True)  # after the runner's, which tears down the fixtures of an interrupted test
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.close()
        self.restore_signal_handlers()
        if self.interrupted_by is not None:
            session.exitstatus = 128 + self.interrupted_by
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None and self._pool is not None:
            workeroutput["sglworker_stats"] = {k: v.as_dict() for k, v in self._pool.stats.items()}
            workeroutput["sglworker_launches"] = [r.as_dict() for r in self._pool.launches]
        if not is_xdist_worker(session.config):
            self.write_artifacts(int(session.exitstatus))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.close()
        self.restore_signal_handlers()
        set_active_registry(None)

    # -- the run report -----------------------------------------------------------------------------------
    def collected_stats(self) -> dict[str, Any]:
        from .report import merge_stats

        sources = list(self.worker_stats)
        if self._pool is not None:
            sources.append({k: v.as_dict() for k, v in self._pool.stats.items()})
        return merge_stats(sources)

    def collected_launches(self) -> list[dict[str, Any]]:
        from .report import merge_launches

        sources = list(self.worker_launches)
        if self._pool is not None:
            sources.append([r.as_dict() for r in self._pool.launches])
        return merge_launches(sources)

    def run_report(self, exitstatus: int) -> dict[str, Any]:
        """The run report as one dict (the ``--sgl-report`` JSON; the timeline and the trace are drawn from it)."""
        import time

        from .report import SCHEMA

        return {"schema": SCHEMA, "engine": self.settings.engine, "models": list(self.settings.models),
                "exitstatus": exitstatus,
                "interrupted": exitstatus == int(pytest.ExitCode.INTERRUPTED) or self.interrupted_by is not None,
                "started_at": round(self.started_at, 3), "finished_at": round(time.time(), 3),
                "workers": {k: v.as_dict() for k, v in sorted(self.collected_stats().items())},
                "launches": self.collected_launches(),
                "tests": {nodeid: {"seconds": round(seconds, 3), "config": key}
                          for nodeid, (seconds, key) in self.test_times.items()}}

    def write_artifacts(self, exitstatus: int) -> None:
        """``--sgl-report``, ``--sgl-timeline`` and ``--sgl-trace``, each written atomically; a failure to
        write one is an error line, never a traceback that would hide pytest's own summary."""
        from .reporter import message

        s = self.settings
        wanted = {name: path for name, path in (("report", s.report), ("timeline", s.timeline), ("trace", s.trace))
                  if path is not None}
        if not wanted:
            return
        report = self.run_report(exitstatus)
        for name, path in wanted.items():
            try:
                if name == "report":
                    from .report import write_json

                    write_json(path, report)
                elif name == "timeline":
                    from .timeline import write_html

                    write_html(path, report)
                else:
                    from .timeline import write_trace

                    write_trace(path, report)
            except (OSError, ValueError) as exc:
                detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                message(self, f"ERROR: cannot write the run {name} to {path} "
                              f"({s.sources.get(name, '--sgl-' + name)}): {detail}", always=True)
            else:
                message(self, f"run {name} written to {path}", always=True)


class _NoInventory:
    """The pool's leases when there is no GPU inventory but attached workers need no GPU: asking for a lease
    raises the inventory's error."""

    def __init__(self, error: SglWorkerError, lock_dir: Path) -> None:
        self.error = error
        self.lock_dir = lock_dir

    def try_acquire(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error

    acquire = try_acquire

    def others_waiting(self) -> bool:
        return False


def _default_log_dir() -> Any:
    from .state import default_log_dir

    return default_log_dir()


def _poolable(item: pytest.Item) -> bool:
    """Whether a test's workers come from the pool (not ``fresh=True``, not its own launch options)."""
    try:
        worker = WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
        group = WorkersMarker.from_mark(item.get_closest_marker("sgl_workers"))
    except MarkerError:
        return False
    if "sgl_worker" in getattr(item, "fixturenames", ()):
        return not (worker.fresh or worker.startup_timeout is not None or worker.allow_foreign_host is not None)
    return not (group.fresh or group.startup_timeout is not None)


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


class XdistHooks:
    """Registered only when pytest-xdist is present."""

    def __init__(self, session: SglSession) -> None:
        self.session = session
        self.relay: Any = None

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> Generator[None, None, None]:
        # Under --dist loadgroup, xdist's worker appends the xdist_group name to each node id in its own
        # pytest_collection_modifyitems, which pluggy calls before the plugin's (xdist registers it later):
        # the group marks must be in place first. The main hook reports marker errors.
        for item in items:
            spec = item_spec(item)
            fixturenames = getattr(item, "fixturenames", ())
            fixture = next((f for f in WORKER_FIXTURES if f in fixturenames), None)
            if spec is None or fixture is None or item.get_closest_marker("xdist_group") is not None:
                continue
            try:
                key = self.session.resolve_config(item, spec, fixture).key
            except (MarkerError, BudgetViolation, ValueError):
                continue
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

    def pytest_configure_node(self, node: Any) -> None:
        """The xdist workers log into the controller's session directory, and send their status lines to the
        controller (a file it follows) so that a long startup on an xdist worker shows in the terminal."""
        node.workerinput["sglworker_log_dir"] = str(self.session.log_dir)
        if self.relay is None:
            from .reporter import ProgressRelay

            self.relay = ProgressRelay(self.session, self.session.log_dir / f".progress-{os.getpid()}.jsonl")
        node.workerinput["sglworker_progress"] = str(self.relay.path)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", {})
        if output.get("sglworker_stats"):
            self.session.worker_stats.append(output["sglworker_stats"])
        if output.get("sglworker_launches"):
            self.session.worker_launches.append(output["sglworker_launches"])

    # -- scheduling by worker configuration (--sgl-dist, xdist_scheduling.py) ------------------------------
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        from .xdist_scheduling import make_scheduler

        return make_scheduler(self.session, config, log)

    @pytest.hookimpl(specname="pytest_configure_node")
    def pytest_configure_node_scheduling(self, node: Any) -> None:
        """The xdist workers write which configuration each test needs where the scheduler reads it."""
        from .xdist_scheduling import configure_node

        configure_node(self.session, node)

    @pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collection to the controller
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if is_xdist_worker(session.config):
            from .xdist_scheduling import write_collection_map

            write_collection_map(self.session, session.items)

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        from .xdist_scheduling import header_line

        return header_line(self.session)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from .xdist_scheduling import summary_line

        line = summary_line(self.session)
        if line is not None and terminalreporter.config.get_verbosity() >= -1:
            terminalreporter.write_line(line)
