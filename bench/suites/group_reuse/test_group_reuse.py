"""Worker groups reused across tests, for bench/run.py part ``reuse`` (run with ``--sgl-gpus sim:2`` and
``-k test_regular`` or ``-k test_pd``, pooled or with ``--sgl-reuse off``).

- ``test_regular``: a 2-worker regular group; each test sends one small ``/generate`` to each member.
- ``test_pd``: a 1 prefill + 1 decode group; each test asks each member its ``/server_info`` (a request through
  the pair needs a router: that is part ``groups``).

``BENCH_GROUP_REUSE_TESTS`` tests of each (default 20). Pooled, each shape is one configuration launched once;
with ``--sgl-reuse off`` every test launches its group and tears it down.
"""

from __future__ import annotations

import os

import pytest

N = int(os.environ.get("BENCH_GROUP_REUSE_TESTS", "20"))


@pytest.mark.sgl_workers(count=2)
@pytest.mark.parametrize("i", range(N))
def test_regular(sgl_workers, i):  # type: ignore[no-untyped-def]
    for worker in sgl_workers:
        resp = worker.client.post("/generate", json={"text": "hello group", "sampling_params": {"max_new_tokens": 4}})
        assert resp.status_code == 200, resp.text


@pytest.mark.sgl_workers(prefill=1, decode=1)
@pytest.mark.parametrize("i", range(N))
def test_pd(sgl_workers, i):  # type: ignore[no-untyped-def]
    for worker in sgl_workers:
        resp = worker.client.get("/server_info")
        assert resp.status_code == 200 and resp.json()["disaggregation_mode"] == worker.role, resp.text
