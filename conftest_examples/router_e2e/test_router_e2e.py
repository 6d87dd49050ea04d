"""A router e2e suite: runs unchanged against the simulated engine (--sgl-engine sim) and real sglang."""

from __future__ import annotations

import json

import pytest


def test_chat_completion(router) -> None:  # type: ignore[no-untyped-def]
    body = router.chat([{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


@pytest.mark.sgl_requires("streaming")
def test_chat_streaming(router) -> None:  # type: ignore[no-untyped-def]
    chunks = list(router.chat_stream([{"role": "user", "content": "Count"}], max_tokens=8, temperature=0))
    assert chunks[-1] == "[DONE]"
    objects = [json.loads(c) for c in chunks[:-1]]
    assert objects and all(o["object"] == "chat.completion.chunk" for o in objects)


def test_generate(router) -> None:  # type: ignore[no-untyped-def]
    body = router.generate("The capital city of France is", max_new_tokens=4)
    assert isinstance(body["text"], str)
    assert body["meta_info"]["completion_tokens"] <= 4
    assert body["meta_info"]["finish_reason"]["type"] in {"length", "stop"}


@pytest.mark.sgl_worker(args=["--max-total-tokens", "2048"])
def test_tighter_budget_is_allowed(sgl_worker) -> None:  # type: ignore[no-untyped-def]
    info = sgl_worker.client.get("/server_info").json()
    assert info["max_total_num_tokens"] <= 2048


def test_round_robin_over_two_workers(sgl_model, sgl_spawn_worker) -> None:  # type: ignore[no-untyped-def]
    from router import RoundRobinRouter

    workers = [sgl_spawn_worker(sgl_model), sgl_spawn_worker(sgl_model)]
    assert workers[0].port != workers[1].port
    r = RoundRobinRouter([w.url for w in workers])
    try:
        for _ in range(4):
            r.generate("hello", max_new_tokens=2)
    finally:
        r.close()
    assert r.routed == [workers[0].url, workers[1].url] * 2
