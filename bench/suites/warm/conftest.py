"""The model of bench/warm.py's suite: a simulated one (spec ``a``), or, when ``BENCH_WARM_REAL_MODEL`` names the
tiny model's directory, the real sglang on a CPU (spec ``real``); both carry the mandatory budget."""

from __future__ import annotations

import os

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec


def pytest_sglworker_register_specs(registry):  # type: ignore[no-untyped-def]
    registry.add(ModelSpec(name="a", model="bench/model-a", memory_gb=4, tp=1, features={"chat"},
                           worker_args=CI_WORKER_ARGS, description="bench/warm.py simulated model"))
    model = os.environ.get("BENCH_WARM_REAL_MODEL")
    if model:
        from pytest_sglworker import cpu_engine_spec

        registry.add(cpu_engine_spec("real", model, description="bench/warm.py: sglang on a CPU, the tiny model"))
