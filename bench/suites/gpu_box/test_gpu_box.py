"""The tests of the GPU-box suite (see conftest.py): each holds its worker (or its prefill/decode group) for the
seconds the plan gives it, after one request."""

from __future__ import annotations

import time

import pytest
from conftest import CONFIGS

MOST = max((len(c["tests"]) for c in CONFIGS.values()), default=1)


@pytest.mark.parametrize("i", range(MOST))
def test_tp(sgl_worker, sgl_model, i):  # type: ignore[no-untyped-def]
    assert sgl_worker.client.get("/health").status_code == 200
    time.sleep(CONFIGS[sgl_model.name]["tests"][i])


@pytest.mark.sgl_workers(prefill=1, decode=1)
@pytest.mark.parametrize("i", range(MOST))
def test_pd(sgl_workers, sgl_model, i):  # type: ignore[no-untyped-def]
    assert len(sgl_workers.prefill) == 1 and len(sgl_workers.decode) == 1
    time.sleep(CONFIGS[sgl_model.name]["tests"][i])
