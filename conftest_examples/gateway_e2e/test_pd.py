"""Prefill/decode disaggregation: one PD router for the module over a pooled 1P+1D group (upstream's PD cluster is
per module), the router started first with no worker and the two sides added by type through its API once, as
``test_pd_router.py`` does. On a GPU machine PD needs a transfer backend: add
``args=["--disaggregation-transfer-backend", "mooncake"]`` (and IB devices) to the workers marker."""

from __future__ import annotations

import pytest
from conftest import served

pytestmark = [pytest.mark.sgl_workers(prefill=1, decode=1),
              pytest.mark.sgl_router(policy="round_robin", workers="none", scope="module")]


@pytest.fixture
def pd_router(sgl_router, sgl_workers):  # type: ignore[no-untyped-def]
    """The module's router, with both sides added the first time."""
    if not sgl_router.workers():
        sgl_router.add_worker(sgl_workers.prefill[0])
        sgl_router.add_worker(sgl_workers.decode[0])
        sgl_router.wait_for_workers(2)
    return sgl_router


def test_both_sides_are_listed_by_type(pd_router) -> None:  # type: ignore[no-untyped-def]
    assert sorted(w["worker_type"] for w in pd_router.workers()) == ["decode", "prefill"]
    assert pd_router.mode == "pd"


def test_generate_goes_through_both_sides(pd_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    before = served([*sgl_workers.prefill, *sgl_workers.decode])
    resp = pd_router.client.post("/generate", json={"text": "The capital of France is",
                                                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] <= 4
    after = served([*sgl_workers.prefill, *sgl_workers.decode])
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]


def test_chat_and_logprobs(pd_router) -> None:  # type: ignore[no-untyped-def]
    resp = pd_router.client.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2})
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) <= 2 for t in content)
