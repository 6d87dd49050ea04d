"""Worker fixtures as users meet them: real pytest sessions (runpytest_subprocess) against real simulated
engine subprocesses on loopback. Every test is also checked for leftover processes (tests/conftest.py)."""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pytest_sglworker import ModelSpec, WorkerStartupError, WorkerStartupTimeout, spawn_worker
from pytest_sglworker.resources.ports import PORT_BLOCK_SIZE, reserve_port_block
from pytest_sglworker.workers.launcher import LaunchOptions, sim_launcher

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "-p", "no:cacheprovider"]
QWEN = ModelSpec("qwen3-0.6b", "Qwen/Qwen3-0.6B", 4, features=frozenset({"chat", "streaming"}))


def _run(pytester: pytest.Pytester, *args: str, timeout: float = 120) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*SIM, *args, timeout=timeout)


def test_worker_serves_and_is_reused(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import os

        PIDS = []

        def test_generate(sgl_worker):
            assert sgl_worker.host == "127.0.0.1"
            resp = sgl_worker.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
            assert resp.status_code == 200
            assert resp.json()["meta_info"]["completion_tokens"] <= 4
            assert sgl_worker.log_path.name == f"sglang-worker-{sgl_worker.port}.log"
            assert "--mem-fraction-static=0.6" in sgl_worker.argv
            assert sgl_worker.argv[sgl_worker.argv.index("--host") + 1] == "127.0.0.1"
            PIDS.append(sgl_worker.pid)

        def test_chat(sgl_worker):
            resp = sgl_worker.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert resp.json()["object"] == "chat.completion"
            PIDS.append(sgl_worker.pid)

        def test_same_worker_was_reused():
            assert len(set(PIDS)) == 1, PIDS
    """)
    result = _run(pytester, "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*sglang workers*", "qwen3-0.6b: 1 launched, 1 reused*"])


def test_startup_exit_fails_fast_with_code_diagnosis_and_tail(pytester: pytest.Pytester,
                                                               sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "crash_oom"})
        def test_oom(sgl_worker):
            raise AssertionError("never reached")
    """)
    result = _run(pytester, "--sgl-startup-timeout", "300")
    result.assert_outcomes(errors=1)
    # failing fast: the failure is the exit, seen when it happened, not the 300 s startup timeout running out
    result.stdout.fnmatch_lines([
        "*worker qwen3-0.6b: CUDA out of memory while capturing the prefill CUDA graph — exited during startup "
        "with code -9 (SIGKILL) after * s (on 127.0.0.1:*",
        "*memory ledger (predicted for this GPU):*",
        "*the ledger predicted 'fits'*",
        "*log: *sglang-worker-*.log",
        "*last lines of the log*:",
    ])
    out = result.stdout.str()
    # the tail is there: the assertion as a line of the log's tail (the diagnosis names it too, above the tail)
    tail = list(itertools.takewhile(lambda line: line.startswith("    "),
                                    out.split("last lines of the log", 1)[1].splitlines()[1:]))
    # the assertion is quoted under "not the cause" above and marked where it stands in the tail; the tail's own
    # lines are there (a blank tail fails this)
    assert any("markCaptureEnd called with no captures in progress" in line or "not the cause, quoted above" in line
               for line in tail), out
    assert any("kill_process_tree called" in line for line in tail), out
    assert re.search(r"not the cause: .*markCaptureEnd", out)
    assert "did not become healthy within" not in out
    # the failed worker's log is kept and named in the summary
    logs = list(Path(sim_env["SGLWORKER_LOG_DIR"]).glob("sglang-worker-*.log"))
    assert len(logs) == 1 and "Capture" in logs[0].read_text()
    result.stdout.fnmatch_lines(["*log kept: *sglang-worker-*.log (kept 7 days, until *)"])


