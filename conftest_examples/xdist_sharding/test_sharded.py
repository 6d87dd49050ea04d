"""A suite sharded across xdist workers: three worker configurations, several tests each.

Each test function below asks for ``sgl_worker``; the configuration is the model spec plus the test's
``@pytest.mark.sgl_worker(args=...)``. Under plain ``-n`` pytest-sglworker hands each configuration's tests to
the xdist worker that has it running (``--sgl-dist auto``); it also marks every test with ``xdist_group`` named
after its configuration, so under ``--dist loadgroup`` all tests of one configuration go to one xdist worker
and share one launch (``--sgl-report`` shows ``launches: 1`` per configuration). Every xdist worker leases its own
GPU(s): no two workers ever share a GPU or a port, and surplus xdist workers wait for a lease.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

SMALL_POOL = ["--max-total-tokens", "4096"]  # tightening the budget is always allowed
LOW_CONCURRENCY = ["--max-running-requests", "4"]


def _generate(worker, text: str, max_new_tokens: int = 8) -> dict:  # type: ignore[no-untyped-def]
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    resp = worker.client.post("/generate", json=body)
    resp.raise_for_status()
    return resp.json()  # type: ignore[no-any-return]


# -- configuration 1: the spec as it is --------------------------------------------------------------------


def test_generate(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    out = _generate(sgl_worker, "The capital of France is", max_new_tokens=4)
    assert out["text"]
    assert out["meta_info"]["completion_tokens"] <= 4


def test_chat(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    resp = sgl_worker.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "temperature": 0})
    resp.raise_for_status()
    assert resp.json()["choices"][0]["message"]["content"]


@pytest.mark.sgl_requires("streaming")
def test_stream(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 8, "stream": True}
    chunks = []
    with sgl_worker.client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert chunks


def test_models(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    resp = sgl_worker.client.get("/v1/models")
    resp.raise_for_status()
    assert resp.json()["data"]


# -- configuration 2: a small KV pool ----------------------------------------------------------------------


@pytest.mark.sgl_worker(args=SMALL_POOL)
def test_small_pool_is_capped(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    info = sgl_worker.client.get("/server_info").json()
    tokens = info.get("max_total_num_tokens") or info["internal_states"][0]["max_total_num_tokens"]
    assert 0 < tokens <= 4096


@pytest.mark.sgl_worker(args=SMALL_POOL)
def test_small_pool_generates(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    assert _generate(sgl_worker, "Once upon a time")["meta_info"]["completion_tokens"] > 0


# -- configuration 3: a low concurrency limit --------------------------------------------------------------


@pytest.mark.sgl_worker(args=LOW_CONCURRENCY)
def test_low_concurrency_limit_is_set(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    assert sgl_worker.client.get("/server_info").json()["max_running_requests"] == 4


@pytest.mark.sgl_worker(args=LOW_CONCURRENCY)
def test_more_requests_than_the_limit_all_complete(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(lambda i: _generate(sgl_worker, f"request {i}", 4), range(8)))
    assert all(o["meta_info"]["completion_tokens"] > 0 for o in outs)
