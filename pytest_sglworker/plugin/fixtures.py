"""The plugin's fixtures: ``sgl_model``, ``sgl_registry``, ``sgl_worker``, ``sgl_workers``, ``sgl_router`` and
``sgl_spawn_worker``.

One road from a fixture to its workers, whatever the source: the test's marker is read, its configuration resolved
(at collection, or now for a test collection did not see), a :class:`~pytest_sglworker.workers.sources.base.
GroupRequest` goes to the session's worker source, and after the test a
:class:`~pytest_sglworker.workers.sources.base.GroupUse` gives the group back; what the source says failed (a
member that died during the test) fails the test there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import pytest

from ..engine.specs import ModelSpec, SpecRegistry
from ..errors import InventoryUnavailable, SglWorkerError
from .keys import (
    CONFIG_KEY,
    NEXT_KEY,
    REPORTS_KEY,
    SHOWN_KEY,
    SIGNALS_KEY,
    WORKER_GROUP_KEY,
    WORKERS_KEY,
    item_spec,
    router_group_fixture,
)
from .markers import RouterMarker, WorkerMarker, WorkersMarker, opt_out_reason, poolable
from .session import SglSession, state_of

if TYPE_CHECKING:
    from ..workers.config import WorkerConfig
    from ..workers.group import WorkerGroup
    from ..workers.launcher import LaunchOptions, ModelInstance
    from ..workers.router import Router
    from ..workers.sources.base import GroupRequest

__all__ = ["SpawnWorker", "sgl_model", "sgl_registry", "sgl_router", "sgl_spawn_worker", "sgl_worker",
           "sgl_workers"]


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
    shows, ``-rA``) is its headline, with the cause."""
    text = str(exc)
    # "from None": called inside "except SglWorkerError", the failure would otherwise chain that error as
    # its context, and pytest prints a chain even with pytrace=False: the whole message twice.
    raise pytest.fail.Exception(text, pytrace=False) from None


def _fail_from(request: pytest.FixtureRequest, exc: BaseException) -> None:
    """Fail the test with a failure of the plugin's own (a worker that did not start or died, a router): the text
    shows that process's log, so the report adds no section for it, nor for the healthy ones."""
    shown = getattr(exc, "process", None)
    request.node.stash.setdefault(SHOWN_KEY, set()).add(id(shown) if shown is not None else 0)
    _fail_with(exc)


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


def _options(session: SglSession, startup_timeout: float | None,
             allow_foreign_host: str | None) -> LaunchOptions | None:
    """A test's own launch options (its workers are then never shared), or None for the session's."""
    if startup_timeout is None and allow_foreign_host is None:
        return None
    base = session.launch_options()
    return dataclasses.replace(base, startup_timeout=startup_timeout or base.startup_timeout,
                               allow_foreign_host=allow_foreign_host is not None)


def _acquire(request: pytest.FixtureRequest, group_request: GroupRequest) -> WorkerGroup:
    """The group from the session's worker source, its members remembered for the test's failure report."""
    from ..workers.sources.base import SourceRefusal

    session = state_of(request.config)
    try:
        group = session.source.acquire(group_request)
    except SourceRefusal as exc:
        if exc.refusal.action == "skip":
            pytest.skip(exc.refusal.reason)
        _fail_with(exc)
        raise
    except InventoryUnavailable as exc:
        pytest.skip(f"no GPU inventory: {exc}")
    except SglWorkerError as exc:
        _fail_from(request, exc)
        raise
    request.node.stash.setdefault(WORKERS_KEY, []).extend(group)
    return group


def _give_back(request: pytest.FixtureRequest, group: WorkerGroup, *, check_deaths: bool = True) -> None:
    """After the test: the group goes back to the source with how the test went; what the source says failed
    (a member died during a passing test) fails the test here."""
    from ..workers.sources.base import GroupUse

    session = state_of(request.config)
    call = request.node.stash.get(REPORTS_KEY, {}).get("call")
    # No call report: the test was interrupted (Ctrl-C, pytest.exit) and this teardown runs at session end;
    # keep the logs, and do not raise from here (a failure raised at session finish crashes pytest).
    use = GroupUse(request.node.nodeid, "interrupted" if call is None else call.outcome,
                   getattr(call, "start", None), getattr(call, "stop", None),
                   last_use=request.node.nodeid in session.last_users or _last_here(request, group),
                   next_config=_next_config(request.node),
                   check_deaths=check_deaths,
                   signals=tuple(request.node.stash.get(SIGNALS_KEY, ())))
    failure = session.source.give_back(group, use)
    if failure is not None:
        _fail_from(request, failure)


def _last_here(request: pytest.FixtureRequest, group: WorkerGroup) -> bool:
    """On an xdist worker under the plugin's scheduler: whether the controller named this test the last of the group's
    configuration that it sends here (every test of it handed out). The group then goes as the test ends, not a test
    later, when the controller has heard that it ran (issue 43: its GPUs stood idle through this worker's next test)."""
    from .launch_hints import last_tests

    return bool(last_tests(request.config).get(group.config.key) == request.node.nodeid)


