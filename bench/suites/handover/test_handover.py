"""One configuration of long tests beside several of short ones, startups of 1 to 2 s (``SGLSIM_STARTUP_SECONDS``
per configuration): while one xdist worker runs the long tests, a group it launched ahead is sent to the other.
``BENCH_HANDOVER_LONG`` tests of ``BENCH_HANDOVER_LONG_SECONDS`` for the long configuration,
``BENCH_HANDOVER_SHORT_CONFIGS`` x ``BENCH_HANDOVER_SHORT_TESTS`` tests of ``BENCH_HANDOVER_SHORT_SECONDS``."""

import os
import time

import pytest

LONG = int(os.environ.get("BENCH_HANDOVER_LONG", "4"))
LONG_SECONDS = float(os.environ.get("BENCH_HANDOVER_LONG_SECONDS", "4"))
SHORT_CONFIGS = int(os.environ.get("BENCH_HANDOVER_SHORT_CONFIGS", "5"))
SHORT = int(os.environ.get("BENCH_HANDOVER_SHORT_TESTS", "3"))
SHORT_SECONDS = float(os.environ.get("BENCH_HANDOVER_SHORT_SECONDS", "0.3"))


def _config(i):
    startup = 1.0 + i / max(SHORT_CONFIGS, 1)  # 1 to 2 s
    return pytest.mark.sgl_worker(args=["--max-total-tokens", str(4096 + i)],
                                  env={"SGLSIM_STARTUP_SECONDS": f"{startup:.2f}"})


@pytest.mark.parametrize("test", range(LONG))
@_config(0)
def test_long(sgl_worker, test):
    assert sgl_worker.client.get("/health").status_code == 200
    time.sleep(LONG_SECONDS)


@pytest.mark.parametrize("config", [pytest.param(i, marks=_config(i)) for i in range(1, SHORT_CONFIGS + 1)])
@pytest.mark.parametrize("test", range(SHORT))
def test_short(sgl_worker, config, test):
    assert sgl_worker.client.get("/health").status_code == 200
    time.sleep(SHORT_SECONDS)
