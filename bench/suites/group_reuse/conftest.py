"""One small model spec for the group reuse suite; it carries the mandatory budget (CI_WORKER_ARGS)."""

from __future__ import annotations

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec


def pytest_sglworker_register_specs(registry):  # type: ignore[no-untyped-def]
    registry.add(ModelSpec(
        name="a", model="bench/model-a", memory_gb=4, tp=1, features={"chat"},
        worker_args=CI_WORKER_ARGS, description="bench/run.py example model",
    ))
