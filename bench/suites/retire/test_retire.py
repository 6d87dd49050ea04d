"""Configurations one after another, each with a few short tests: each one's last test ends while the next one's
group, launched ahead on another GPU, is ready (``BENCH_RETIRE_CONFIGS`` x ``BENCH_RETIRE_TESTS`` tests of
``BENCH_RETIRE_TEST_SECONDS`` each)."""

import os
import time

import pytest

CONFIGS = int(os.environ.get("BENCH_RETIRE_CONFIGS", "4"))
TESTS = int(os.environ.get("BENCH_RETIRE_TESTS", "2"))
SECONDS = float(os.environ.get("BENCH_RETIRE_TEST_SECONDS", "0.3"))


@pytest.mark.parametrize("config", [
    pytest.param(i, marks=pytest.mark.sgl_worker(args=["--max-total-tokens", str(4096 + i)])) for i in range(CONFIGS)])
@pytest.mark.parametrize("test", range(TESTS))
def test_serves(sgl_worker, config, test):
    assert sgl_worker.client.get("/health").status_code == 200
    time.sleep(SECONDS)
