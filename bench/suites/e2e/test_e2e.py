"""An example router-style e2e suite: N tests per argument set, 3 argument sets, over the selected models.

With ``--sgl-model a,b`` and the default N=10 (env ``BENCH_E2E_TESTS_PER_SET``) that is 60 tests and 6
worker configurations (2 models x 3 argument sets). Every test sends one small request to its worker.
"""

from __future__ import annotations

import os

import pytest

N = int(os.environ.get("BENCH_E2E_TESTS_PER_SET", "10"))


def _exercise(worker) -> None:  # type: ignore[no-untyped-def]
    resp = worker.client.post("/generate", json={"text": "hello router", "sampling_params": {"max_new_tokens": 4}})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("i", range(N))
def test_default_args(sgl_worker, i):  # type: ignore[no-untyped-def]
    _exercise(sgl_worker)


@pytest.mark.sgl_worker(args=["--max-total-tokens", "4096"])
@pytest.mark.parametrize("i", range(N))
def test_small_pool(sgl_worker, i):  # type: ignore[no-untyped-def]
    _exercise(sgl_worker)


@pytest.mark.sgl_worker(args=["--mem-fraction-static", "0.5", "--max-running-requests", "8"])
@pytest.mark.parametrize("i", range(N))
def test_low_fraction(sgl_worker, i):  # type: ignore[no-untyped-def]
    _exercise(sgl_worker)
