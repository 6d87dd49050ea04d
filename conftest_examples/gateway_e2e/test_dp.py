"""Data parallelism: a ``--dp-size 2`` worker behind a dp-aware router (one entry per rank) and behind a router that
is not dp-aware (one entry for the worker), as upstream attaches dp workers both ways."""

from __future__ import annotations

import pytest
from conftest import completion

pytestmark = pytest.mark.sgl_workers(count=1, args=["--dp-size", "2"])


@pytest.mark.sgl_router(policy="round_robin")
def test_a_dp_aware_router_lists_each_rank(sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    url = sgl_workers[0].url
    assert sorted(w["url"] for w in sgl_router.workers()) == [f"{url}@0", f"{url}@1"]
    for i in range(4):
        assert completion(sgl_router, f"dp {i}").status_code == 200
    assert sgl_workers[0].requests_served() >= 4


@pytest.mark.sgl_router(policy="round_robin", dp_aware=False)
def test_a_router_that_is_not_dp_aware_lists_the_worker_once(sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    assert [w["url"] for w in sgl_router.workers()] == [sgl_workers[0].url]
    assert completion(sgl_router, "dp, one entry").status_code == 200