def test_startup_timeout_reports_details(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "hang"})
        def test_hang(sgl_worker):
            pass
    """)
    result = _run(pytester, "--sgl-startup-timeout", "3")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        "*did not become healthy within 3 s (last health answer: *)*",
        "*log: *sglang-worker-*.log",
    ])


def test_log_flood_does_not_block(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "flood=8"})
        def test_flood(sgl_worker):
            assert sgl_worker.client.get("/health").status_code == 200
            assert sgl_worker.log_path.stat().st_size > 8 * 1024 * 1024
    """)
    result = _run(pytester, "--sgl-keep-logs", "--sgl-startup-timeout", "60")
    result.assert_outcomes(passed=1)


def test_failed_test_gets_worker_log_section(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        def test_fails(sgl_worker):
            sgl_worker.client.get("/v1/models")
            assert False, "router bug"
    """)
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*- sglang worker qwen3-0.6b 127.0.0.1:* -*",
        "log: *sglang-worker-*.log",
        "last lines of the log*:",
        "*The server is fired up and ready to roll!*",
    ])
    # the log of a worker whose test failed is kept
    assert list(Path(sim_env["SGLWORKER_LOG_DIR"]).glob("sglang-worker-*.log"))


def test_passing_worker_log_is_removed_under_the_failed_policy(pytester: pytest.Pytester,
                                                                sim_env: dict[str, str]) -> None:
    pytester.makepyfile("def test_ok(sgl_worker): pass")
    _run(pytester, "--sgl-log-retention-policy", "failed").assert_outcomes(passed=1)
    assert not list(Path(sim_env["SGLWORKER_LOG_DIR"]).glob("sglang-worker-*.log"))


def test_worker_death_during_test_is_reported_and_next_test_gets_fresh_worker(
    pytester: pytest.Pytester, sim_env: dict[str, str]
) -> None:
    pytester.makepyfile("""
        import pytest

        PIDS = []

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_after=1"})
        def test_a(sgl_worker):
            import time
            PIDS.append(sgl_worker.pid)
            # the first inference request is answered, then the engine dies
            sgl_worker.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
            deadline = time.monotonic() + 10
            while sgl_worker.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_after=1"})
        def test_b(sgl_worker):
            PIDS.append(sgl_worker.pid)
            assert PIDS[0] != PIDS[1]
    """)
    result = _run(pytester, "-p", "no:randomly")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 2 and outcomes.get("errors") == 1, outcomes
    result.stdout.fnmatch_lines(["*exited with code -9 (SIGKILL) during the test*"])


def test_teardown_kills_escaped_child_and_sigterm_ignorer(pytester: pytest.Pytester,
                                                          sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import pytest, psutil

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child,ignore_sigterm"})
        def test_escape(sgl_worker):
            import re, time
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and "spawned scheduler pid=" not in sgl_worker.log_text():
                time.sleep(0.05)
            pid = int(re.search(r"spawned scheduler pid=(\\d+)", sgl_worker.log_text()).group(1))
            child = psutil.Process(pid)
            assert child.is_running()
            assert os.getpgid(pid) != os.getpgid(sgl_worker.pid)  # it left the process group
            with open("escaped.pid", "w") as fh:
                fh.write(str(pid))
    """.replace("import pytest, psutil", "import os, pytest, psutil"))
    result = _run(pytester)
    result.assert_outcomes(passed=1)
    pid = int((pytester.path / "escaped.pid").read_text())
    import psutil

    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _listening_socket() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_stale_server_on_port_is_not_mistaken_for_ready(tmp_path: Path) -> None:
    """A server left on the port answers 200, but it is not our child: spawn must not return it."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    stale_log = open(tmp_path / "stale.log", "wb")
    stale = subprocess.Popen(
        [*sim_launcher(), "--model-path", "stale/model", "--port", str(port), "--skip-server-warmup"],
        stdout=stale_log, stderr=subprocess.STDOUT, env={**os.environ, "SGLSIM_STARTUP_SECONDS": "0"},
    )
    stale_log.close()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health_generate", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "stale server did not come up"
            time.sleep(0.05)
        options = LaunchOptions(launcher=tuple(sim_launcher()), log_dir=tmp_path / "logs", startup_timeout=20)
        with pytest.raises((WorkerStartupError, WorkerStartupTimeout)) as info:
            spawn_worker(QWEN, port=port, options=options, env={"SGLSIM_STARTUP_SECONDS": "0"})
        message = str(info.value)
        # the engine logs the failed bind and stays alive (as sglang 0.5.23 does): the wait ends early anyway
        assert "logged a fatal error during startup and did not exit" in message
        assert "address already in use" in message.lower()
        assert message.splitlines()[0].endswith(f"(on 127.0.0.1:{port}, pid {info.value.process.pid})"), message
        assert "first error (log line " in message
    finally:
        stale.terminate()
        stale.wait(10)


def test_spawn_worker_outside_pytest(tmp_path: Path) -> None:
    options = LaunchOptions(launcher=tuple(sim_launcher()), log_dir=tmp_path / "logs",
                            lock_dir=tmp_path / "locks", startup_timeout=30)
    with spawn_worker(QWEN, options=options, env={"SGLSIM_STARTUP_SECONDS": "0.1"}) as worker:
        assert worker.is_alive()
        info = worker.client.get("/model_info").json()
        assert info["model_path"] == "Qwen/Qwen3-0.6B"
        pid = worker.pid
    assert not worker.is_alive()
    import psutil

    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_missing_launcher_is_a_clear_error(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1",
                                           "--sgl-launcher", "/nonexistent/python -m sglang.launch_server")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*launcher '/nonexistent/python' not found*"])


def test_a_launcher_that_never_flushes_still_has_its_last_line_in_the_failure_tail(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Python buffers a stdout that is a file; an engine killed during startup (the OOM killer's SIGKILL) never
    flushes it. The worker's environment makes Python's stdout unbuffered, so its last words are in the log, and in
    the failure's tail, instead of an empty log. (The session itself runs without PYTHONUNBUFFERED, as most do:
    only the plugin can have set it for the worker.)"""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    script = Path(__file__).resolve().parents[1] / "engine_scripts" / "unflushed.py"
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1", "-p", "no:cacheprovider",
                                           "--sgl-launcher", f"{sys.executable} {script}", timeout=120)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*exited during startup with code -9 (SIGKILL)*", "*last lines of the log*:"])
    out = result.stdout.str()
    tail = list(itertools.takewhile(lambda line: line.startswith("    "),
                                    out.split("last lines of the log", 1)[1].splitlines()[1:]))
    assert tail and tail[-1].strip() == "unflushed engine: loading the weights failed, dying now", out


