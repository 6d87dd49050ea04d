"""Another repository's GPU tests reusing pytest-sglworker: the only glue is this hook.

The spec carries the mandatory budget (CI_WORKER_ARGS) plus the repository's own tightening; the fixtures
``sgl_worker``, ``sgl_spawn_worker``, ``sgl_model`` and ``sgl_registry`` come from the installed plugin, so
there is no Popen, health loop or teardown here. Run:

    pytest conftest_examples/other_repo_gpu_tests --sgl-model gateway-qwen3                      # GPU machine
    pytest conftest_examples/other_repo_gpu_tests --sgl-engine sim --sgl-model gateway-qwen3     # CPU
"""

from __future__ import annotations

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec


def pytest_sglworker_register_specs(registry) -> None:  # type: ignore[no-untyped-def]
    registry.add(ModelSpec(
        name="gateway-qwen3",
        model="Qwen/Qwen3-0.6B",
        memory_gb=4,
        tp=1,
        features=frozenset({"chat", "streaming"}),
        worker_args=(*CI_WORKER_ARGS, "--max-total-tokens", "8192"),
        description="the gateway repository's default test worker",
    ))
