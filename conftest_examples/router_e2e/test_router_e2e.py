"""A router e2e suite against the real sglang router (``sglang-router``): regular mode over two workers,
prefill/decode disaggregation, and a dp-aware router. It runs unchanged against the simulated engine on a
CPU (``--sgl-engine sim``) and against real sglang on a GPU machine (PD there needs a transfer backend:
``@pytest.mark.sgl_workers(..., args=["--disaggregation-transfer-backend", "mooncake"])`` and IB devices)."""

from __future__ import annotations

import signal

import pytest
from conftest import served_by, stream_chunks

TWO = pytest.mark.sgl_workers(count=2)


@TWO
def test_chat_completion(chat) -> None:  # type: ignore[no-untyped-def]
    body = chat("Say hello", max_tokens=8, temperature=0)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


@TWO
@pytest.mark.sgl_requires("streaming")
def test_chat_streaming(sgl_router) -> None:  # type: ignore[no-untyped-def]
    with sgl_router.client.stream("POST", "/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 8,
            "stream": True}) as resp:
        assert resp.status_code == 200
        chunks = list(stream_chunks(resp))
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)


@TWO
@pytest.mark.sgl_router(policy="round_robin")
def test_round_robin_splits_evenly(sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    before = served_by(sgl_workers)
    for i in range(8):
        resp = sgl_router.client.post("/generate", json={"text": f"request {i}", "sampling_params": {
            "max_new_tokens": 2}})
        assert resp.status_code == 200, resp.text
    assert [a - b for a, b in zip(served_by(sgl_workers), before, strict=True)] == [4, 4]


@TWO
@pytest.mark.sgl_router(policy="cache_aware")
def test_cache_aware_keeps_a_prefix_on_one_worker(sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    before = served_by(sgl_workers)
    prompt = "You are a helpful assistant. Here is a long shared system prompt. " * 4
    for _ in range(6):
        resp = sgl_router.client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 200
    assert sorted(a - b for a, b in zip(served_by(sgl_workers), before, strict=True)) == [0, 6]


@TWO
@pytest.mark.sgl_router(policy="round_robin")
def test_requests_survive_a_worker_crash(sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    sgl_workers[0].kill(signal.SIGKILL)  # a deliberate crash: the suite tests the router's recovery
    sgl_workers[0].process.wait(30)
    for i in range(8):
        resp = sgl_router.client.post("/generate", json={"text": f"after {i}", "sampling_params": {
            "max_new_tokens": 2}})
        assert resp.status_code == 200, resp.text


PD = pytest.mark.sgl_workers(prefill=1, decode=1)


@PD
def test_pd_chat_and_generate(sgl_router, chat) -> None:  # type: ignore[no-untyped-def]
    assert sgl_router.mode == "pd"
    assert chat("hello through prefill and decode", max_tokens=4)["object"] == "chat.completion"
    resp = sgl_router.client.post("/generate", json={"text": "The capital city of France is",
                                                     "sampling_params": {"max_new_tokens": 4}})
    assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] <= 4


@PD
@pytest.mark.sgl_requires("streaming")
def test_pd_streaming(sgl_router) -> None:  # type: ignore[no-untyped-def]
    with sgl_router.client.stream("POST", "/generate", json={
            "text": "stream through PD", "sampling_params": {"max_new_tokens": 5}, "stream": True}) as resp:
        assert resp.status_code == 200
        chunks = list(stream_chunks(resp))
    assert chunks and chunks[-1]["meta_info"]["completion_tokens"] <= 5


@PD
def test_pd_logprobs_merge(sgl_router) -> None:  # type: ignore[no-untyped-def]
    # the router merges input logprobs (from prefill) with output logprobs (from decode)
    resp = sgl_router.client.post("/generate", json={
        "text": "The quick brown fox", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0})
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert all(len(top) <= 2 for top in meta["output_top_logprobs"])


@pytest.mark.sgl_workers(count=1, args=["--dp-size", "2"])
def test_dp_aware_router_addresses_each_rank(sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    assert "--dp-aware" in sgl_router.argv
    urls = sorted(w["url"] for w in sgl_router.workers())
    assert urls == [f"{sgl_workers[0].url}@0", f"{sgl_workers[0].url}@1"]
    for i in range(4):
        resp = sgl_router.client.post("/generate", json={"text": f"dp {i}", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 200, resp.text
