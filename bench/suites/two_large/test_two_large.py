"""Few, large worker configurations: N tests (env ``BENCH_LARGE_TESTS``, default 24) over each selected model,
with the default worker args. With ``--sgl-model a,b`` that is 2 configurations of N tests. Every test asks its
worker for ``BENCH_LARGE_TOKENS`` tokens (default 16); the engine's ``SGLSIM_TOKEN_SECONDS`` makes a test take
as long as a real e2e request would (the bench sets it), on the engine's side, as a GPU would.
"""

from __future__ import annotations

import os

import pytest

N = int(os.environ.get("BENCH_LARGE_TESTS", "24"))
TOKENS = int(os.environ.get("BENCH_LARGE_TOKENS", "16"))


@pytest.mark.parametrize("i", range(N))
def test_generate(sgl_worker, i):  # type: ignore[no-untyped-def]
    resp = sgl_worker.client.post("/generate", json={"text": f"request {i}",
                                                     "sampling_params": {"max_new_tokens": TOKENS}})
    assert resp.status_code == 200, resp.text
