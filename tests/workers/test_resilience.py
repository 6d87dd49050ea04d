"""The gateway's resilience scenarios (sglang ``sgl-router/py_test/integration/test_{retries,circuit_breaker,
fault_tolerance,payload_size}.py``, which use a hand-written mock worker) re-expressed with the plugin's
fixtures: simulated workers whose faults are switched per worker at run time (``POST /_sim/faults``), behind
the real router. Every response names the worker that served it (``X-SGLSim-Worker: <port>/<pid>``), which
the router passes through, so the tests count who served what without reading logs."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.router,
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="the sglang router is not installed: pip install 'pytest-sglworker[router]'"),
]

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "-p", "no:cacheprovider", "-rA"]

HELPERS = """
import collections
import time

import httpx
import pytest

def faults(worker, **values):
    resp = httpx.post(worker.url + "/_sim/faults", json=values, timeout=5)
    assert resp.status_code == 200, resp.text
    return resp.json()

def state(worker):
    resp = httpx.get(worker.url + "/_sim/faults", timeout=5)  # the faults in force and counters since set
    assert resp.status_code == 200, resp.text
    return resp.json()

def generate(router, text, **kwargs):
    return router.client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}}, **kwargs)

def served_by(resp):
    return resp.headers.get("X-SGLSim-Worker", "?").split("/")[0]

def port(worker):
    return str(worker.port)
"""

SCENARIOS = HELPERS + """
@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="round_robin", args=["--retry-max-retries", "3", "--retry-initial-backoff-ms", "10",
                                                    "--disable-circuit-breaker"])
def test_retries_hide_a_worker_that_fails_its_first_requests(sgl_router, sgl_workers):
    flaky = sgl_workers[0]
    faults(flaky, fail_first=3)
    codes = [generate(sgl_router, f"p{i}").status_code for i in range(8)]
    assert codes == [200] * 8
    assert state(flaky)["since_set"]["failed"] == 3  # the router did send them, and retried elsewhere


@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="round_robin", args=["--disable-retries", "--cb-failure-threshold", "2",
                                                    "--cb-success-threshold", "1", "--cb-timeout-duration-secs", "1",
                                                    "--cb-window-duration-secs", "10"])
def test_circuit_breaker_opens_on_a_failing_worker_and_closes_after_it_recovers(sgl_router, sgl_workers):
    bad, good = sgl_workers
    faults(bad, status=500)  # every inference request fails
    answers = [generate(sgl_router, f"p{i}") for i in range(12)]
    failures = [r for r in answers if r.status_code != 200]
    assert len(failures) == 2 and all(served_by(r) == port(bad) for r in failures)  # then the breaker opened
    assert all(served_by(r) == port(good) for r in answers[4:])
    faults(bad, reset=True)
    deadline = time.monotonic() + 15  # the breaker half-opens after its 1 s timeout, then closes on a success
    while time.monotonic() < deadline:
        if port(bad) in {served_by(generate(sgl_router, "probe")) for _ in range(4)}:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the circuit breaker never closed again")
    after = collections.Counter(served_by(generate(sgl_router, f"q{i}")) for i in range(8))
    assert after == {port(bad): 4, port(good): 4}


@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="round_robin", args=["--retry-max-retries", "3", "--retry-initial-backoff-ms", "10",
                                                    "--health-check-interval-secs", "1",
                                                    "--health-failure-threshold", "1"])
def test_a_worker_that_crashes_mid_stream(sgl_router, sgl_workers):
    for worker in sgl_workers:
        faults(worker, trickle=0.002)  # a slow stream, so that the crash lands in the middle of it
    body = {"text": "tell me a story", "sampling_params": {"max_new_tokens": 64}, "stream": True}
    lines = []
    with pytest.raises(httpx.RemoteProtocolError):  # the router does not resume or retry a broken stream
        with sgl_router.client.stream("POST", "/generate", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            victim = next(w for w in sgl_workers if port(w) == served_by(resp))
            for line in resp.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    victim.kill()
    assert any(line.startswith("data: ") for line in lines)
    survivor = next(w for w in sgl_workers if w is not victim)
    faults(survivor, reset=True)
    codes = [(r.status_code, served_by(r)) for r in (generate(sgl_router, f"p{i}") for i in range(6))]
    assert codes == [(200, port(survivor))] * 6  # retried away from the dead worker
    deadline = time.monotonic() + 15
    while {w["url"]: w["is_healthy"] for w in sgl_router.workers()}.get(victim.url) is not False:
        assert time.monotonic() < deadline, "the router never marked the dead worker unhealthy"
        time.sleep(0.2)


@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="round_robin", args=["--retry-max-retries", "3", "--retry-initial-backoff-ms", "10"])
def test_a_worker_that_crashes_on_its_second_request(sgl_router, sgl_workers):
    doomed = sgl_workers[0]
    doomed.expect_exit()  # its exit is this test's doing, not a death that fails it
    faults(doomed, die_after=2)
    codes = [generate(sgl_router, f"p{i}").status_code for i in range(8)]
    assert not doomed.is_alive()
    assert codes.count(200) >= 7, codes  # at most the request that died with it is lost


