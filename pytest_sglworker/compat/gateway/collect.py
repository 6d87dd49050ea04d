"""What the gateway drop-in does at collection, before any worker starts, as the plugin does for its own markers.

For every test that asks for a worker through the suite's fixtures (``setup_backend``, ``backend_router``,
``model_client``, ``model_base_url``), its request is read from its markers and parameters alone (:func:`wanted`: the
model id, ``http``/``grpc``/``pd``, the workers' shape) and resolved to the worker configuration the fixture will
ask the pool for (:func:`~.runtime.config_for`). Then:

- a malformed ``workers`` marker, or a model id no registered spec serves, is a usage error naming the test and
  the fix (on an xdist worker, which cannot stop the session, that test's error);
- ``E2E_MODELS`` / ``E2E_BACKENDS``, upstream's list of the models and backends its pool starts, select: a test
  whose ``http``/``grpc`` worker is outside them is skipped with the reason, as upstream's pool serves only those;
- the configuration goes into the test's stash (``CONFIG_KEY``), as the plugin's own collection puts it for its
  fixtures: the plugin then reorders tests by configuration, skips what the GPU inventory can never hold, launches
  ahead, and schedules under xdist by configuration (its own scheduler), or groups each configuration's tests on one
  xdist worker under ``--dist loadgroup`` (``xdist_group`` ``sgl-<key>``, as for its own fixtures).

Every test of a file under an ``e2e_grpc/`` folder (:mod:`.scoped_modules`) goes, on an xdist worker, into one
``xdist_group`` (:data:`E2E_GRPC_GROUP`): that suite's classes all start their router on sglang's fixed URL, so they
run one after another on one xdist worker (the plugin's scheduler and ``--dist loadgroup`` both keep a group whole).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from ...errors import SglWorkerError
from ...plugin.collection import raise_or_give
from ...plugin.keys import CONFIG_KEY, is_xdist_worker
from ...plugin.run_hooks import enable_run_hooks
from ...plugin.session import session_plugin, when_session_starts
from ...workers.config import GroupShape
from ..models import CompatError
from .constants import (
    DEFAULT_MODEL,
    ENV_BACKENDS,
    ENV_MODEL,
    ENV_MODELS,
    ENV_SKIP_BACKEND_SETUP,
    ENV_SKIP_MODEL_POOL,
    PARAM_MODEL,
    ConnectionMode,
)
from .runtime import config_for
from .scoped_modules import serving_e2e_grpc

if TYPE_CHECKING:
    from ...plugin.session import SglSession

__all__ = ["COLLECTION_NAME", "E2E_GRPC_GROUP", "GATEWAY_FIXTURES", "GatewayCollection", "MarkerProblem", "Wanted",
           "e2e_selection", "install", "mark_items", "marker_kwargs", "selected_out", "shape_of", "wanted"]

#: the ``xdist_group`` of every test of the ``e2e_grpc/`` suite: its classes start their clusters on sglang's one
#: fixed ``DEFAULT_URL_FOR_TEST``, so two xdist workers running two of them at once would want the same port. Not an
#: ``sgl-`` name: the plugin's scheduler keeps the group on one xdist worker, unstolen, as ``--dist loadgroup`` does.
E2E_GRPC_GROUP = "e2e_grpc-fixed-url"

#: the suite's fixtures that start workers, in the order a test's request is read from
GATEWAY_FIXTURES = ("setup_backend", "backend_router", "model_client", "model_base_url")

_TRUE = ("1", "true", "yes")
WORKERS_DEFAULTS: dict[str, Any] = {"count": 1, "prefill": None, "decode": None}


class MarkerProblem(Exception):
    """A suite marker that cannot mean anything: the text says which and how to write it."""


@dataclass(frozen=True)
class Wanted:
    """What a test asks the pool for: a group of ``shape`` of ``model_id``'s workers in ``mode``."""

    model_id: str
    mode: ConnectionMode
    shape: GroupShape
    backend: str


