"""The real sglang router (``sglang-router`` from PyPI) in front of simulated workers, through the
``sgl_router`` fixture, as a router e2e suite uses it: regular mode and its policies, a worker dying under
load, the worker API, PD mode, dp-aware mode, and the router's own failures. Skipped with the install
command when the router package is missing."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import psutil
import pytest
from port_grab import grab_launcher

pytestmark = [
    pytest.mark.router,
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="the sglang router is not installed: pip install 'pytest-sglworker[router]'"),
]

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "-p", "no:cacheprovider"]

COUNT = """
def served_by(workers):
    # requests each worker answered, from its own log
    return [w.log_text().count('"POST /generate HTTP/1.1" 200') for w in workers]

def generate(router, text, n=2):
    resp = router.client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": n}})
    assert resp.status_code == 200, resp.text
    return resp.json()
"""


def _run(pytester: pytest.Pytester, *args: str, timeout: float = 180) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*SIM, *args, timeout=timeout)


def test_regular_mode_round_robin_cache_aware_and_a_dead_worker(pytester: pytest.Pytester,
                                                                 sim_env: dict[str, str]) -> None:
    pytester.makepyfile(COUNT + """
import os, signal
import pytest

@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="round_robin")
def test_round_robin_splits(sgl_router, sgl_workers):
    before = served_by(sgl_workers)
    for i in range(8):
        generate(sgl_router, f"prompt {i}")
    after = served_by(sgl_workers)
    assert [a - b for a, b in zip(after, before)] == [4, 4]
    assert sgl_router.url.startswith("http://127.0.0.1:")
    assert {w["url"] for w in sgl_router.workers()} == set(sgl_workers.urls)
    assert all(w["is_healthy"] for w in sgl_router.workers())

@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="cache_aware")
def test_cache_aware_affinity(sgl_router, sgl_workers):
    before = served_by(sgl_workers)
    for _ in range(6):
        generate(sgl_router, "the same long shared prefix of a conversation " * 4)
    delta = [a - b for a, b in zip(served_by(sgl_workers), before)]
    assert sorted(delta) == [0, 6], delta

@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="round_robin")
def test_worker_killed_mid_test(sgl_router, sgl_workers):
    generate(sgl_router, "warm")
    sgl_workers[0].kill(signal.SIGKILL)
    sgl_workers[0].process.wait(10)
    for i in range(8):
        generate(sgl_router, f"after the crash {i}")  # the router retries on the live worker
"""
                        )
    result = _run(pytester, "--sgl-gpus", "sim:2", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["router (round_robin) over qwen3-0.6b [[]2x[]]: 2 launched*0 died*"])


def test_worker_api_add_and_remove(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile(COUNT + """
import pytest

@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(policy="round_robin")
def test_add_remove(sgl_router, sgl_workers, sgl_spawn_worker):
    extra = sgl_spawn_worker()
    sgl_router.add_worker(extra.url)
    listed = sgl_router.wait_for_workers(2)
    assert {w["url"] for w in listed} == {sgl_workers[0].url, extra.url}
    for i in range(6):
        generate(sgl_router, f"spread {i}")
    assert served_by([extra])[0] > 0
    assert sgl_router.remove_worker(extra) == [extra.url]
    assert extra.is_alive()  # the router stops sending it requests; the worker keeps running
    assert [w["url"] for w in sgl_router.workers()] == [sgl_workers[0].url]
    before = served_by([extra])[0]
    for i in range(4):
        generate(sgl_router, f"only the first {i}")
    assert served_by([extra])[0] == before
"""
                        )
    result = _run(pytester, "--sgl-gpus", "sim:2", "--sgl-report", "report.json")
    result.assert_outcomes(passed=1)
    workers = json.loads((pytester.path / "report.json").read_text())["workers"]
    assert sum(w["stops"] for w in workers.values()) == 0  # a removal from the router stops no worker
    assert sum(w["deaths"] for w in workers.values()) == 0


def test_router_is_loopback_only_and_leaves_nothing(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
import psutil
import pytest

PIDS = []

@pytest.mark.sgl_workers(count=1)
def test_listens_on_loopback(sgl_router):
    argv = sgl_router.argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert int(argv[argv.index("--prometheus-port") + 1]) == sgl_router.ports["prometheus"]
    conns = psutil.Process(sgl_router.pid).net_connections(kind="tcp")
    listening = {c.laddr.port: c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
    assert listening and set(listening.values()) == {"127.0.0.1"}, listening
    assert sgl_router.log_path.name == f"sglang-router-{sgl_router.port}.log"
    PIDS.append(sgl_router.pid)

def test_gone_after_its_test():
    assert not psutil.pid_exists(PIDS[0]) or psutil.Process(PIDS[0]).status() == psutil.STATUS_ZOMBIE
"""
                        )
    _run(pytester, "--sgl-gpus", "sim:1").assert_outcomes(passed=2)


