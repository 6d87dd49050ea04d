"""The runtime behind the gateway drop-in: who owns the workers and routers that upstream's ``ModelPool``
(:mod:`.pool`) and ``Gateway`` (:mod:`.gateway`) hand out, served by the running pytest session.

- A worker is a member of a worker group from the session's worker source (``session.source.acquire``): the
  suite's model id resolved to a registered, budgeted spec (:func:`spec_for`), ``--grpc-mode`` for a gRPC worker,
  a prefill/decode group for PD, a GPU lease, a port block, a log file per port, the readiness wait that watches
  the process and a startup failure with its diagnosis. Groups are pooled: given back when their owner ends,
  they serve the next class of the same configuration without a new launch.
- Who owns a group: the scope that asked for it. ``setup_backend`` owns its class's group; ``model_pool.get()``
  called by a test is owned by that test, and given back after its teardown (:class:`GatewayRuntime` hooks).
  While the owner lives, another ``get()`` of the same configuration gets the same worker (upstream's pool hands
  out one instance per model and mode).
- A ``Gateway`` is the real router (``sglang-router``) started by
  :func:`pytest_sglworker.workers.router.start_router`: loopback only, ports from the plugin's port blocks, its own
  log file, its readiness (``/health``, then its workers listed healthy), its figures in the run report. One left
  running by its owner is stopped when the owner ends, and the run says so.
- Every worker and router a test meets gets a section in that test's failure report.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from ...errors import InventoryUnavailable, SglWorkerError
from ...plugin.keys import WORKERS_KEY
from ...plugin.run_hooks import enable_run_hooks
from ...plugin.session import SglSession, active_session, session_plugin, when_session_starts
from ...workers.config import GroupShape, WorkerConfig
from ...workers.group import WorkerGroup
from ...workers.sources.base import GroupRequest, GroupUse, SourceRefusal
from ..models import CompatError, resolve_spec
from .constants import DEFAULT_MODEL, ENV_MODEL, ENV_STARTUP_TIMEOUT, MODEL_SPECS, ConnectionMode, WorkerType

if TYPE_CHECKING:
    from ...engine.specs import ModelSpec
    from ...workers.launcher import ModelInstance as Member
    from ...workers.router import Router, RouterOptions

__all__ = ["RUNTIME_NAME", "GatewayRuntime", "ModelInstance", "WorkerIdentity", "config_for", "install",
           "model_path_of", "runtime", "runtime_or_error", "spec_for"]

RUNTIME_NAME = "sglworker-compat-gateway"


class RouterHolder(Protocol):
    """What the runtime needs of a ``Gateway``: who started it and its router (None once shut down)."""

    owner: str
    router: Router | None


def runtime_or_error(what: str) -> GatewayRuntime:
    active = runtime()
    if active is None:
        raise CompatError(f"{what} needs a pytest session with pytest-sglworker and its gateway drop-in: run the "
                          "suite with pytest -p pytest_sglworker.compat.gateway")
    return active


def spec_for(model_id: str, session: SglSession) -> ModelSpec:
    """The registered spec that serves the suite's model id: the id itself resolved as the unittest drop-in resolves
    a model name (``SGLWORKER_COMPAT_MODELS``, ``map_model``, a spec of that name, a spec whose model it is), else
    the Hugging Face model upstream's table names for it resolved the same way."""
    if not isinstance(model_id, str) or not model_id:
        raise CompatError(f"a model id is a non-empty string such as 'llama-8b', got {model_id!r}")
    try:
        return resolve_spec(model_id, session.registry)
    except CompatError as first:
        upstream = MODEL_SPECS.get(model_id)
        if upstream is None:
            raise CompatError(f"{first} (and {model_id!r} is not one of the suite's model ids: "
                              f"{', '.join(MODEL_SPECS)})") from None
        try:
            return resolve_spec(upstream["model"], session.registry)
        except CompatError:
            raise CompatError(
                f"no registered model spec serves the suite's model {model_id!r} ({upstream['model']}): map it, "
                f"e.g. SGLWORKER_COMPAT_MODELS='{model_id}=<spec>' or pytest_sglworker.compat.map_model("
                f"{model_id!r}, '<spec>') in a conftest.py, or register a spec whose model is {upstream['model']!r} "
                f"(known specs: {', '.join(session.registry.names()) or '(none)'})") from None