def marker_kwargs(node: Any, name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The closest ``name`` marker's keyword arguments over ``defaults``; an unknown keyword is a
    :class:`MarkerProblem`."""
    mark = node.get_closest_marker(name)
    found = dict(defaults)
    if mark is None:
        return found
    unknown = sorted(set(mark.kwargs) - set(defaults))
    if unknown:
        raise MarkerProblem(f"@pytest.mark.{name}({', '.join(f'{k}=...' for k in unknown)}) on {node.nodeid}: "
                            f"{name} takes {', '.join(defaults)}")
    if name == "workers" and mark.args:  # upstream's older @pytest.mark.workers(3)
        found["count"] = mark.args[0]
    found.update(mark.kwargs)
    return found


def _whole(value: Any, what: str, nodeid: str) -> int:
    value = 1 if value is None else value  # left out: one
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MarkerProblem(f"@pytest.mark.workers({what}={value!r}) on {nodeid}: {what} is a whole number >= 1")
    return int(value)


def shape_of(node: Any, backend: str) -> GroupShape:
    """The workers' shape a ``setup_backend`` of ``backend`` asks for (``workers(count=N)``, or
    ``workers(prefill=P, decode=D)`` for ``pd``)."""
    workers = marker_kwargs(node, "workers", WORKERS_DEFAULTS)
    nodeid = node.nodeid
    if backend == "pd":
        return GroupShape(prefill=_whole(workers["prefill"], "prefill", nodeid),
                          decode=_whole(workers["decode"], "decode", nodeid))
    return GroupShape(count=_whole(workers["count"], "count", nodeid))


def _param(item: pytest.Item, name: str) -> Any:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(name) if callspec is not None else None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").lower() in _TRUE


def wanted(item: pytest.Item) -> Wanted | None:
    """The worker group ``item`` asks for through the suite's fixtures, read from its markers and parameters; None
    when it asks for none (no such fixture, a cloud backend, ``SKIP_BACKEND_SETUP`` / ``SKIP_MODEL_POOL``) or when
    its fixture will say what is wrong at setup (no backend parameter, a model fixture without its marker)."""
    fixturenames = getattr(item, "fixturenames", ())
    fixture = next((f for f in GATEWAY_FIXTURES if f in fixturenames), None)
    if fixture is None or _env_true(ENV_SKIP_MODEL_POOL):
        return None
    default = os.environ.get(ENV_MODEL, DEFAULT_MODEL)
    mark = item.get_closest_marker(PARAM_MODEL)
    marked = str(mark.args[0]) if mark is not None and mark.args else None
    if fixture == "setup_backend":
        backend = _param(item, fixture)
        if not isinstance(backend, str) or backend not in ("http", "grpc", "pd") or _env_true(ENV_SKIP_BACKEND_SETUP):
            return None
        mode = ConnectionMode.HTTP if backend == "pd" else ConnectionMode(backend)
        return Wanted(marked or default, mode, shape_of(item, backend), backend)
    if fixture == "backend_router":
        backend = _param(item, fixture)
        if backend not in ("http", "grpc"):
            return None
        return Wanted(default, ConnectionMode(backend), GroupShape(count=1), backend)
    if marked is None:
        return None
    return Wanted(marked, ConnectionMode.HTTP, GroupShape(count=1), "http")


def e2e_selection() -> tuple[set[str], set[ConnectionMode], str] | None:
    """The models and backends ``E2E_MODELS`` / ``E2E_BACKENDS`` say upstream's pool starts (either alone: the other
    is upstream's default, the default model or ``http``), and how the run said so; None when neither is set."""
    models_env, backends_env = os.environ.get(ENV_MODELS, "").strip(), os.environ.get(ENV_BACKENDS, "").strip()
    if not models_env and not backends_env:
        return None
    models = {m.strip() for m in models_env.split(",") if m.strip()} or {os.environ.get(ENV_MODEL, DEFAULT_MODEL)}
    modes: set[ConnectionMode] = set()
    for name in (b.strip() for b in backends_env.split(",")):
        try:
            modes.add(ConnectionMode(name))
        except ValueError:
            pass  # upstream skips an unknown backend name with a warning
    said = ", ".join(f"{k}={v!r}" for k, v in ((ENV_MODELS, models_env), (ENV_BACKENDS, backends_env)) if v)
    return models, modes or {ConnectionMode.HTTP}, said


def selected_out(want: Wanted) -> str | None:
    """Why the run's ``E2E_MODELS`` / ``E2E_BACKENDS`` leave this ``http``/``grpc`` worker out (None: they do not;
    ``pd`` groups are launched when a class asks, as upstream's are)."""
    selection = e2e_selection()
    if selection is None or want.backend == "pd":
        return None
    models, modes, said = selection
    if want.model_id in models and want.mode in modes:
        return None
    return (f"{said}: the pool serves {', '.join(sorted(models))} over {', '.join(sorted(m.value for m in modes))}, "
            f"not {want.model_id}:{want.mode.value} (upstream's pool starts only those)")


def mark_items(session: SglSession, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The collection-time work for the suite's tests (the module's docstring says what)."""
    problems: dict[str, str] = {}
    touched = False
    for item in items:
        if serving_e2e_grpc(item.path) and is_xdist_worker(config) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(name=E2E_GRPC_GROUP))
        try:
            want = wanted(item)
        except MarkerProblem as exc:
            problems[item.nodeid] = str(exc)
            continue
        if want is None:
            continue
        touched = True
        why = selected_out(want)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
            continue
        try:
            worker_config = config_for(session, want.model_id, want.mode, want.shape, owner=f"test {item.nodeid}")
        except CompatError as exc:
            problems[item.nodeid] = f"test {item.nodeid}: {exc}"
            continue
        except (SglWorkerError, ValueError) as exc:
            problems[item.nodeid] = str(exc)
            continue
        item.stash[CONFIG_KEY] = worker_config
        if is_xdist_worker(config) and item.get_closest_marker("xdist_group") is None:
            # before xdist's own hook appends the group to the node id (this hook runs first: tryfirst)
            item.add_marker(pytest.mark.xdist_group(name=f"sgl-{worker_config.key}"))
    if touched or problems:
        enable_run_hooks(session)  # an xdist worker's per-test errors are raised at their setup
    raise_or_give(session, config, items, problems)


COLLECTION_NAME = "sglworker-compat-gateway-collection"


class GatewayCollection:
    """The drop-in's collection hook, registered with every session that starts (:func:`install`)."""

    def __init__(self, session: SglSession) -> None:
        self.session = session

    @pytest.hookimpl(tryfirst=True)  # before the plugin's own (trylast) and xdist's loadgroup suffix
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        mark_items(self.session, config, items)


def install(session: SglSession) -> GatewayCollection:
    return session_plugin(session, COLLECTION_NAME, GatewayCollection)


when_session_starts(install)
