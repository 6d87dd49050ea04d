"""A developer's e2e file, run again and again: 3 worker configurations (no args; ``--max-running-requests 8``;
``--max-running-requests 4``), ``BENCH_WARM_TESTS`` tests each (default 4), every test sending ``/generate``
requests for ``BENCH_WARM_TEST_SECONDS`` (default 1.0): its own time is the same whatever the engine."""

from __future__ import annotations

import os
import time

import pytest

N = int(os.environ.get("BENCH_WARM_TESTS", "4"))
SECONDS = float(os.environ.get("BENCH_WARM_TEST_SECONDS", "1.0"))


def _exercise(worker) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + SECONDS
    while True:
        resp = worker.client.post("/generate", json={"text": "hello router", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 200, resp.text
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


@pytest.mark.parametrize("i", range(N))
def test_default(sgl_worker, i):  # type: ignore[no-untyped-def]
    _exercise(sgl_worker)


@pytest.mark.sgl_worker(args=["--max-running-requests", "8"])
@pytest.mark.parametrize("i", range(N))
def test_eight(sgl_worker, i):  # type: ignore[no-untyped-def]
    _exercise(sgl_worker)


@pytest.mark.sgl_worker(args=["--max-running-requests", "4"])
@pytest.mark.parametrize("i", range(N))
def test_four(sgl_worker, i):  # type: ignore[no-untyped-def]
    _exercise(sgl_worker)
