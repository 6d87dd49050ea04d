"""The fixtures of upstream's older ``e2e_test/e2e_http/`` suite (its own ``conftest.py``), served by the plugin.

That conftest launches routers and workers itself (``python3 -m sglang.launch_server`` on ``--base-gpu-id`` N,
ports from ``bind(0)``); with it replaced by the drop-in, the fixtures its test files use come from here, on the
plugin's pool, leases, port blocks and logs:

- ``e2e_model`` (session): the path the worker of ``E2E_PRIMARY_MODEL`` loads (upstream's default is sglang's
  ``DEFAULT_MODEL_NAME_FOR_TEST``, ``meta-llama/Llama-3.1-8B-Instruct``, the suite's ``llama-8b``);
- ``e2e_router_only_rr`` (function): a router with no worker, round robin (``.url``, ``.proc``), where a test
  attaches workers with ``POST /workers``;
- ``e2e_two_workers_dp2`` (session): two workers of ``e2e_model``, each ``--dp-size 2`` (``.url``, ``.proc``);
- ``e2e_primary_worker`` (session): one worker of ``e2e_model``;
- ``genai_bench_runner`` (session): upstream's benchmark harness (the ``genai-bench`` CLI, with thresholds on TTFT,
  throughput and GPU utilisation for an 8B model on GPUs): not part of the drop-in; the callable skips the test
  that calls it, with that reason, after the test has done what comes before it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .constants import MODEL_SPECS, ConnectionMode

__all__ = ["E2E_PRIMARY_MODEL", "HARNESS_SKIP", "Served", "e2e_model", "e2e_primary_worker", "e2e_router_only_rr",
           "e2e_two_workers_dp2", "genai_bench_runner", "model_id_of"]

#: upstream's variable for the e2e_http suite's model, and its default (sglang's DEFAULT_MODEL_NAME_FOR_TEST)
E2E_PRIMARY_MODEL = "E2E_PRIMARY_MODEL"
DEFAULT_PRIMARY_MODEL = "meta-llama/Llama-3.1-8B-Instruct"

HARNESS_SKIP = ("genai_bench_runner is upstream's benchmark harness (the genai-bench CLI; thresholds on TTFT, "
                "latency, throughput and GPU utilisation p50 >= 99% for an 8B model on GPUs): not part of "
                "pytest_sglworker.compat.gateway")


@dataclass
class Served:
    """What upstream's e2e_http fixtures yield (a ``SimpleNamespace(proc=..., url=...)``)."""

    url: str
    proc: Any


def model_id_of(name: str) -> str:
    """The suite's model id for ``name``: an id as it is, a Hugging Face model the table names as that id's."""
    if name in MODEL_SPECS:
        return name
    return next((model_id for model_id, spec in MODEL_SPECS.items() if spec["model"] == name), name)


def _primary() -> str:
    return model_id_of(os.environ.get(E2E_PRIMARY_MODEL, DEFAULT_PRIMARY_MODEL))


@pytest.fixture(scope="session")
def e2e_model() -> str:
    """The path the worker of the e2e_http suite's model loads."""
    from .runtime import model_path_of

    return model_path_of(_primary())


def _session_workers(owner: str, count: int, extra: tuple[str, ...]) -> Iterator[list[Served]]:
    from .runtime import runtime_or_error

    rt = runtime_or_error(owner)
    with rt.owning(owner):
        held = rt.group(_primary(), ConnectionMode.HTTP, _count(count), extra=extra)
    try:
        yield [Served(inst.base_url, inst.process) for inst in held.instances]
    finally:
        rt.release(owner, after=owner)


def _count(count: int) -> Any:
    from ...workers.config import GroupShape

    return GroupShape(count=count)


@pytest.fixture(scope="session")
def e2e_two_workers_dp2() -> Iterator[list[Served]]:
    """Two workers of ``e2e_model``, each with ``--dp-size 2``: one group of the plugin's pool, for the session."""
    yield from _session_workers("the session fixture e2e_two_workers_dp2", 2, ("--dp-size", "2"))


@pytest.fixture(scope="session")
def e2e_primary_worker() -> Iterator[Served]:
    """One worker of ``e2e_model`` for the session."""
    for served in _session_workers("the session fixture e2e_primary_worker", 1, ()):
        yield served[0]


@pytest.fixture
def e2e_router_only_rr() -> Iterator[Served]:
    """A router with no worker (round robin): the test attaches workers with ``POST /workers``."""
    from .gateway import Gateway

    gateway = Gateway()
    gateway.start(worker_urls=[], model_path=_primary(), policy="round_robin")
    try:
        yield Served(gateway.base_url, gateway.process)
    finally:
        gateway.shutdown()


@pytest.fixture(scope="session")
def genai_bench_runner() -> Callable[..., None]:
    """Upstream's benchmark harness is not offered: calling it skips the test, with why."""

    def _run(**kwargs: Any) -> None:
        del kwargs
        pytest.skip(HARNESS_SKIP)

    return _run
