"""Power of two (upstream's ``load_balancing/test_power_of_two.py``): the router polls each worker's load and sends a
request to the less loaded of two; a worker made slow gets fewer requests under concurrent load. One member of the
group gets its own environment (a per-member setting of the workers marker)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from conftest import completion, delta, served

pytestmark = [
    # worker 0 answers every inference request 0.3 s late (the simulated engine's latency fault at launch)
    pytest.mark.sgl_workers(count=2, worker_env=[{"SGLSIM_FAULT": "latency=0.3"}, {}]),
    pytest.mark.sgl_router(policy="power_of_two", args=["--worker-startup-check-interval", "1"]),
]


def test_the_slow_worker_gets_fewer_requests(sgl_router, sgl_workers) -> None:  # type: ignore[no-untyped-def]
    if not sgl_workers[0].simulated:
        pytest.skip("the slow worker is the simulated engine's latency fault")
    if httpx.get(f"{sgl_workers[0].url}/get_load", timeout=10).status_code == 404:
        pytest.skip("this engine serves no /get_load, the only load sglang-router 0.3.2's power of two reads")
    before = served(sgl_workers)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        codes = list(pool.map(lambda i: completion(sgl_router, f"p2 {i}").status_code, range(120)))
    assert codes == [200] * 120
    slow, fast = delta(sgl_workers, before)
    assert slow < fast, (slow, fast)
