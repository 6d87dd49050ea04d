"""The plugin's session object: one per pytest process, registered as a plugin whose hooks are its methods
(the way pytest-xdist registers its ``DSession``). A pytest-facing module, split from ``plugin.py``.

It holds the session's registry, settings, pool, GPU leases, watchdog and attached workers: parametrization
over the selected models, per-test worker configurations (:meth:`SglSession.resolve_config`, the one place
every entry point resolves one), launching ahead, the failure report sections, and the run report at the
end. The collection-time checks are in :mod:`collection`, the xdist hooks in :mod:`xdist_hooks`.

Why one module of this size: it is the one object that holds a pytest process's state (registry, settings, pool,
leases, watchdog, attached workers) and the hooks that read it; collection-time work is in :mod:`collection`, xdist
hooks in :mod:`xdist_hooks`, options in :mod:`options`, markers in :mod:`markers`, output in :mod:`reporter`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Generator, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import pytest

from ..engine import budget
from ..engine.specs import ModelSpec, SpecRegistry, set_active_registry
from ..errors import SglWorkerError, SpecError
from .markers import MarkerError, WorkerMarker, WorkersMarker, opt_out_reason, required_features
from .options import Settings

if TYPE_CHECKING:
    from ..resources.gpus import LeaseManager
    from ..workers.kinds import GroupShape, WorkerConfig, WorkerKind
    from ..workers.pool import WorkerPool

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


#: every fixture of the plugin (plugin.py)
PLUGIN_FIXTURES = frozenset({"sgl_model", "sgl_registry", "sgl_spawn_worker", *WORKER_FIXTURES})


def uses_plugin(item: pytest.Item) -> bool:
    """Whether a test asks for one of the plugin's fixtures; its markers mean nothing without one."""
    return not PLUGIN_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


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
        #: the test whose fixtures are being set up (its launch triggers the launches ahead)
        self.setting_up: pytest.Item | None = None
        self._run_hooks: RunHooks | None = None
        self._session_dir: Any = None
        self._previous_handlers: dict[int, Any] = {}
        #: spec name -> its attached workers (--sgl-worker-url), or the error that makes them unusable
        self._attached: dict[str, Any] = {}
        #: node id -> [seconds of setup + call + teardown, its configuration's key]: the report's "tests"
        self.test_times: dict[str, list[Any]] = {}
        self.shard_note: str | None = None
        #: the costs of --sgl-shard-report and the notes on reading them (collection.shard_costs), once read
        self.shard_costs: tuple[Any, list[str]] | None = None
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
        from ..workers.kinds import default_kind

        chosen = self.config.hook.pytest_sglworker_worker_kind(role=role, args=tuple(args))
        return chosen if chosen is not None else default_kind(role, args)

    def resolve_config(self, node: Any, spec: ModelSpec, fixture: str) -> WorkerConfig:
        """The worker configuration of a test (``node``) for ``fixture``: its marker read and validated, the
        budget checked for every member. Raises :class:`MarkerError` for a bad marker and
        :class:`BudgetViolation` for args that loosen the budget without an opt-out; callers decide how each
        fails (a usage error at collection, an error of the test otherwise)."""
        from ..workers.kinds import GroupShape, WorkerConfig

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
            from ..workers.attached import AttachedWorkerError, attach

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
        from ..resources.reaper import Watchdog, reap_dead_sessions
        from ..workers.launcher import LaunchOptions
        from ..workers.pool import WorkerPool
        from .reporter import message, progress, progress_end

        s = self.settings
        try:
            leases: Any = self.lease_manager()
        except SglWorkerError as exc:
            from ..errors import InventoryUnavailable

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
            on_leased=self._on_leased,
        )

    def _worker_env(self, spec: ModelSpec, lease_env: dict[str, str]) -> dict[str, str]:
        lease_env = {**self._declared_gpu_env(), **lease_env}
        result = self.config.hook.pytest_sglworker_worker_env(spec=spec, lease_env=dict(lease_env))
        return dict(lease_env) if result is None else dict(result)

    def _declared_gpu_env(self) -> dict[str, str]:
        """For declared GPUs (``--sgl-gpus sim:NxGiB``): the card size and the free memory the ledger predicts
        with, for the simulated engine, so its KV pool and log lines are those of that card (the run report's
        predicted and actual KV figures then agree). A real engine ignores them."""
        from ..resources.gpus import DeclaredInventory

        inventory = getattr(self._leases, "inventory", None)
        if not isinstance(inventory, DeclaredInventory):
            return {}
        from ..sim import ENV_GPU_FREE, ENV_GPU_MEM

        return {ENV_GPU_MEM: f"{inventory.total_mib / 1024:g}", ENV_GPU_FREE: str(inventory.total_mib)}

    def lease_manager(self) -> LeaseManager:
        """The session's GPU lease manager (one inventory, one lock directory). Raises InventoryUnavailable
        when the inventory cannot be read, ValueError when --sgl-gpus names GPUs that are not visible, and
        UnsafeDirectory for a lock directory that cannot be used."""
        if self._leases is None and self.settings.cluster is not None:
            from ..workers.ray_cluster import RayLeaseManager
            from .reporter import message

            # Ray's scheduler leases the GPUs; the local lock directory still holds the port blocks.
            self._leases = cast("LeaseManager", RayLeaseManager(self.settings.cluster, self._lock_dir(),
                                                                on_message=lambda text: message(self, text)))
        if self._leases is None:
            from ..resources.gpus import LeaseManager, load_inventory, parse_gpus_option

            selection = parse_gpus_option(self.settings.gpus or "")
            inventory = load_inventory(selection, os.environ)
            lock_dir = self._lock_dir()
            from .reporter import message

            self._leases = LeaseManager(lock_dir, inventory, namespace=selection.namespace,
                                        on_message=lambda text: message(self, text))
        return self._leases

    def _lock_dir(self) -> Path:
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

                self._session_dir = make_session_dir(_default_log_dir(), self.settings.log_retention_count)
                self._log_dir = self._session_dir.path
        return self._log_dir

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
            from ..resources.processes import sweep_session
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
            from .collection import shard_costs

            shard_costs(self)  # a bad report file stops the session here, before any worker starts
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
        s = self.settings
        if not (s.shard or s.worker_urls or any(uses_plugin(item) for item in items)):
            # A run that asks for no worker: nothing to order or launch; the specs registered by conftests found
            # during collection are still checked.
            problems = self.spec_problems()
            if problems and not is_xdist_worker(config):
                raise pytest.UsageError("\n".join(problems.values()))
            return
        from .collection import modify_items

        modify_items(self, config, items)
        self.enable_run_hooks()

    def enable_run_hooks(self) -> None:
        """Register the per-test hooks (:class:`RunHooks`) once."""
        if self._run_hooks is None:
            self._run_hooks = RunHooks(self)
            self.config.pluginmanager.register(self._run_hooks, "sglworker-run")

    def _on_leased(self, config: WorkerConfig) -> None:
        """A test's own launch holds its lease and starts now: the next configurations start alongside it on
        the GPUs left free, instead of one startup later."""
        item = self.setting_up
        if item is not None:
            self.launch_ahead(item)

    def launch_ahead(self, item: pytest.Item, nextitem: pytest.Item | None = None) -> None:
        """Start the workers of the next configurations the queue needs after ``item`` (``--sgl-launch-ahead``:
        how many beyond the current test's) on free GPUs, so that they are ready when their first test begins.
        Considered when a test's own launch has its lease, when its workers are in place, and after its
        teardown, where ``nextitem`` is the current test: its configuration is wanted first, then as many
        beyond it. Configurations already pooled or launching count without a new launch. An xdist worker
        knows its queue only one test ahead."""
        count = self.settings.launch_ahead
        pool = self._pool
        if count <= 0 or pool is None or not self.settings.reuse:
            return
        from .collection import poolable

        if nextitem is None:
            current, queue = item.stash.get(CONFIG_KEY, None), self._upcoming(item)
        else:
            current, queue, count = None, [nextitem, *self._upcoming(nextitem)], count + 1
        wanted: list[WorkerConfig] = []
        for upcoming in queue:
            config = upcoming.stash.get(CONFIG_KEY, None)
            if config is None or config == current or config in wanted or not poolable(upcoming):
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
        from ..workers.records import merge_stats

        sources = list(self.worker_stats)
        if self._pool is not None:
            sources.append({k: v.as_dict() for k, v in self._pool.stats.items()})
        return merge_stats(sources)

    def collected_launches(self) -> list[dict[str, Any]]:
        from ..workers.records import merge_launches

        sources = list(self.worker_launches)
        if self._pool is not None:
            sources.append([r.as_dict() for r in self._pool.launches])
        return merge_launches(sources)

    def run_report(self, exitstatus: int) -> dict[str, Any]:
        """The run report as one dict (the ``--sgl-report`` JSON; the timeline and the trace are drawn from it)."""
        import time

        from ..workers.records import SCHEMA

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
                    from ..workers.records import write_json

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
    from ..resources.state import default_log_dir

    return default_log_dir()


