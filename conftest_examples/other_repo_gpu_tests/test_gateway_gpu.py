"""GPU tests of another repository (say, a gateway), written against pytest-sglworker's fixtures only."""

from __future__ import annotations

import pytest


def test_worker_serves_the_registered_spec(sgl_worker, sgl_model) -> None:  # type: ignore[no-untyped-def]
    assert sgl_model.name == "gateway-qwen3"
    assert sgl_worker.spec == sgl_model
    assert "--max-total-tokens" in sgl_worker.argv  # the repository's own tightening reached the engine
    models = sgl_worker.client.get("/v1/models").json()["data"]
    assert models


def test_generate(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    resp = sgl_worker.client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    resp.raise_for_status()
    assert resp.json()["meta_info"]["completion_tokens"] <= 4


@pytest.mark.sgl_worker(args=["--max-running-requests", "2"])
def test_tightened_worker(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    assert sgl_worker.client.get("/server_info").json()["max_running_requests"] == 2


def test_failover_between_two_workers(sgl_model, sgl_spawn_worker) -> None:  # type: ignore[no-untyped-def]
    primary, backup = sgl_spawn_worker(sgl_model), sgl_spawn_worker(sgl_model)
    assert primary.port != backup.port
    primary.stop()  # the gateway under test would now fail over to the backup
    assert not primary.is_alive()
    chat = backup.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 4})
    assert chat.status_code == 200


def test_registry_lookup(sgl_registry) -> None:  # type: ignore[no-untyped-def]
    spec = sgl_registry.get("gateway-qwen3")
    assert spec.features >= {"chat", "streaming"}
