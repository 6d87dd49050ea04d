"""A drop-in for sglang's gateway e2e suite (``sgl-model-gateway/e2e_test/`` in github.com/sgl-project/sglang): its
test files run unchanged, their conftest and ``infra``/``fixtures`` packages replaced by one line::

    pytest -p pytest_sglworker.compat.gateway e2e_test/
    # or, as the suite's whole conftest.py:
    pytest_plugins = ["pytest_sglworker.compat.gateway"]

What the suite's files are written against, served by the plugin:

- markers ``@pytest.mark.model("llama-8b")``, ``@pytest.mark.workers(count=N)`` or ``(prefill=P, decode=D)``,
  ``@pytest.mark.gateway(policy=..., timeout=..., extra_args=[...])``, and ``e2e``, ``slow``, ``backend``, ``pd``
  registered;
- fixtures ``setup_backend`` (class scope; indirect parameter ``"http"``, ``"grpc"``, ``"pd"`` or a cloud name;
  yields ``(backend, model_path, openai_client, gateway)``), ``backend_router`` (function scope; ``"http"`` or
  ``"grpc"``; yields a ``Gateway``), ``model_pool`` (session scope), ``model_client``, ``model_base_url``; and the
  older ``e2e_http/`` suite's (:mod:`.e2e_http`);
- environment variables ``E2E_MODEL`` (the default model id), ``E2E_STARTUP_TIMEOUT`` (workers' startup timeout),
  ``SKIP_BACKEND_SETUP`` (``setup_backend`` skips), ``SKIP_MODEL_POOL`` (an empty pool: tests that need a worker
  skip), ``E2E_MODELS``/``E2E_BACKENDS`` (what upstream's pool starts: the tests of other models or backends are
  skipped, :mod:`.collect`); ``SHOW_ROUTER_LOGS``/``SHOW_WORKER_LOGS`` change nothing: every process logs to its
  own file, shown in the report of a test that fails;
- ``from infra import ...``: :mod:`.infra`, registered as the module ``infra`` (:func:`claim_infra`);
- the older ``e2e_grpc/`` suite's ``from fixtures import popen_launch_workers_and_router`` and ``from util import
  ...``: :mod:`.e2e_grpc`, for the files under an ``e2e_grpc/`` folder only (:mod:`.scoped_modules`).

Workers are the plugin's (a registered, budgeted spec per model id, GPU leases, a log per port, failure texts,
pooled between classes, resolved at collection and scheduled by configuration under xdist: :mod:`.collect`), routers
the real ``sglang-router`` (:mod:`.runtime`). PD groups run on the simulated
engine too (upstream skips PD without CUDA). A cloud backend skips without its API key, as upstream's does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ...workers.config import GroupShape
from . import infra as _infra
from . import runtime as _runtime  # noqa: F401  (registers its hooks with every session that starts)
from .collect import MarkerProblem, marker_kwargs, shape_of
from .constants import (
    DEFAULT_MODEL,
    DEFAULT_ROUTER_TIMEOUT,
    ENV_MODEL,
    ENV_SKIP_BACKEND_SETUP,
    PARAM_MODEL,
    THIRD_PARTY_MODELS,
    ConnectionMode,
)
from .e2e_http import e2e_model, e2e_primary_worker, e2e_router_only_rr, e2e_two_workers_dp2, genai_bench_runner
from .scoped_modules import pytest_make_collect_report

__all__ = ["INFRA_MODULE", "MARKERS", "backend_router", "claim_infra", "e2e_model", "e2e_primary_worker",
           "e2e_router_only_rr", "e2e_two_workers_dp2", "genai_bench_runner", "model_base_url", "model_client",
           "model_pool", "pytest_configure", "pytest_make_collect_report", "setup_backend"]

#: the module name the suite's files import from
INFRA_MODULE = "infra"

MARKERS = (
    "model(name): the suite's model id a test's backend serves (pytest_sglworker.compat.gateway)",
    "workers(count=1, prefill=None, decode=None): the workers behind the gateway: count regular workers, or "
    "prefill + decode workers for the pd backend (pytest_sglworker.compat.gateway)",
    "gateway(policy='round_robin', timeout=60, extra_args=None): how the gateway (sglang-router) is started "
    "(pytest_sglworker.compat.gateway)",
    "backend(name): the backend a test uses (pytest_sglworker.compat.gateway)",
    "pd(num_prefill=1, num_decode=1): upstream's older PD marker (pytest_sglworker.compat.gateway)",
    "e2e: an end-to-end test of the gateway (pytest_sglworker.compat.gateway)",
    "slow: a slow test (pytest_sglworker.compat.gateway)",
)

_TRUE = ("1", "true", "yes")


def claim_infra() -> None:
    """Make ``import infra`` resolve to :mod:`.infra`. The suite's conftest put its own folder on ``sys.path`` so
    that ``from infra import X`` found its ``infra/`` package; with the conftest replaced by this plugin, nothing
    does, and a leftover ``infra/`` folder is shadowed: ``sys.modules`` is consulted before any path. An ``infra``
    module already imported that is not this one (the suite's own, from a conftest kept beside the plugin) is an
    error that says so, rather than two infrastructures fighting over the same GPUs."""
    present = sys.modules.get(INFRA_MODULE)
    if present is None or present is _infra:
        sys.modules[INFRA_MODULE] = _infra
        return
    where = getattr(present, "__file__", None) or repr(present)
    raise pytest.UsageError(
        f"pytest_sglworker.compat.gateway serves 'from infra import ...', but another module named 'infra' is already "
        f"imported ({where}): remove the suite's own conftest.py (its one line is now pytest_plugins = "
        "['pytest_sglworker.compat.gateway']) so that its infra/ is never imported")


claim_infra()


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


# ---------------------------------------------------------------------------------------------------- markers
def _shape(request: pytest.FixtureRequest, backend: str) -> GroupShape:
    """The workers' shape of the class's markers; a malformed one fails its setup (it is a usage error at collection
    already, unless the fixture was asked for by name)."""
    try:
        return shape_of(request.node, backend)
    except MarkerProblem as exc:
        pytest.fail(str(exc), pytrace=False)


def _model_id(request: pytest.FixtureRequest) -> str:
    mark = request.node.get_closest_marker(PARAM_MODEL)
    if mark is not None and mark.args:
        return str(mark.args[0])
    return os.environ.get(ENV_MODEL, DEFAULT_MODEL)


def _param(request: pytest.FixtureRequest, fixture: str, choices: str) -> str:
    param = getattr(request, "param", None)
    if not isinstance(param, str):
        pytest.fail(f"{fixture} in {request.node.nodeid} needs its backend: @pytest.mark.parametrize("
                    f"{fixture!r}, [{choices}], indirect=True)", pytrace=False)
    return param


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def model_pool(pytestconfig: pytest.Config) -> Any:
    """Upstream's ``ModelPool``, over the plugin's pool of worker groups (workers start when first asked for)."""
    from .pool import ModelPool

    return ModelPool()


def _marked_model(request: pytest.FixtureRequest, fixture: str) -> str:
    mark = request.node.get_closest_marker(PARAM_MODEL)
    if mark is None or not mark.args:
        pytest.fail(f"Test must be marked with @pytest.mark.{PARAM_MODEL}('model-id') to use {fixture} fixture")
    return str(mark.args[0])


@pytest.fixture
def model_client(request: pytest.FixtureRequest, model_pool: Any) -> Any:
    """An OpenAI client for the worker of the test's ``@pytest.mark.model(...)``."""
    model_id = _marked_model(request, "model_client")
    try:
        return model_pool.get_client(model_id)
    except KeyError:
        pytest.skip(f"Model {model_id} not available in model pool")


@pytest.fixture
def model_base_url(request: pytest.FixtureRequest, model_pool: Any) -> str:
    """The base URL of the worker of the test's ``@pytest.mark.model(...)``."""
    model_id = _marked_model(request, "model_base_url")
    try:
        return str(model_pool.get_base_url(model_id))
    except KeyError:
        pytest.skip(f"Model {model_id} not available in model pool")


def _openai_client(base_url: str, api_key: str = "not-used") -> Any:
    try:
        import openai
    except ImportError:
        pytest.fail("setup_backend yields an openai.OpenAI client, and this Python has no openai: pip install openai",
                    pytrace=False)
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key)