def test_a_process_that_left_the_workers_tree_and_session_is_ended_with_the_worker(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's helper that double-forks and calls setsid (as a daemon does) is neither a descendant of the worker
    nor in its session: only the owner tag it inherited finds it. The worker's own teardown (a fresh worker, ended
    after its test) ends it, not only the session's sweep at the end."""
    script = Path(__file__).resolve().parents[1] / "engine_scripts" / "double_fork_engine.py"
    monkeypatch.setenv("DOUBLE_FORK_PID_FILE", str(pytester.path / "escaped.pid"))
    pytester.makepyfile("""
        import json
        import os
        import time

        import psutil
        import pytest

        @pytest.mark.sgl_worker(fresh=True)
        def test_escaped(sgl_worker):
            deadline = time.monotonic() + 30
            while not os.path.exists(os.environ["DOUBLE_FORK_PID_FILE"]) and time.monotonic() < deadline:
                time.sleep(0.02)
            pid = int(open(os.environ["DOUBLE_FORK_PID_FILE"]).read())
            escaped = psutil.Process(pid)
            assert pid not in [p.pid for p in psutil.Process(sgl_worker.pid).children(recursive=True)]
            assert os.getsid(pid) not in (sgl_worker.pid, os.getsid(sgl_worker.pid))
            assert escaped.environ()["SGLWORKER_OWNER"] == psutil.Process(sgl_worker.pid).environ()["SGLWORKER_OWNER"]
            with open("escaped.json", "w") as fh:
                json.dump({"pid": pid, "created": escaped.create_time()}, fh)

        def test_gone_after_the_workers_teardown():
            seen = json.load(open("escaped.json"))
            try:
                escaped = psutil.Process(seen["pid"])
                alive = escaped.create_time() == seen["created"] and escaped.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            assert not alive, "the escaped process outlived its worker's teardown"
    """)
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1", "-p", "no:cacheprovider",
                                           "-p", "no:randomly", "--sgl-launcher", f"{sys.executable} {script}",
                                           timeout=120)
    result.assert_outcomes(passed=2)