def config_for(session: SglSession, model_id: str, mode: ConnectionMode, shape: GroupShape, *,
               owner: str, extra: tuple[str, ...] = ()) -> WorkerConfig:
    """The worker configuration of a group of ``shape`` of ``model_id``'s workers in ``mode`` (``--grpc-mode`` for
    gRPC), its budget checked: what collection resolves for a test and what the pool then asks the source for.
    Raises :class:`CompatError` for a model id no spec serves, ``BudgetViolation`` for a budget it breaks."""
    spec = spec_for(model_id, session)
    extra = (*extra, "--grpc-mode") if mode == ConnectionMode.GRPC else extra
    return WorkerConfig.resolve(spec, extra, group=shape, subject=f"{model_id}:{mode.value} for {owner}")


def model_path_of(model_id: str) -> str:
    """The path the worker of ``model_id`` loads (its spec's model, or its local copy); upstream's Hugging Face id
    outside a session, or for an id no spec serves."""
    session = active_session()
    fallback = str(MODEL_SPECS.get(model_id, {}).get("model", model_id))
    if session is None:
        return fallback
    try:
        return spec_for(model_id, session).resolve_model_path(session.worker_environ())
    except CompatError:
        return fallback


@dataclass(frozen=True)
class WorkerIdentity:
    """Which worker a test asks for: ``(model_id, mode, worker_type, index)``."""

    model_id: str
    mode: ConnectionMode = ConnectionMode.HTTP
    worker_type: WorkerType = WorkerType.REGULAR
    index: int = 0


class ModelInstance:
    """Upstream's running worker, over a member of one of the plugin's worker groups: ``model_id``, ``mode``,
    ``model_path``, ``base_url``, ``port``, ``worker_url`` (``grpc://`` for a gRPC worker), ``worker_type``,
    ``bootstrap_port``, ``key``, ``is_alive()``, ``health_check()``, ``acquire()``/``release()``; ``worker`` is the
    plugin's :class:`~pytest_sglworker.ModelInstance` (its log, its process)."""

    def __init__(self, model_id: str, mode: ConnectionMode, member: Member, model_path: str) -> None:
        self.model_id = model_id
        self.mode = mode
        self.worker = member
        self.model_path = model_path
        self.refs = 0

    @property
    def worker_type(self) -> WorkerType:
        return {"prefill": WorkerType.PREFILL, "decode": WorkerType.DECODE}.get(self.worker.role, WorkerType.REGULAR)

    @property
    def port(self) -> int:
        return self.worker.port

    @property
    def base_url(self) -> str:
        return f"http://{self.worker.host}:{self.worker.port}"

    @property
    def worker_url(self) -> str:
        return self.worker.url

    @property
    def bootstrap_port(self) -> int | None:
        return self.worker.bootstrap_port

    @property
    def process(self) -> Any:
        return self.worker.process

    @property
    def key(self) -> str:
        if self.worker_type == WorkerType.REGULAR:
            return f"{self.model_id}:{self.mode.value}"
        return f"{self.model_id}:{self.mode.value}:{self.worker_type.value}"

    def is_alive(self) -> bool:
        return self.worker.is_alive()

    def health_check(self, timeout: float = 5.0) -> bool:
        """Alive and answering its readiness check within ``timeout`` seconds (HTTP or gRPC, by its kind)."""
        return self.worker.responds(timeout)

    deep_health_check = health_check

    def acquire(self) -> None:
        self.refs += 1

    def release(self) -> None:
        self.refs = max(0, self.refs - 1)

    def __repr__(self) -> str:
        return f"<infra.ModelInstance {self.key} {self.worker.describe()}>"


@dataclass(eq=False)
class _Held:
    """A group the pool handed out, and who owns it."""

    group: WorkerGroup
    model_id: str
    mode: ConnectionMode
    instances: list[ModelInstance]
    owner: str
    started: float
    failed: bool = False


