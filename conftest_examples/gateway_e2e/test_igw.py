"""The gateway mode (``--enable-igw``): the router starts with no worker and waits for workers added through its
API, as upstream's ``router/test_worker_api.py`` and the gateway's router-only fixtures do; and the worker API of a
regular router with its health checks off."""

from __future__ import annotations

import pytest
from conftest import completion, delta, model_id, served


@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(args=["--enable-igw"], policy="round_robin", scope="class")
class TestGatewayMode:
    def test_starts_without_workers_and_adds_them_live(self, sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
        for worker in sgl_workers:
            if worker.url not in {w["url"] for w in sgl_router.workers()}:
                sgl_router.add_worker(worker)
        assert {w["url"] for w in sgl_router.wait_for_workers(2)} == set(sgl_workers.urls)
        before = served(sgl_workers)
        for i in range(4):
            assert completion(sgl_router, f"igw {i}", model=model_id(sgl_workers[0])).status_code == 200
        assert sum(delta(sgl_workers, before)) == 4

    def test_a_removed_worker_gets_no_more_requests(self, sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
        sgl_router.wait_for_workers(2)  # as the previous test of the class left it
        assert sgl_router.remove_worker(sgl_workers[1]) == [sgl_workers[1].url]
        before = served(sgl_workers)
        for i in range(4):
            assert completion(sgl_router, f"after removal {i}", model=model_id(sgl_workers[0])).status_code == 200
        assert delta(sgl_workers, before) == [4, 0]
        assert sgl_workers[1].is_alive()  # the router let it go; the worker still runs


@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(workers="none", args=["--disable-health-check"])
def test_worker_api_with_health_checks_off(sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    assert sgl_router.workers() == []
    sgl_router.add_worker(sgl_workers[0])
    listed = sgl_router.wait_for_workers(1, healthy=False)
    assert listed[0]["url"] == sgl_workers[0].url
    assert completion(sgl_router, "unprobed").status_code == 200