def _next_config(item: pytest.Item) -> WorkerConfig | None:
    """The configuration the test this process runs next takes from the pool, if any."""
    nextitem = item.stash.get(NEXT_KEY, None)
    return nextitem.stash.get(CONFIG_KEY, None) if nextitem is not None and poolable(nextitem) else None


@contextlib.contextmanager
def _test_group(request: pytest.FixtureRequest, spec: ModelSpec, fixture: str) -> Iterator[WorkerGroup]:
    """The group of ``fixture`` (``sgl_worker`` or ``sgl_workers``) for this test, from the session's worker
    source, given back after it."""
    from ..workers.sources.base import GroupRequest

    try:
        marker = (WorkerMarker if fixture == "sgl_worker" else WorkersMarker).from_mark(
            request.node.get_closest_marker(fixture))
    except ValueError as exc:
        _fail_with(exc)
        raise
    config = _config_for(request, spec, fixture)
    foreign = marker.allow_foreign_host if isinstance(marker, WorkerMarker) else None
    session = state_of(request.config)
    try:
        opt_out = opt_out_reason(request.node) is not None
    except ValueError as exc:
        _fail_with(exc)
        raise
    group = _acquire(request, GroupRequest(config, _holder(request), fresh=marker.fresh,
                                           options=_options(session, marker.startup_timeout, foreign),
                                           budget_opt_out=opt_out, environ=session.worker_environ()))
    yield group
    _give_back(request, group)


@pytest.fixture
def sgl_worker(request: pytest.FixtureRequest, sgl_model: ModelSpec) -> Iterator[ModelInstance]:
    """A healthy sglang worker for the current ``sgl_model``, with extra args from
    ``@pytest.mark.sgl_worker(args=[...], env={...})``. Drawn from the session pool (reused by later tests
    of the same configuration unless ``fresh=True``).

    What a test uses (a ``pytest_sglworker.ModelInstance``): ``.url`` (``http://127.0.0.1:PORT``), ``.client``
    (an ``httpx.Client`` on that URL), ``.spec``, ``.port``, ``.pid``; ``.log_path`` (a ``pathlib.Path``: the
    worker's own log, ``sglang-worker-<port>.log``); ``.log_tail(lines=40)`` (the log's last lines as one
    string, secrets redacted); ``.requests_served()`` (the inference requests it has answered with a 2xx since
    it became ready, counted from its log: it runs on across the tests of a pooled worker, so compare before and
    after); ``.is_alive()``. The environment a worker starts with can be changed per spec by the hook
    ``pytest_sglworker_worker_env(spec, lease_env)`` in a conftest; specs are registered by
    ``pytest_sglworker_register_specs(registry)``."""
    with _test_group(request, sgl_model, "sgl_worker") as group:
        request.node.stash[WORKER_GROUP_KEY] = group
        yield group[0]


@pytest.fixture
def sgl_workers(request: pytest.FixtureRequest, sgl_model: ModelSpec) -> Iterator[WorkerGroup]:
    """The worker group of ``@pytest.mark.sgl_workers(count=N)`` or ``(prefill=P, decode=D)`` for the current
    ``sgl_model``: ``.workers`` (every member), ``.prefill`` and ``.decode`` (the members of that role), each a
    list even for one member (``sgl_workers.prefill[0]``); the group is also a sequence of its members
    (``group[0]``, ``len(group)``). Each member is what ``sgl_worker`` gives (``.url``, ``.client``,
    ``.log_path``, ``.log_tail()``: one string, ``.requests_served()``), with ``.role`` and, for prefill,
    ``.bootstrap_port``. Started in parallel; pooled and reused by later tests of the same configuration unless
    ``fresh=True``. Without the marker: one regular worker."""
    with _test_group(request, sgl_model, "sgl_workers") as group:
        yield group


def _start_router(request: pytest.FixtureRequest, group: WorkerGroup, marker: RouterMarker) -> Router:
    from ..workers.router import RouterUnavailable, start_router

    session = state_of(request.config)
    session.start_watchdog()
    try:
        return start_router(group, session.router_options(), session.records, policy=marker.policy,
                            args=marker.args, startup_timeout=marker.startup_timeout, holder=_holder(request),
                            environ=session.worker_environ(), members=marker.members(group),
                            dp_aware=marker.dp_aware)
    except RouterUnavailable as exc:
        pytest.skip(str(exc))
    except SglWorkerError as exc:
        _fail_from(request, exc)
        raise