class GatewayRuntime:
    """The drop-in's state in one session: the groups handed out and who owns each, the routers started, and the
    hooks that give them back when their owner ends. Registered as a plugin when a session starts."""

    def __init__(self, session: SglSession) -> None:
        self.session = session
        self.held: list[_Held] = []
        self.gateways: list[RouterHolder] = []
        self._item: pytest.Item | None = None
        self._owners: list[str] = []

    # -- owners ---------------------------------------------------------------------------------------------
    @property
    def item(self) -> pytest.Item | None:
        """The test being run (its setup, call or teardown), None between tests."""
        return self._item

    def current_owner(self) -> str:
        if self._owners:
            return self._owners[-1]
        return self._item.nodeid if self._item is not None else "the session"

    def owning(self, owner: str) -> Any:
        """A context in which what is acquired belongs to ``owner`` (a class-scoped fixture's class)."""
        rt = self

        class _Owning:
            def __enter__(self) -> None:
                rt._owners.append(owner)

            def __exit__(self, *exc: object) -> None:
                rt._owners.pop()

        return _Owning()

    # -- hooks ----------------------------------------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        self._item = item
        try:
            return (yield)
        finally:
            self._item = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        self._remember_on(item)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        try:
            return (yield)
        finally:
            self.release(item.nodeid, after=f"the test {item.nodeid}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            for held in self.held:
                held.failed = True

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        for owner in {held.owner for held in self.held} | {gw.owner for gw in self.gateways}:
            self.release(owner, after="the session", check=False)

    def _remember_on(self, item: pytest.Item) -> None:
        seen = item.stash.setdefault(WORKERS_KEY, [])
        for process in [m for held in self.held for m in held.group] + [g.router for g in self.gateways]:
            if process is not None and process not in seen:
                seen.append(process)

    # -- workers --------------------------------------------------------------------------------------------
    def group(self, model_id: str, mode: ConnectionMode, shape: GroupShape, *, fresh_owner: bool = False,
              extra: tuple[str, ...] = ()) -> _Held:
        """A group of ``shape`` of ``model_id`` in ``mode``: one an owner still holds (upstream's pool hands out one
        instance per model and mode; not with ``fresh_owner``), else one from the session's source, owned by the
        current owner."""
        session = self.session
        owner = self.current_owner()
        try:
            config = config_for(session, model_id, mode, shape, owner=owner, extra=extra)
        except (SglWorkerError, ValueError) as exc:  # CompatError is a ValueError
            raise pytest.fail.Exception(str(exc), pytrace=False) from None
        spec = config.spec
        if not fresh_owner:
            for held in self.held:
                if held.group.config == config and held.group.is_alive():
                    return held
        options = None
        timeout = os.environ.get(ENV_STARTUP_TIMEOUT, "").strip()
        if timeout:
            try:
                seconds = float(timeout)
            except ValueError:
                raise pytest.fail.Exception(f"{ENV_STARTUP_TIMEOUT}={timeout!r} is not a number of seconds",
                                            pytrace=False) from None
            options = dataclasses.replace(session.launch_options(), startup_timeout=seconds)
        request = GroupRequest(config, f"{owner} (pid {os.getpid()})", options=options,
                               environ=session.worker_environ())
        try:
            group = session.source.acquire(request)
        except SourceRefusal as exc:
            if exc.refusal.action == "skip":
                pytest.skip(exc.refusal.reason)
            raise pytest.fail.Exception(str(exc), pytrace=False) from None
        except InventoryUnavailable as exc:
            pytest.skip(f"no GPU inventory: {exc}")
        except SglWorkerError as exc:
            raise pytest.fail.Exception(str(exc), pytrace=False) from None
        path = spec.resolve_model_path(request.environ)
        held = _Held(group, model_id, mode, [ModelInstance(model_id, mode, m, path) for m in group], owner,
                     time.time())
        self.held.append(held)
        enable_run_hooks(session)
        if self._item is not None:
            self._remember_on(self._item)
        return held

    def member_of(self, instance: Any) -> Member:
        if isinstance(instance, ModelInstance):
            return instance.worker
        raise CompatError(f"Gateway.start(prefill_workers=..., decode_workers=...) takes the pool's instances "
                          f"(model_pool.get_workers_by_type / launch_workers), got {instance!r}")

    def member_by_url(self, url: str) -> Member:
        for held in self.held:
            for inst in held.instances:
                if url.rstrip("/") in (inst.worker_url, inst.base_url):
                    return inst.worker
        raise CompatError(f"Gateway.start(worker_urls=[{url!r}, ...]): no worker of this session serves {url}; pass "
                          "the worker_url of an instance from model_pool (the plugin routes only to workers it "
                          "launched or attached)")

    # -- routers --------------------------------------------------------------------------------------------
    def start_router(self, gateway: RouterHolder, members: Sequence[Member], *, policy: str | None, args: Sequence[str],
                     timeout: float, options: RouterOptions | None = None) -> Router:
        """The real router in front of ``members``, owned by ``gateway``'s owner; ``options``: the session's own
        unless given (a port pinned by a test's URL)."""
        from ...workers.router import RouterUnavailable, start_router

        session = self.session
        groups = [h.group for h in self.held if any(m in h.group.members for m in members)]
        if groups:
            group = WorkerGroup(groups[0].config, members, "+".join(dict.fromkeys(g.id for g in groups)))
        else:  # a router with no worker of ours (IGW, cloud): named after the suite's default model's spec
            group = WorkerGroup(WorkerConfig.of(self._any_spec()), [], "gateway")
        session.start_watchdog()
        try:
            router = start_router(group, options or session.router_options(), session.records, policy=policy, args=args,
                                  startup_timeout=float(timeout) if timeout else None,
                                  holder=f"{gateway.owner} (pid {os.getpid()})", environ=session.worker_environ(),
                                  members=list(members))
        except RouterUnavailable as exc:
            pytest.skip(str(exc))
        except SglWorkerError as exc:
            raise pytest.fail.Exception(str(exc), pytrace=False) from None
        self.gateways.append(gateway)
        enable_run_hooks(session)
        if self._item is not None:
            self._item.stash.setdefault(WORKERS_KEY, []).append(router)
        return router

    def _any_spec(self) -> ModelSpec:
        try:
            return spec_for(os.environ.get(ENV_MODEL, DEFAULT_MODEL), self.session)
        except CompatError:
            return next(iter(self.session.registry))

    def close_router(self, gateway: RouterHolder) -> None:
        router, gateway.router = gateway.router, None
        if gateway in self.gateways:
            self.gateways.remove(gateway)
        if router is not None:
            router.served(gateway.owner, None, time.time())
            router.close()

    # -- giving back ------------------------------------------------------------------------------------------
    def release(self, owner: str, *, after: str, check: bool = True) -> None:
        """Stop the routers ``owner`` left running (said in the run's messages) and give its groups back; a member
        that died during a passing test fails the owner's teardown (unless ``check`` is False)."""
        for gateway in [g for g in self.gateways if g.owner == owner]:
            if gateway.router is not None:
                self.session.terminal.message(f"pytest_sglworker.compat.gateway: {gateway.router.describe()}, "
                                              f"started by {owner}, was still running after {after}; stopped it "
                                              f"({getattr(gateway, 'fix', 'call gateway.shutdown()')})")
            self.close_router(gateway)
        failure: BaseException | None = None
        for held in [h for h in self.held if h.owner == owner]:
            died = self._give_back(held, check=check)
            if died is not None and failure is None:
                failure = died
        if failure is not None:
            raise pytest.fail.Exception(str(failure), pytrace=False)

    def give_back(self, held: _Held, *, check: bool = True) -> None:
        """Give one group back to the pool now (its owner is done with it); a member that died during a passing
        test fails the caller (unless ``check`` is False)."""
        died = self._give_back(held, check=check) if held in self.held else None
        if died is not None:
            raise pytest.fail.Exception(str(died), pytrace=False)

    def _give_back(self, held: _Held, *, check: bool) -> BaseException | None:
        self.held.remove(held)
        use = GroupUse(held.owner, "failed" if held.failed else "passed", held.started, time.time(),
                       check_deaths=check)
        return self.session.source.give_back(held.group, use)


def install(session: SglSession) -> GatewayRuntime:
    """The session's :class:`GatewayRuntime`, registered as a plugin on first call."""
    return session_plugin(session, RUNTIME_NAME, GatewayRuntime)


def runtime() -> GatewayRuntime | None:
    """The runtime of the pytest session in progress in this process, or None outside one."""
    session = active_session()
    return install(session) if session is not None else None


when_session_starts(install)
