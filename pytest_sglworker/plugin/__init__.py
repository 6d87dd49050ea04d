"""The pytest entry point of pytest-sglworker: it registers the session object and the reporter, and defines
the fixtures. Only this module and the pytest-facing modules split from it (``options``, ``markers``,
``session``, ``reporter``, ``hookspecs``) import pytest.

It is loaded into every pytest run of an environment that installs the package, so it imports nothing heavy
at module level: httpx, psutil, pynvml, filelock and sglang are imported when a worker is first needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import pytest

from ..engine.specs import ModelSpec, SpecRegistry, set_active_registry
from ..errors import BudgetViolation, SglWorkerError
from .markers import MARKER_DOCS, RouterMarker, WorkerMarker, WorkersMarker
from .session import (
    CONFIG_KEY,
    REPORTS_KEY,
    STATE_KEY,
    WORKERS_KEY,
    SglSession,
    state_of,
)

if TYPE_CHECKING:
    from ..workers.config import WorkerConfig
    from ..workers.launcher import LaunchOptions, ModelInstance
    from ..workers.pool import WorkerGroup, WorkerPool
    from ..workers.router import Router


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    from .options import add_options

    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    from .options import resolve_settings
    from .reporter import SglReporter

    for doc in MARKER_DOCS:
        config.addinivalue_line("markers", doc)
    session = SglSession(config, resolve_settings(config))
    config.stash[STATE_KEY] = session
    session.register_all()
    set_active_registry(session.registry)
    config.pluginmanager.register(session, "sglworker-session")
    if session.settings.report or session.settings.timeline or session.settings.trace:
        session.enable_run_hooks()  # every test's time goes into the run report (an xdist controller collects none)
    config.pluginmanager.register(SglReporter(session), "sglworker-reporter")
    if config.pluginmanager.hasplugin("xdist"):
        from .xdist_hooks import XdistHooks

        config.pluginmanager.register(XdistHooks(session), "sglworker-xdist")
    session.install_signal_handlers()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    if not config.getoption("sgl_list_models"):
        return None
    from .options import resolve_settings
    from .reporter import render_registry

    settings = resolve_settings(config)
    session = SglSession(config, settings)
    session.register_all()
    print(render_registry(session.registry, settings, verbose=config.get_verbosity() > 0))
    return 0


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
    return state_of(pytestconfig).registry


def _holder(request: pytest.FixtureRequest) -> str:
    return f"{request.node.nodeid} (pid {os.getpid()})"


def _fail_with(exc: BaseException) -> None:
    """Fail the test with the error's text; a worker failure's first line (the one pytest's short summary
    shows, ``-rA``) is its one-line diagnosis."""
    from ..workers.errors import WorkerError

    text = str(exc)
    if isinstance(exc, WorkerError) and exc.worker:
        text = f"{exc.summary}\n{text}"
    # "from None": called inside "except SglWorkerError", the failure would otherwise chain that error as
    # its context, and pytest prints a chain even with pytrace=False: the whole message twice.
    raise pytest.fail.Exception(text, pytrace=False) from None


def _pool(session: SglSession) -> WorkerPool:
    from ..errors import InventoryUnavailable

    try:
        return session.pool
    except InventoryUnavailable as exc:
        pytest.skip(f"no GPU inventory: {exc}")


def _config_for(request: pytest.FixtureRequest, spec: ModelSpec, fixture: str) -> WorkerConfig:
    """The configuration resolved at collection, or, for a test collection did not see (a fixture requested
    with ``request.getfixturevalue``), resolved now: a bad marker or budget then fails this test."""
    session = state_of(request.config)
    item: pytest.Item = request.node
    config = item.stash.get(CONFIG_KEY, None)
    if config is not None and (fixture == "sgl_worker") == (config.group is None):
        return config
    try:
        return session.resolve_config(request.node, spec, fixture)
    except (SglWorkerError, ValueError) as exc:
        _fail_with(exc)
        raise


def _options(pool: WorkerPool, startup_timeout: float | None, allow_foreign_host: str | None) -> LaunchOptions | None:
    if startup_timeout is None and allow_foreign_host is None:
        return None
    return dataclasses.replace(pool.options, startup_timeout=startup_timeout or pool.options.startup_timeout,
                               allow_foreign_host=allow_foreign_host is not None)


def _attached_group(request: pytest.FixtureRequest, config: WorkerConfig) -> WorkerGroup | None:
    """The spec's attached workers (``--sgl-worker-url``) as this test's group, or None when it has none.
    Collection has already skipped the shapes they cannot take; a test collection did not see is checked now."""
    session = state_of(request.config)
    if config.spec.name not in session.settings.worker_urls:
        return None
    from ..workers.pool import WorkerGroup

    try:
        refusal = session.attached_refusal(request.node, config)
        workers = session.attached_workers(config.spec) or []
    except SglWorkerError as exc:
        _fail_with(exc)
        raise
    if refusal is not None:
        if refusal[0] == "skip":
            pytest.skip(refusal[1])
        _fail_with(BudgetViolation(refusal[1]))
    wanted = config.group.count if config.group is not None else 1
    group = WorkerGroup(config, workers[:wanted], f"attached-{config.key}")
    stats = _pool(session).stats_for(config)
    if "(attached" not in stats.label:
        stats.label += f" (attached: {', '.join(w.url for w in group)})"
    stats.reuses += 1
    request.node.stash.setdefault(WORKERS_KEY, []).extend(group)
    return group


def _check_attached_after(request: pytest.FixtureRequest, group: WorkerGroup) -> None:
    """An attached worker that stops answering during a passing test fails it: the next tests would fail on
    it too, with less to go on."""
    call = request.node.stash.get(REPORTS_KEY, {}).get("call")
    if call is None or call.failed:
        return
    silent = [m for m in group if not m.responds()]
    if silent:
        _fail_with(SglWorkerError(f"{silent[0].describe()} stopped answering its health check during the test"))


def _acquire(request: pytest.FixtureRequest, config: WorkerConfig, *, fresh: bool,
             options: LaunchOptions | None) -> tuple[WorkerPool, WorkerGroup]:
    pool = _pool(state_of(request.config))
    try:
        group = pool.acquire(config, holder=_holder(request), fresh=fresh, options=options)
    except SglWorkerError as exc:
        _fail_with(exc)
        raise
    request.node.stash.setdefault(WORKERS_KEY, []).extend(group)
    return pool, group


def _give_back(request: pytest.FixtureRequest, pool: WorkerPool, group: WorkerGroup, *, fresh: bool,
               fail_on_death: bool = True) -> None:
    """After the test: record it, then pool the group again, or retire it (unshared, no later test needs its
    configuration, or a member died). A member that died during a passing test fails it here (not for the
    spawn factory's workers, whose test owns their life)."""
    session = state_of(request.config)
    call = request.node.stash.get(REPORTS_KEY, {}).get("call")
    # No call report: the test was interrupted (Ctrl-C, pytest.exit) and this teardown runs at session end;
    # keep the logs, and do not raise from here (a failure raised at session finish crashes pytest).
    failed = call is None or call.failed
    outcome = "interrupted" if call is None else call.outcome
    pool.served(group, request.node.nodeid, getattr(call, "start", None), getattr(call, "stop", None), outcome)
    dead = [m for m in group if not m.is_alive() and not m.stopped]
    if dead or not group.is_alive():
        pool.discard(group, failed=failed or bool(dead))
        if dead and not failed and fail_on_death:
            from ..resources.processes import signal_name
            from ..workers.errors import WorkerDied

            member = dead[0]
            _fail_with(member.failure(WorkerDied, f"exited with {signal_name(member.returncode)} during the test",
                                      lines=session.settings.tail_lines))
    elif fresh or request.node.nodeid in session.last_users:
        pool.discard(group, failed=failed)  # unshared, or no later test needs this configuration
    else:
        pool.release(group, failed=failed)


@contextlib.contextmanager
def _test_group(request: pytest.FixtureRequest, spec: ModelSpec, fixture: str) -> Iterator[WorkerGroup]:
    """The group of ``fixture`` (``sgl_worker`` or ``sgl_workers``) for this test: its marker read, its
    configuration resolved, then the spec's attached workers, or a group from the pool given back after it."""
    try:
        marker = (WorkerMarker if fixture == "sgl_worker" else WorkersMarker).from_mark(
            request.node.get_closest_marker(fixture))
    except ValueError as exc:
        _fail_with(exc)
        raise
    config = _config_for(request, spec, fixture)
    attached = _attached_group(request, config)
    if attached is not None:
        yield attached
        _check_attached_after(request, attached)
        return
    foreign = marker.allow_foreign_host if isinstance(marker, WorkerMarker) else None
    pool = _pool(state_of(request.config))
    pool, group = _acquire(request, config, fresh=marker.fresh, options=_options(pool, marker.startup_timeout, foreign))
    yield group
    _give_back(request, pool, group, fresh=marker.fresh)


@pytest.fixture
def sgl_worker(request: pytest.FixtureRequest, sgl_model: ModelSpec) -> Iterator[ModelInstance]:
    """A healthy sglang worker for the current ``sgl_model``, with extra args from
    ``@pytest.mark.sgl_worker(args=[...], env={...})``. Drawn from the session pool (reused by later tests
    of the same configuration unless ``fresh=True``)."""
    with _test_group(request, sgl_model, "sgl_worker") as group:
        yield group[0]


@pytest.fixture
def sgl_workers(request: pytest.FixtureRequest, sgl_model: ModelSpec) -> Iterator[WorkerGroup]:
    """The worker group of ``@pytest.mark.sgl_workers(count=N)`` or ``(prefill=P, decode=D)`` for the current
    ``sgl_model``: ``.workers``, ``.prefill``, ``.decode``; each member has ``.role``, ``.url``,
    ``.bootstrap_port`` (prefill) and ``log_tail()``. Started in parallel; pooled and reused by later tests
    of the same configuration unless ``fresh=True``. Without the marker: one regular worker."""
    with _test_group(request, sgl_model, "sgl_workers") as group:
        yield group


@pytest.fixture
def sgl_router(request: pytest.FixtureRequest, sgl_workers: WorkerGroup) -> Iterator[Router]:
    """The real sglang router (``sglang-router``) in front of this test's ``sgl_workers``: regular mode over
    ``.workers``, PD mode over ``.prefill``/``.decode``, ``--dp-aware`` when the workers have dp. Configured
    by ``@pytest.mark.sgl_router(policy=..., args=[...])``; started fresh for each test, ready when it reports
    every worker healthy, torn down after it."""
    from ..workers.router import RouterUnavailable, start_router

    session = state_of(request.config)
    try:
        marker = RouterMarker.from_mark(request.node.get_closest_marker("sgl_router"))
    except ValueError as exc:
        _fail_with(exc)
        raise
    try:
        router = start_router(session, sgl_workers, policy=marker.policy, args=marker.args,
                              startup_timeout=marker.startup_timeout, holder=_holder(request))
    except RouterUnavailable as exc:
        pytest.skip(str(exc))
    except SglWorkerError as exc:
        _fail_with(exc)
        raise
    request.node.stash.setdefault(WORKERS_KEY, []).append(router)
    try:
        yield router
    finally:
        router.close(session, request.node.nodeid)


class SpawnWorker:
    """The ``sgl_spawn_worker`` factory: ``sgl_spawn_worker("qwen3-0.6b", args=[...], env={...})``."""

    def __init__(self, session: SglSession, request: pytest.FixtureRequest) -> None:
        self._session = session
        self._request = request
        self.instances: list[ModelInstance] = []
        self._groups: list[tuple[WorkerPool, WorkerGroup]] = []

    def __call__(
        self,
        model: str | ModelSpec | None = None,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        budget_opt_out: str | None = None,
    ) -> ModelInstance:
        """Start a fresh worker of ``model`` (default: this test's ``sgl_model``, else the first selected).
        Raises :class:`~pytest_sglworker.BudgetViolation` when ``args`` loosen the budget without
        ``budget_opt_out``, :class:`~pytest_sglworker.SpecError` for an unknown model; a worker that fails to
        start fails the test with its diagnosis."""
        from ..workers.config import WorkerConfig

        spec = self._resolve(model)
        if isinstance(args, str):
            raise TypeError(f"sgl_spawn_worker(args=...) must be a list of arguments, not the string {args!r}")
        config = WorkerConfig.resolve(
            spec, args, env, opt_out=budget_opt_out,
            subject=f"sgl_spawn_worker({spec.name!r}, args={list(args)!r}) in {self._request.node.nodeid}",
            fix="drop the args that loosen the budget, or pass budget_opt_out='why this test needs it'")
        pool = _pool(self._session)
        if args:
            rejected = self._session.check_flags({f"sgl_spawn_worker({spec.name!r}) in {self._request.node.nodeid}":
                                                  (spec, tuple(args))})
            if rejected:
                pytest.fail("\n".join(rejected.values()), pytrace=False)
        pool, group = _acquire(self._request, config, fresh=True, options=None)
        self._groups.append((pool, group))
        self.instances.append(group[0])
        return group[0]

    def _resolve(self, model: str | ModelSpec | None) -> ModelSpec:
        if isinstance(model, ModelSpec):
            return model
        if model is None:
            callspec = getattr(self._request.node, "callspec", None)
            spec = callspec.params.get("sgl_model") if callspec is not None else None
            if isinstance(spec, ModelSpec):
                return spec
            selected = self._session.selected_specs()
            if not selected:
                pytest.skip("no sglang model selected: run with --sgl-model NAME, or pass a model name")
            return selected[0]
        return self._session.registry.get(model)

    def close(self) -> None:
        for pool, group in self._groups:
            _give_back(self._request, pool, group, fresh=True, fail_on_death=False)


@pytest.fixture
def sgl_spawn_worker(request: pytest.FixtureRequest) -> Iterator[SpawnWorker]:
    """A factory for fresh, unshared workers with extra args and env, torn down at the end of the test."""
    factory = SpawnWorker(state_of(request.config), request)
    yield factory
    factory.close()


__all__ = ["SpawnWorker", "sgl_model", "sgl_registry", "sgl_router", "sgl_spawn_worker", "sgl_worker",
           "sgl_workers"]
