"""One model spec with the mandatory budget (CI_WORKER_ARGS). With ``BENCH_HANDOVER_BETWEEN_TESTS=1`` an xdist
worker's follower thread hands nothing over while a test runs: a group launched ahead there and sent to another xdist
worker is handed over by the main thread between tests, as before the change (the baseline of bench/handover.py)."""

from __future__ import annotations

import os

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

if os.environ.get("BENCH_HANDOVER_BETWEEN_TESTS") == "1":
    from pytest_sglworker.workers.pool import WorkerPool

    def _between_tests_only(self, keys):  # type: ignore[no-untyped-def]
        return None

    WorkerPool.hand_over_ready = _between_tests_only  # type: ignore[method-assign]


def pytest_sglworker_register_specs(registry):  # type: ignore[no-untyped-def]
    registry.add(ModelSpec(name="a", model="bench/model-a", memory_gb=4, tp=1, worker_args=CI_WORKER_ARGS,
                           description="bench/handover.py example model"))
