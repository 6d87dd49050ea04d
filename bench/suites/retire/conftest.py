"""One model spec whose sim's clean shutdown takes ``BENCH_RETIRE_SHUTDOWN`` seconds (sglang's: about 4 s), with the
mandatory budget (CI_WORKER_ARGS). With ``BENCH_RETIRE_ON_MAIN=1`` the pool retires every group on the main thread,
as before issue 43's change (the baseline of bench/retire.py)."""

from __future__ import annotations

import os

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

if os.environ.get("BENCH_RETIRE_ON_MAIN") == "1":
    from pytest_sglworker.workers.pool import WorkerPool

    WorkerPool.__init__.__kwdefaults__["retire_in_background"] = False


def pytest_sglworker_register_specs(registry):  # type: ignore[no-untyped-def]
    shutdown = os.environ.get("BENCH_RETIRE_SHUTDOWN", "2")
    registry.add(ModelSpec(
        name="a", model="bench/model-a", memory_gb=4, tp=1, worker_args=CI_WORKER_ARGS,
        env={"SGLSIM_FAULT": f"shutdown={shutdown}"}, description="bench/retire.py example model",
    ))