def test_a_router_that_dies_fails_fast_with_its_log(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
import pytest

@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(args=["--policy", "no-such-policy"])
def test_bad_router(sgl_router):
    raise AssertionError("never reached")
"""
                        )
    result = _run(pytester, "--sgl-gpus", "sim:1", "--sgl-startup-timeout", "300", timeout=120)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*router (regular) over qwen3-0.6b*exited during startup with code 2*",
                                 "*first error*invalid choice: 'no-such-policy'*", "*log: *sglang-router-*.log",
                                 "*… the first error, quoted above …"])


def test_a_router_that_never_gets_ready_times_out(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile(never_ready="""
import sys, time
time.sleep(600)
""")
    pytester.makepyfile("""
import pytest

@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(startup_timeout=3)
def test_hangs(sgl_router):
    raise AssertionError("never reached")
"""
                        )
    result = _run(pytester, "--sgl-gpus", "sim:1", "--sgl-router-launcher",
                  f"{sys.executable} {pytester.path / 'never_ready.py'}", timeout=120)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*router (regular)*did not become ready within 3 s (last router answer: not "
                                 "listening yet)*"])


def test_missing_router_package_skips_with_the_install_command(pytester: pytest.Pytester,
                                                               sim_env: dict[str, str]) -> None:
    pytester.makeconftest("""
import importlib.util

_find = importlib.util.find_spec

def _no_router(name, *args, **kwargs):
    return None if name == "sglang_router" else _find(name, *args, **kwargs)

importlib.util.find_spec = _no_router
""")
    pytester.makepyfile("""
def test_needs_router(sgl_router):
    raise AssertionError("never reached")
""")
    result = _run(pytester, "--sgl-gpus", "sim:1", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*the sglang router is not installed*pip install 'pytest-sglworker[[]router[]]'*"])
    assert "launched" not in result.stdout.str()  # skipped at collection: no worker was started for it


@pytest.mark.parametrize("named_folder", [False, True], ids=["not-installed", "named-folder-lacks-it"])
def test_a_router_without_its_vocabulary_skips_with_the_install_command(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        named_folder: bool) -> None:
    """The gateway mode's router dies at startup when it can neither read nor download o200k_base.tiktoken (a
    stand-in router prints the real one's panic): with nothing installed, the test is skipped with the install
    command, as the other optional tiers are; a folder the user named (TIKTOKEN_ENCODINGS_BASE) that lacks the
    file is the test's error, with the same fix."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))  # no default install either
    if named_folder:
        monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))
    else:
        monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    pytester.makepyfile(no_vocab_router="""
import sys
print("thread 'main' panicked at src/routers/grpc/harmony.rs:42:10:", file=sys.stderr)
print("Failed to load Harmony encoding: failed to download o200k_base.tiktoken", file=sys.stderr)
sys.exit(101)
""")
    pytester.makepyfile("""
import pytest

@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(args=["--enable-igw"])
def test_gateway(sgl_router):
    raise AssertionError("never reached")
""")
    result = _run(pytester, "--sgl-gpus", "sim:1", "-rs", "--sgl-router-launcher",
                  f"{sys.executable} {pytester.path / 'no_vocab_router.py'}", timeout=120)
    if named_folder:
        result.assert_outcomes(errors=1)
    else:
        result.assert_outcomes(skipped=1)
        result.stdout.fnmatch_lines(["SKIPPED*the router died at startup without its vocabulary*"])
        # a skipped optional tier is not a failed start in the run's summary; the router's log is still kept
        router_line = next(line for line in result.outlines if line.startswith("router") and "launched" in line)
        assert ", 0 failed to start" in router_line, router_line
        result.stdout.fnmatch_lines(["*log kept: *sglang-router-*.log (kept 7 days, until *)"])
    result.stdout.fnmatch_lines(["*o200k_base.tiktoken*run 'sglworker install-router-vocab', or set "
                                 "TIKTOKEN_ENCODINGS_BASE to a folder that holds it*"])


