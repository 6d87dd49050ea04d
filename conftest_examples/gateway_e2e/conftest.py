"""A gateway e2e suite written the way sglang's own router and gateway suites are (``sgl-router/py_test/
integration``, ``sgl-model-gateway/e2e_test``): routers per class or module, workers added live, per-policy
routers, retries, the circuit breaker, payload limits and power of two. The workers and the real sglang router
come from pytest-sglworker's fixtures; this conftest only adds small helpers.

Requests are counted per worker with ``worker.requests_served()`` (the engine's own access lines), so the same
assertions hold on the simulated engine and on real sglang. Tests that need a worker to fail on demand switch
the simulated engine's request faults (``/_sim/faults``) and skip on a real engine; the plugin sets a pooled
worker's faults back before the next test.

    pytest conftest_examples/gateway_e2e --sgl-engine sim --sgl-model qwen3-0.6b      # CPU
    pytest conftest_examples/gateway_e2e --sgl-model qwen3-0.6b                       # GPU machine
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest


def completion(router: Any, prompt: str, *, max_tokens: int = 1, model: str = "default",
               timeout: float = 30.0) -> httpx.Response:
    """``POST /v1/completions`` through the router, as the upstream suites send it. A gateway-mode router
    (``--enable-igw``) routes by model: pass the id the workers serve (:func:`model_id`)."""
    return router.client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": False}, timeout=timeout)


def model_id(worker: Any) -> str:
    """The model id a worker serves, as its ``/v1/models`` says."""
    return str(worker.client.get("/v1/models", timeout=10).json()["data"][0]["id"])


def served(workers: Sequence[Any]) -> list[int]:
    """Inference requests each worker answered so far (from its own log)."""
    return [w.requests_served() for w in workers]


def delta(workers: Sequence[Any], before: Sequence[int]) -> list[int]:
    return [after - was for after, was in zip(served(workers), before, strict=True)]


@pytest.fixture
def faults() -> Callable[..., None]:
    """``faults(worker, status=500)``: switch a simulated worker's request faults now (``None`` clears one). A real
    engine cannot fail on demand: the test skips there."""

    def switch(worker: Any, **values: Any) -> None:
        if not worker.simulated:
            pytest.skip("needs a worker that fails on demand: the simulated engine (--sgl-engine sim)")
        resp = httpx.post(f"{worker.url}/_sim/faults", json=values, timeout=10)
        assert resp.status_code == 200, resp.text

    return switch