def test_sgl_spawn_worker_factory(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        def test_two(sgl_spawn_worker):
            a = sgl_spawn_worker("qwen3-0.6b")
            b = sgl_spawn_worker("llama-1b", args=["--max-total-tokens", "512"], env={"X_TEST": "1"})
            assert a.port != b.port and a.pid != b.pid
            assert b.client.get("/server_info").json()["max_total_num_tokens"] == 512

        def test_budget(sgl_spawn_worker):
            import pytest
            from pytest_sglworker import BudgetViolation
            with pytest.raises(BudgetViolation, match="breaks the mandatory worker budget"):
                sgl_spawn_worker("qwen3-0.6b", args=["--mem-fraction-static", "0.9"])
    """)
    _run(pytester).assert_outcomes(passed=2)


def test_embedding_spec_through_the_fixtures(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    """A spec served with ``--is-embedding`` (feature ``embedding``) through ``sgl_worker`` and
    ``sgl_spawn_worker``: ``/v1/embeddings`` answers one vector per input, each as long as the hidden size
    the simulated engine takes for the model; a test that requires the feature skips the generation model."""
    pytester.makeconftest("""
        from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("qwen3-embed", "Qwen/Qwen3-0.6B", 4, features={"embedding"},
                                   worker_args=(*CI_WORKER_ARGS, "--is-embedding")))
    """)
    pytester.makepyfile("""
        import pytest
        from pytest_sglworker.sim.main import model_facts

        def embed(worker, inputs):
            resp = worker.client.post("/v1/embeddings", json={"model": worker.spec.model, "input": inputs})
            assert resp.status_code == 200, resp.text
            return [d["embedding"] for d in resp.json()["data"]]

        @pytest.mark.sgl_requires("embedding")
        def test_embeddings(sgl_worker, sgl_model):
            assert sgl_model.name == "qwen3-embed" and "--is-embedding" in sgl_worker.argv
            assert sgl_worker.client.get("/model_info").json()["is_generation"] is False
            hidden = model_facts(sgl_model.model).hidden_size
            assert hidden and [len(v) for v in embed(sgl_worker, ["hello", "a longer sentence"])] == [hidden] * 2

        def test_spawned(sgl_spawn_worker):
            worker = sgl_spawn_worker("qwen3-embed")
            (vector,) = embed(worker, "one input")
            assert len(vector) == model_facts(worker.spec.model).hidden_size
            assert all(isinstance(x, float) for x in vector)
    """)
    result = pytester.runpytest_subprocess("--sgl-engine", "sim", "--sgl-model", "qwen3-embed,qwen3-0.6b",
                                           "-p", "no:cacheprovider", "-rs", timeout=120)
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*qwen3-0.6b*embedding*"])


def test_example_router_e2e_suite_runs_on_the_sim(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    """The README's first command runs this suite: keep it green."""
    import shutil

    examples = Path(__file__).resolve().parents[2] / "conftest_examples"
    shutil.copytree(examples / "router_e2e", pytester.path / "router_e2e")
    result = pytester.runpytest_subprocess("router_e2e", *SIM, timeout=300)
    result.assert_outcomes(passed=9)
    # one pooled group per configuration (the crash test retires its group), the real router per test
    result.stdout.fnmatch_lines(["qwen3-0.6b [[]2x[]]: 1 launched, 4 reused*0 died, 1 stopped*",
                                 "qwen3-0.6b [[]1P+1D[]]: 1 launched, 2 reused*",
                                 "qwen3-0.6b [[]1x[]] --dp-size 2: 1 launched*"])
    assert not re.search(r"\[sglworker\] \d+ s ", result.stdout.str())  # quick startups show no status line