@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(args=["--max-payload-size", "2000"])
def test_payload_limits_of_the_router_and_of_the_worker(sgl_router, sgl_workers):
    resp = sgl_router.client.post("/generate", json={"text": "x" * 5000, "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 413  # refused by the router itself
    assert state(sgl_workers[0])["served"] == 0
    faults(sgl_workers[0], max_payload=500)
    resp = sgl_router.client.post("/generate", json={"text": "y" * 1000, "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 413 and "exceeds the limit of 500 bytes" in resp.text  # the worker's answer
    assert generate(sgl_router, "small").status_code == 200


@pytest.mark.sgl_workers(count=1, args=["--api-key", "sekrit"])
@pytest.mark.sgl_router(args=["--api-key", "sekrit"])
def test_api_key(sgl_router, sgl_workers):
    assert generate(sgl_router, "no key").status_code == 401
    assert generate(sgl_router, "wrong", headers={"Authorization": "Bearer nope"}).status_code == 401
    resp = generate(sgl_router, "right", headers=sgl_router.auth_headers)
    assert resp.status_code == 200 and served_by(resp) == port(sgl_workers[0])
    direct = httpx.post(sgl_workers[0].url + "/generate", json={"text": "hi"}, timeout=10)
    assert direct.status_code == 401  # the worker checks it too
    assert [w["is_healthy"] for w in sgl_router.workers()] == [True]  # the plugin's own calls send the key
"""


def test_gateway_resilience_scenarios_through_the_real_router(pytester: pytest.Pytester,
                                                               sim_env: dict[str, str]) -> None:
    pytester.makepyfile(test_scenarios=SCENARIOS)
    result = pytester.runpytest_subprocess(*SIM, timeout=240)
    result.assert_outcomes(passed=6)


def test_an_unexpected_crash_still_fails_the_test(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    """Without expect_exit(), a worker that dies during a passing test fails it (the guard
    test_a_worker_that_crashes_on_its_second_request relies on being explicit)."""
    pytester.makepyfile(test_crash=HELPERS + """
@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="round_robin", args=["--retry-max-retries", "3", "--retry-initial-backoff-ms", "10"])
def test_crash(sgl_router, sgl_workers):
    faults(sgl_workers[0], die_after=1)
    for i in range(4):
        generate(sgl_router, f"p{i}")
""")
    result = pytester.runpytest_subprocess(*SIM, timeout=120)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*exited with code -9 (SIGKILL) during the test*"])


def test_bad_fault_settings_are_said_clearly(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    """An unknown fault or a value out of range: a usage error at collection listing the faults (marker or spec
    env); the control endpoint answers 400 with the same line; a worker started with one outside the marker
    path is diagnosed as such, not as 'log shows no error'."""
    pytester.makepyfile(test_bad="""
import pytest

@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "fial_first=2"})
def test_typo(sgl_worker): pass
""")
    result = pytester.runpytest_subprocess(*SIM, timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_typo*: env SGLSIM_FAULT='fial_first=2': unknown fault 'fial_first' "
                                 "(known: crash_oom, *fail_first=...*); the faults and their values: "
                                 "python -m pytest_sglworker.sim --help"])
    pytester.makepyfile(test_bad=HELPERS + """
def test_control_endpoint(sgl_worker):
    for body, said in [({"fial_first": 1}, "unknown fault 'fial_first'"),
                       ({"fail_rate": 7}, "between 0 and 1")]:
        resp = httpx.post(sgl_worker.url + "/_sim/faults", json=body, timeout=5)
        assert resp.status_code == 400 and said in resp.text, resp.text

def test_spawned(sgl_spawn_worker):
    sgl_spawn_worker(env={"SGLSIM_FAULT": "latency=-1"})  # the factory's env is not seen at collection
""")
    result = pytester.runpytest_subprocess(*SIM, timeout=60)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["worker qwen3-0.6b: the simulated engine refused its faults: *latency* — exited "
                                 "during startup with code 2 after * s*",
                                 "FAILED *test_spawned* - Failed: worker qwen3-0.6b: the simulated e*"])