def _scoped_router(request: pytest.FixtureRequest, group: WorkerGroup, marker: RouterMarker) -> Router:
    """The router of this test's class or module for this router marker and configuration: made by the scope's
    first test, kept while its workers are the same group and it is alive (a replaced group gets a new router), and
    closed when the scope ends. What a test changes in it (workers added or removed) the scope's next test finds."""
    session = state_of(request.config)
    kind = pytest.Class if marker.scope == "class" else pytest.Module
    scope_node = request.node.getparent(kind)
    if scope_node is None:
        _fail_with(ValueError(f"sgl_router(scope={marker.scope!r}) on a test outside a {marker.scope}"))
        raise AssertionError("unreachable")
    key = (scope_node.nodeid, group.config.key, marker)
    held: Router | None = session.routers.get(key)
    if held is not None and held.is_alive() and held.group is group:
        if held.stats is not None:
            held.stats.reuses += 1
        return held
    if held is not None:
        session.routers.pop(key)
        held.close()
    router = _start_router(request, group, marker)
    session.routers[key] = router

    def close() -> None:
        if session.routers.get(key) is router:
            session.routers.pop(key).close()

    scope_node.addfinalizer(close)
    return router


@pytest.fixture
def sgl_router(request: pytest.FixtureRequest, sgl_model: ModelSpec) -> Iterator[Router]:
    """The real sglang router (``sglang-router``) in front of this test's ``sgl_workers`` (or of its ``sgl_worker``,
    when the test uses that and not ``sgl_workers``): regular mode over ``.workers``, PD mode over
    ``.prefill``/``.decode``, ``--dp-aware`` when the workers have dp (unless ``dp_aware=False``). Configured by
    ``@pytest.mark.sgl_router(policy=..., args=[...], workers=..., dp_aware=..., scope=...)``: started with all
    the group's members, none (``workers="none"``; so is a gateway-mode router, ``--enable-igw``) or some, ready
    when it reports those healthy (listed, with ``--disable-health-check``); one per test, torn down after it, or
    one per class or module (``scope=``)."""
    fixture = router_group_fixture(request.fixturenames)
    worker = request.getfixturevalue(fixture)
    sgl_workers: WorkerGroup = request.node.stash[WORKER_GROUP_KEY] if fixture == "sgl_worker" else worker
    try:
        marker = RouterMarker.from_mark(request.node.get_closest_marker("sgl_router"))
        marker.members(sgl_workers)
    except ValueError as exc:
        _fail_with(exc)
        raise
    if marker.scope == "function":
        router = _start_router(request, sgl_workers, marker)
    else:
        router = _scoped_router(request, sgl_workers, marker)
    request.node.stash.setdefault(WORKERS_KEY, []).append(router)
    started = time.time()
    try:
        yield router
    finally:
        router.served(request.node.nodeid, started, time.time())
        if marker.scope == "function":
            router.close()


class SpawnWorker:
    """The ``sgl_spawn_worker`` factory: ``sgl_spawn_worker("qwen3-0.6b", args=[...], env={...})``."""

    def __init__(self, session: SglSession, request: pytest.FixtureRequest) -> None:
        self._session = session
        self._request = request
        self.instances: list[ModelInstance] = []
        self._groups: list[WorkerGroup] = []

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
        from ..workers.sources.base import GroupRequest

        spec = self._resolve(model)
        if isinstance(args, str):
            raise TypeError(f"sgl_spawn_worker(args=...) must be a list of arguments, not the string {args!r}")
        config = WorkerConfig.resolve(
            spec, args, env, opt_out=budget_opt_out,
            subject=f"sgl_spawn_worker({spec.name!r}, args={list(args)!r}) in {self._request.node.nodeid}",
            fix="drop the args that loosen the budget, or pass budget_opt_out='why this test needs it'")
        if args:
            rejected = self._session.check_flags({f"sgl_spawn_worker({spec.name!r}) in {self._request.node.nodeid}":
                                                  (spec, tuple(args))})
            if rejected:
                pytest.fail("\n".join(rejected.values()), pytrace=False)
        group = _acquire(self._request, GroupRequest(config, _holder(self._request), fresh=True, launch=True,
                                                     environ=self._session.worker_environ()))
        self._groups.append(group)
        self.instances.append(group[0])
        return group[0]

    def _resolve(self, model: str | ModelSpec | None) -> ModelSpec:
        if isinstance(model, ModelSpec):
            return model
        if model is None:
            spec = item_spec(self._request.node)
            if spec is not None:
                return spec
            selected = self._session.selected_specs()
            if not selected:
                pytest.skip("no sglang model selected: run with --sgl-model NAME, or pass a model name")
            return selected[0]
        return self._session.registry.get(model)

    def close(self) -> None:
        for group in self._groups:
            _give_back(self._request, group, check_deaths=False)


@pytest.fixture
def sgl_spawn_worker(request: pytest.FixtureRequest) -> Iterator[SpawnWorker]:
    """A factory for fresh, unshared workers with extra args and env, torn down at the end of the test."""
    factory = SpawnWorker(state_of(request.config), request)
    yield factory
    factory.close()