def test_no_port_for_the_router_is_a_clear_error(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
import pytest

@pytest.mark.sgl_workers(count=1)
def test_no_port_left(sgl_router):
    raise AssertionError("never reached: the worker holds the range's only port block")
"""
                        )
    result = _run(pytester, "--sgl-gpus", "sim:1", "--sgl-port-range", "21500-21503", "--sgl-lease-timeout", "2",
                  timeout=120)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*no free block of 4 ports in 21500-21503*"])
    assert "INTERNALERROR" not in result.stdout.str()


GRAB_ROUTER = grab_launcher("sglang_router.launch_router")


@pytest.mark.parametrize("leaves", [False, True], ids=["taker-stays", "taker-leaves"])
def test_router_port_taken_between_reservation_and_bind_is_retried_on_another_block(
    pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, leaves: bool
) -> None:
    """A foreign process binds the router's reserved port before the router does: the router exits with
    "Address already in use", and the fixture starts it again on another port block, whether the foreign process
    still listens there or has left once the router's log showed the failure; a foreign process that stays is left
    alone."""
    pytester.makepyfile(grab_router=GRAB_ROUTER)
    flag = pytester.path / "grabbed"
    monkeypatch.setenv("GRAB_FLAG", str(flag))
    if leaves:
        monkeypatch.setenv("GRAB_LEAVE", "1")
    pytester.makepyfile(test_grab="""
import os
import pytest

@pytest.mark.sgl_workers(count=1)
def test_serves_on_another_port(sgl_router, sgl_workers):
    grabbed = int(open(os.environ["GRAB_FLAG"]).read().split()[0])
    assert sgl_router.port != grabbed
    assert [w["url"] for w in sgl_router.wait_for_workers(1)] == sgl_workers.urls
    resp = sgl_router.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 200, resp.text
""")
    try:
        result = _run(pytester, "--sgl-gpus", "sim:1", "--sgl-router-launcher",
                      f"{sys.executable} {pytester.path / 'grab_router.py'}", "--sgl-report", "report.json",
                      "test_grab.py", timeout=120)
        result.assert_outcomes(passed=1)
        port, foreign = (int(x) for x in flag.read_text().split())
        # The foreign listener really held the first port: the router's bind failed there and was retried.
        text = (Path(sim_env["SGLWORKER_LOG_DIR"]) / f"sglang-router-{port}.log").read_text()
        assert "address already in use" in text.lower()
        routers = [r for r in json.loads((pytester.path / "report.json").read_text())["launches"]
                   if r["role"] == "router"]
        assert len(routers) == 2, routers
        assert (routers[0]["port"], routers[0]["outcome"]) == (port, "startup_failed")
        assert routers[1]["port"] != port and routers[1]["outcome"] != "startup_failed"
        if not leaves:
            assert psutil.pid_exists(foreign) and psutil.Process(foreign).status() != psutil.STATUS_ZOMBIE
    finally:
        if flag.exists():
            with contextlib.suppress(psutil.Error):
                psutil.Process(int(flag.read_text().split()[1])).kill()


@pytest.fixture
def pd_sim() -> None:
    sim_pd = Path(__file__).resolve().parents[2] / "pytest_sglworker" / "sim" / "pd.py"
    if not sim_pd.exists():
        pytest.skip("the simulated engine has no PD support in this tree")


def test_pd_mode(pytester: pytest.Pytester, sim_env: dict[str, str], pd_sim: None) -> None:
    pytester.makepyfile("""
import pytest

@pytest.mark.sgl_workers(prefill=1, decode=1)
def test_pd(sgl_router, sgl_workers):
    assert sgl_router.mode == "pd"
    argv = sgl_router.argv
    assert "--pd-disaggregation" in argv
    prefill, decode = sgl_workers.prefill[0], sgl_workers.decode[0]
    at = argv.index("--prefill")
    assert argv[at + 1: at + 3] == [prefill.url, str(prefill.bootstrap_port)]
    assert argv[argv.index("--decode") + 1] == decode.url
    chat = sgl_router.client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    gen = sgl_router.client.post("/generate", json={"text": "hi there", "sampling_params": {"max_new_tokens": 3},
                                                    "return_logprob": True, "logprob_start_len": 0})
    assert gen.status_code == 200, gen.text
    meta = gen.json()["meta_info"]
    assert meta["input_token_logprobs"] and meta["output_token_logprobs"]
"""
                        )
    _run(pytester, "--sgl-gpus", "sim:2").assert_outcomes(passed=1)


def test_dp_aware_router(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile(COUNT + """
import pytest

@pytest.mark.sgl_workers(count=1, args=["--dp-size", "2"])
def test_dp(sgl_router, sgl_workers):
    assert "--dp-aware" in sgl_router.argv
    assert sgl_workers[0].gpus == "0,1"
    listed = sgl_router.workers()
    assert sorted(w["url"] for w in listed) == [sgl_workers[0].url + "@0", sgl_workers[0].url + "@1"], listed
    for i in range(4):
        generate(sgl_router, f"dp {i}")
"""
                        )
    _run(pytester, "--sgl-gpus", "sim:2").assert_outcomes(passed=1)
