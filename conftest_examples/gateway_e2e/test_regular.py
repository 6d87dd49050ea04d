"""Regular mode: one router per policy and class over the same two pooled workers (upstream's ``load_balancing``
tests and ``e2e_http/test_regular_router.py``)."""

from __future__ import annotations

import pytest
from conftest import completion, delta, served

pytestmark = pytest.mark.sgl_workers(count=2)


@pytest.mark.sgl_router(policy="round_robin", scope="class")
class TestRoundRobin:
    def test_alternates_between_workers(self, sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
        before = served(sgl_workers)
        for i in range(10):
            assert completion(sgl_router, f"rr {i}").status_code == 200
        assert delta(sgl_workers, before) == [5, 5]

    def test_chat_through_the_same_router(self, sgl_router) -> None:  # type: ignore[no-untyped-def]
        resp = sgl_router.client.post("/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.sgl_router(policy="random", scope="class")
class TestRandom:
    def test_uses_both_workers(self, sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
        before = served(sgl_workers)
        for i in range(40):
            assert completion(sgl_router, f"random {i}").status_code == 200
        counts = delta(sgl_workers, before)
        assert sum(counts) == 40 and min(counts) > 0, counts  # P(all 40 on one worker) = 2**-39


@pytest.mark.sgl_router(policy="cache_aware", scope="class")
class TestCacheAware:
    def test_a_shared_prefix_stays_on_one_worker(self, sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
        before = served(sgl_workers)
        prefix = "You are a helpful assistant. Here is a long shared system prompt. " * 8
        for i in range(6):
            assert completion(sgl_router, f"{prefix} question {i}").status_code == 200
        assert sorted(delta(sgl_workers, before)) == [0, 6]
