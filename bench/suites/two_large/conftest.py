"""Two model specs for the two-large-configurations suite; both carry the mandatory budget (CI_WORKER_ARGS)."""

from __future__ import annotations

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec


def pytest_sglworker_register_specs(registry):  # type: ignore[no-untyped-def]
    for name in ("a", "b"):
        registry.add(ModelSpec(
            name=name, model=f"bench/model-{name}", memory_gb=4, tp=1, features={"chat"},
            worker_args=CI_WORKER_ARGS, description="bench/xdist_sched.py example model",
        ))
