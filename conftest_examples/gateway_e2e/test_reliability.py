"""Retries, the circuit breaker and the payload limit (upstream's ``test_retries.py``, ``test_circuit_breaker.py``
and ``test_payload_size.py``). A worker fails on demand through the simulated engine's faults; the pool sets them
back before the worker serves another test."""

from __future__ import annotations

import time

import pytest
from conftest import completion, delta, served

RETRIES = ["--retry-max-retries", "3", "--retry-initial-backoff-ms", "10", "--retry-max-backoff-ms", "50"]
BREAKER = ["--cb-failure-threshold", "3", "--cb-success-threshold", "2", "--cb-timeout-duration-secs", "2",
           "--cb-window-duration-secs", "10", "--disable-retries"]


@pytest.mark.sgl_workers(count=3)
@pytest.mark.sgl_router(policy="round_robin", args=RETRIES)
def test_a_failing_worker_is_retried_on_a_healthy_one(sgl_router, sgl_workers, faults) -> None:  # type: ignore[no-untyped-def]
    faults(sgl_workers[0], status=500)  # every inference request of worker 0 answers 500
    before = served(sgl_workers)
    for i in range(6):
        resp = completion(sgl_router, f"retry {i}")
        assert resp.status_code == 200, resp.text
    assert delta(sgl_workers, before)[0] == 0  # the 500s are not counted as served
    assert sum(delta(sgl_workers, before)) == 6


@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(policy="round_robin", args=["--disable-retries"])
def test_without_retries_the_failure_reaches_the_client(sgl_router, sgl_workers, faults) -> None:  # type: ignore[no-untyped-def]
    faults(sgl_workers[0], status=500)
    assert completion(sgl_router, "no retry").status_code == 500


@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(policy="round_robin", args=BREAKER)
def test_the_circuit_breaker_opens_and_recovers(sgl_router, sgl_workers, faults) -> None:  # type: ignore[no-untyped-def]
    faults(sgl_workers[0], fail_first=3)
    codes = [completion(sgl_router, f"trip {i}").status_code for i in range(5)]
    assert codes[:3] == [500, 500, 500] and 503 in codes[3:], codes  # open: the router answers for the worker
    deadline = time.monotonic() + 15  # half-open after --cb-timeout-duration-secs, then closed again
    while (code := completion(sgl_router, "probe").status_code) != 200:
        assert code == 503 and time.monotonic() < deadline, code
        time.sleep(0.2)
    assert completion(sgl_router, "closed again").status_code == 200


@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(policy="round_robin", args=["--max-payload-size", str(256 * 1024)])
def test_the_router_refuses_a_payload_over_its_limit(sgl_router) -> None:  # type: ignore[no-untyped-def]
    small = "hello " * 2_000  # 12 KB: within the limit and the model's context
    assert completion(sgl_router, small).status_code == 200
    large = "x" * (300 * 1024)
    assert completion(sgl_router, large).status_code == 413