class RunHooks:
    """The per-test hooks: a test's worker failure sections, its launch ahead, its time for the run report.
    Registered (:meth:`SglSession.enable_run_hooks`) only in runs that use the plugin's fixtures or write a run
    report, so that a run that never asks for a worker pays no hook call per test."""

    def __init__(self, session: SglSession) -> None:
        self.session = session

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        item.stash[NEXT_KEY] = nextitem

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        """With this test's own workers in place (after its setup), start the next configurations ahead."""
        self.session.launch_ahead(item)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """After this test's fixtures are torn down its workers are pooled again, or retired when it was the
        last test of their configuration: a GPU may just have come free. Seen from the next test, whose
        configuration comes first (it is about to be needed), then the ones after it."""
        if nextitem is not None:
            self.session.launch_ahead(item, nextitem=nextitem)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(ITEM_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)

    @pytest.hookimpl(wrapper=True, specname="pytest_runtest_setup")
    def pytest_runtest_setup_tracked(self, item: pytest.Item) -> Generator[None, None, None]:
        """Which test's fixtures are being set up: its own launch starts the launches ahead."""
        self.session.setting_up = item
        try:
            return (yield)
        finally:
            self.session.setting_up = None

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

            junit = bool(getattr(self.session.config.option, "xmlpath", None))
            for instance in workers:
                title, body = worker_section(instance, self.session.settings.tail_lines)
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
        if is_xdist_worker(self.session.config):
            return
        entry = self.session.test_times.setdefault(report.nodeid, [0.0, None])
        entry[0] += report.duration
        entry[1] = entry[1] or getattr(report, "sglworker_config", None)