@pytest.fixture(scope="class")
def setup_backend(request: pytest.FixtureRequest, model_pool: Any) -> Iterator[tuple[str, str, Any, Any]]:
    """The gateway of a test class: ``(backend, model_path, openai_client, gateway)``. ``"http"``/``"grpc"``:
    ``@pytest.mark.workers(count=N)`` workers of the class's model behind the real router; ``"pd"``:
    ``workers(prefill=P, decode=D)`` behind the router in PD mode; a cloud name: the router in front of that API
    (skipped without its API key). The workers come from the plugin's pool and go back to it after the class."""
    from .gateway import Gateway
    from .runtime import WorkerIdentity, runtime

    backend = _param(request, "setup_backend", "'http', 'grpc', 'pd'")
    if os.environ.get(ENV_SKIP_BACKEND_SETUP, "").lower() in _TRUE:
        pytest.skip(f"{ENV_SKIP_BACKEND_SETUP} is set")
    nodeid = request.node.nodeid
    try:
        gw = marker_kwargs(request.node, "gateway", {"policy": "round_robin", "timeout": DEFAULT_ROUTER_TIMEOUT,
                                                     "extra_args": None})
    except MarkerProblem as exc:
        pytest.fail(str(exc), pytrace=False)
    rt = runtime()
    assert rt is not None  # a fixture runs inside a session
    if backend in THIRD_PARTY_MODELS:
        key_env = THIRD_PARTY_MODELS[backend]["api_key_env"]
        if not os.environ.get(key_env):
            pytest.skip(f"{key_env} not set, skipping {backend} tests")
        with rt.owning(nodeid):
            gateway = Gateway()
            gateway.start(cloud_backend=backend, policy=gw["policy"], timeout=gw["timeout"],
                          extra_args=gw["extra_args"])
        try:
            yield backend, THIRD_PARTY_MODELS[backend]["model"], _openai_client(gateway.base_url,
                                                                                os.environ[key_env]), gateway
        finally:
            gateway.shutdown()
            rt.release(nodeid, after=f"the class {nodeid}")
        return
    model_id = _model_id(request)
    if backend not in ("http", "grpc", "pd"):
        pytest.fail(f"Unknown backend: {backend} (setup_backend takes 'http', 'grpc', 'pd' or a cloud backend: "
                    f"{', '.join(THIRD_PARTY_MODELS)})", pytrace=False)
    with rt.owning(nodeid):
        try:
            shape = _shape(request, backend)
            if backend == "pd":
                prefills, decodes = model_pool.launch_pd_workers(model_id, shape.prefill, shape.decode)
                instances = prefills + decodes
                gateway = Gateway()
                gateway.start(prefill_workers=prefills, decode_workers=decodes, policy=gw["policy"],
                              timeout=gw["timeout"], extra_args=gw["extra_args"])
            else:
                mode = ConnectionMode(backend)
                instances = (model_pool.launch_workers([WorkerIdentity(model_id, mode, index=i)
                                                        for i in range(shape.count)])
                             if shape.count > 1 else [model_pool.get(model_id, mode)])
                gateway = Gateway()
                gateway.start(worker_urls=[i.worker_url for i in instances], model_path=instances[0].model_path,
                              policy=gw["policy"], timeout=gw["timeout"], extra_args=gw["extra_args"])
        except BaseException:
            rt.release(nodeid, after=f"a failed setup of {nodeid}", check=False)
            raise
    try:
        yield backend, instances[0].model_path, _openai_client(gateway.base_url), gateway
    finally:
        gateway.shutdown()
        rt.release(nodeid, after=f"the class {nodeid}")


@pytest.fixture
def backend_router(request: pytest.FixtureRequest, model_pool: Any) -> Iterator[Any]:
    """A fresh gateway for one test, in front of one ``"http"`` or ``"grpc"`` worker of ``E2E_MODEL``."""
    from .gateway import Gateway

    backend = _param(request, "backend_router", "'http', 'grpc'")
    try:
        mode = ConnectionMode(backend)
    except ValueError:
        pytest.fail(f"backend_router takes 'http' or 'grpc', got {backend!r}", pytrace=False)
    model_id = os.environ.get(ENV_MODEL, DEFAULT_MODEL)
    try:
        instance = model_pool.get(model_id, mode)
    except KeyError:
        pytest.skip(f"Model {model_id}:{backend} not available in pool")
    gateway = Gateway()
    gateway.start(worker_urls=[instance.worker_url], model_path=instance.model_path)
    try:
        yield gateway
    finally:
        gateway.shutdown()
