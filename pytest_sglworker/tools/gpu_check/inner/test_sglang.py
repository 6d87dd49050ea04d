"""One real launch of the tiny model with the real sglang on the GPU, with the budget flags (decode graph on).

Run only when the machine's python has sglang (the driver skips it otherwise). The driver reads the kept log
(startup phases, KV line) and the run report (startup time, KV tokens predicted and actual).
"""

from __future__ import annotations

from typing import Any


def test_tiny_model_serves(sgl_spawn_worker: Any, record: Any) -> None:
    worker = sgl_spawn_worker("tiny-gpu")
    resp = worker.client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 8}})
    record("sglang", {"worker_pid": worker.pid, "log_path": str(worker.log_path), "status": resp.status_code,
                      "startup_seconds": worker.startup_seconds, "argv": worker.argv,
                      "response": resp.text[:500]})
    assert resp.status_code == 200, resp.text[:500]