def test_kept_log_keeps_its_path_when_the_port_is_reused(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                         tmp_path: Path) -> None:
    """Two workers on the same port (a range of one block), one after the other: the first one's kept log is not
    overwritten by the second's. The block is one that is free now (bound and closed by the plugin's own check),
    not a fixed one: a fixed block (it was 21000-21003, sglang's default test port, which other suites of this
    machine use) held by any other process made the inner session wait for it until pytester's timeout."""
    with reserve_port_block(tmp_path / "probe-locks") as block:
        low = block.port
    pytester.makepyfile("""
        def test_fails(sgl_worker):
            assert False, "router bug"

        def test_passes_after(sgl_spawn_worker):
            sgl_spawn_worker("qwen3-0.6b")
    """)
    result = _run(pytester, "--sgl-port-range", f"{low}-{low + PORT_BLOCK_SIZE - 1}", "-p", "no:randomly",
                  "--sgl-log-retention-policy", "failed", timeout=300)  # one block: the same port twice
    result.assert_outcomes(passed=1, failed=1)
    kept = [line.split("log kept: ", 1)[1].split(" (kept ", 1)[0]
            for line in result.stdout.lines if "log kept: " in line]
    assert kept and all(Path(path).exists() for path in kept), kept
    assert Path(kept[0]).name == f"sglang-worker-{low}.log", kept
    assert "router bug" not in Path(kept[0]).read_text() and "fired up" in Path(kept[0]).read_text()
    assert [p.name for p in Path(sim_env["SGLWORKER_LOG_DIR"]).glob("*.log")] == [Path(kept[0]).name]


def test_hook_failure_does_not_leak_the_gpu_lease(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makeconftest("""
        CALLS = []

        def pytest_sglworker_worker_env(spec, lease_env):
            CALLS.append(1)
            if len(CALLS) == 1:
                raise RuntimeError("hook bug")
            return None
    """)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(fresh=True)
        def test_one(sgl_worker): pass

        @pytest.mark.sgl_worker(fresh=True)
        def test_two(sgl_worker): pass
    """)
    result = _run(pytester, "--sgl-gpus", "sim:1", "--sgl-lease-timeout", "5", "-p", "no:randomly")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*RuntimeError: hook bug*"])


def test_outside_pytest_the_readme_example_runs_on_a_cpu(tmp_path: Path) -> None:
    """The README's "Outside pytest" snippet, as written, with SGLWORKER_ENGINE=sim."""
    script = tmp_path / "outside.py"
    script.write_text(
        "from pytest_sglworker import get_model_spec, spawn_worker\n\n"
        "with spawn_worker(get_model_spec('qwen3-0.6b')) as worker:\n"
        "    print(worker.client.get('/model_info').json()['model_path'])\n"
        "    print('PID', worker.pid)\n")
    env = {**os.environ, "SGLWORKER_ENGINE": "sim", "SGLSIM_STARTUP_SECONDS": "0.2",
           "SGLWORKER_LOG_DIR": str(tmp_path / "logs"), "SGLWORKER_LOCK_DIR": str(tmp_path / "locks")}
    import sys

    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "Qwen/Qwen3-0.6B"


def test_outside_pytest_a_missing_engine_names_the_variable_for_the_sim(tmp_path: Path) -> None:
    """A script's launch error says how a script picks the simulated engine (an environment variable), not only the
    pytest option."""
    from pytest_sglworker import LaunchError, LaunchOptions, get_model_spec, spawn_worker

    options = LaunchOptions(launcher=(str(tmp_path / "no-such-engine"),), log_dir=tmp_path / "logs",
                            lock_dir=tmp_path / "locks")
    with pytest.raises(LaunchError) as caught:
        spawn_worker(get_model_spec("qwen3-0.6b"), options=options)
    assert "--sgl-engine sim" in str(caught.value) and "SGLWORKER_ENGINE=sim" in str(caught.value), caught.value
