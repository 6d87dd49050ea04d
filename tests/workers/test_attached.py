"""Attached workers (``--sgl-worker-url NAME=URL``): a spec's tests run against a worker that is already
running. The "deployment" here is a simulated worker started by this test module outside the inner session
(as a shared deployment would be); the inner sessions run with the real engine selected and no GPU, so
anything that tried to launch or lease would skip or fail."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec
from pytest_sglworker.workers.launcher import LaunchOptions, ModelInstance, sim_launcher, spawn_worker
from pytest_sglworker.workers.sources.attached import budget_problems, parse_worker_url, parse_worker_urls

QWEN = ModelSpec(name="qwen3-0.6b", model="Qwen/Qwen3-0.6B", memory_gb=16, worker_args=CI_WORKER_ARGS)
BASE = ["-p", "no:cacheprovider", "--sgl-engine", "real"]


def _deployment(tmp_path: Path, *extra: str, spec: ModelSpec = QWEN) -> ModelInstance:
    options = LaunchOptions(launcher=tuple(sim_launcher()), log_dir=tmp_path / "deployment-logs",
                            lock_dir=tmp_path / "deployment-locks", startup_timeout=60)
    return spawn_worker(spec, extra_args=extra, env={"SGLSIM_STARTUP_SECONDS": "0.1"}, options=options)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[ModelInstance]:
    worker = _deployment(tmp_path)
    yield worker
    worker.stop()


@pytest.fixture
def no_gpu_env(sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No NVML here and no declared GPUs: a launch would be skipped for want of an inventory."""
    monkeypatch.delenv("SGLWORKER_GPUS", raising=False)
    monkeypatch.delenv("SGLWORKER_ENGINE", raising=False)


def test_parse_worker_urls() -> None:
    parsed = parse_worker_urls(["qwen3-0.6b=http://10.0.0.5:30000/", "qwen3-0.6b=http://10.0.0.6:30000,"
                                "tiny=https://gpu.example.org"])
    assert [u.url for u in parsed["qwen3-0.6b"]] == ["http://10.0.0.5:30000", "http://10.0.0.6:30000"]
    tiny = parsed["tiny"][0]
    assert (tiny.host, tiny.port, tiny.tls) == ("gpu.example.org", 443, True)
    for bad, said in [("qwen", "NAME=URL"), ("q=ftp://x", "http:// or https://"), ("q=http://", "no host"),
                      ("q=http://h:1/v1", "without a path"), ("q=http://h:99999", "port")]:
        with pytest.raises(ValueError, match=said):
            parse_worker_url(bad)
    with pytest.raises(ValueError, match="given twice"):
        parse_worker_urls(["a=http://h:1", "b=http://h:1"])


def test_budget_problems_read_from_server_info() -> None:
    assert budget_problems({"mem_fraction_static": 0.6, "cuda_graph_backend_prefill": "disabled"}) == []
    problems = [str(p) for p in budget_problems({"mem_fraction_static": 0.83, "cuda_graph_backend_prefill": None})]
    assert any("0.83, above the budget of 0.6" in p for p in problems)
    assert any("--cuda-graph-backend-prefill" in p for p in problems)
    for reported, said in [(float("nan"), "runs with nan, not in (0, 0.6]"), (0, "runs with 0, not in (0, 0.6]"),
                           (float("inf"), "runs with inf, above the budget of 0.6"),
                           (10**400, "runs with a huge integer, above the budget of 0.6"),
                           (True, "reports True, not a number"), (None, "reports None, not a number")]:
        # NaN compares false with every bound: it kept the budget, and the test ran against the worker
        found = [str(p) for p in budget_problems({"mem_fraction_static": reported,
                                                  "cuda_graph_backend_prefill": "disabled"})]
        assert found == [f"--mem-fraction-static: the worker {said}"]


def test_tests_run_against_the_attached_worker_which_outlives_the_session(
    pytester: pytest.Pytester, no_gpu_env: None, deployment: ModelInstance, tmp_path: Path
) -> None:
    pytester.makepyfile(f"""
        import pytest

        def test_generate(sgl_worker):
            assert sgl_worker.url == "{deployment.url}"
            body = {{"text": "hi", "sampling_params": {{"max_new_tokens": 2}}}}
            resp = sgl_worker.client.post("/generate", json=body)
            assert resp.status_code == 200
            assert resp.headers["X-SGLSim-Worker"] == "{deployment.port}/{deployment.pid}"

        def test_group_of_one(sgl_workers):
            assert sgl_workers.urls == ["{deployment.url}"]

        def test_never_stopped(sgl_worker):
            from pytest_sglworker.workers.sources.attached import AttachedWorkerError
            with pytest.raises(AttachedWorkerError, match="never stops a worker it did not start"):
                sgl_worker.stop()
            assert "no log" in sgl_worker.log_tail()

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
        def test_extra_args(sgl_worker): pass

        @pytest.mark.sgl_workers(count=2)
        def test_two(sgl_workers): pass

        @pytest.mark.sgl_workers(prefill=1, decode=1)
        def test_pd(sgl_workers): pass
    """)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*BASE, "--sgl-worker-url", f"qwen3-0.6b={deployment.url}", "-rs",
                                           "--sgl-report", str(report), timeout=120)
    result.assert_outcomes(passed=3, skipped=3)
    result.stdout.fnmatch_lines([
        f"sglworker: attached workers (never launched, leased or stopped): qwen3-0.6b={deployment.url}",
        "*extra args or env need a launched worker*",
        "*needs 2 workers, 1 attached (give --sgl-worker-url qwen3-0.6b=URL once per worker)*",
        "*needs a prefill/decode group*",
    ])
    assert deployment.is_alive() and deployment.responds()  # not stopped by the session
    data = json.loads(report.read_text())
    assert data["launches"] == []
    stats = data["workers"].values()  # sgl_worker's configuration and sgl_workers' group of one
    assert sum(s["launches"] for s in stats) == 0 and sum(s["reuses"] for s in stats) == 3
    assert all(f"(attached: {deployment.url})" in s["label"] for s in stats)


def test_down_url_is_a_usage_error_in_bounded_time(pytester: pytest.Pytester, no_gpu_env: None) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    # bounded by the plugin's own 10 s wait for the worker's answer, which the error names
    result = pytester.runpytest_subprocess(*BASE, "--sgl-worker-url", f"qwen3-0.6b=http://127.0.0.1:{port}",
                                           timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--sgl-worker-url qwen3-0.6b=http://127.0.0.1:{port}: the worker does not answer "
                                 "/health_generate within 10 s*start it, or drop the option*"])


def test_another_model_and_a_broken_budget_are_refused(
    pytester: pytest.Pytester, no_gpu_env: None, tmp_path: Path
) -> None:
    loose = _deployment(tmp_path, "--mem-fraction-static", "0.85")
    try:
        pytester.makepyfile("""
            import pytest

            def test_a(sgl_worker): pass

            @pytest.mark.sgl_budget_opt_out(reason="the shared deployment runs the engine default")
            def test_opted_out(sgl_worker): pass
        """)
        result = pytester.runpytest_subprocess(*BASE, "--sgl-worker-url", f"qwen3-0.6b={loose.url}", timeout=60)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([
            f"*attached worker {loose.url} (qwen3-0.6b, --sgl-worker-url) breaks the mandatory worker budget:*",
            "*--mem-fraction-static: the worker runs with 0.85, above the budget of 0.6*",
            "*fix: restart it with CI_WORKER_ARGS*or mark the test @pytest.mark.sgl_budget_opt_out*",
        ])
        result = pytester.runpytest_subprocess(*BASE, "--sgl-worker-url", f"qwen3-0.6b={loose.url}",
                                               "-k", "opted_out", timeout=60)
        result.assert_outcomes(passed=1)
        pytester.makeconftest("""
            from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

            def pytest_sglworker_register_specs(registry):
                registry.add(ModelSpec(name="llama", model="meta-llama/Llama-3.2-1B", memory_gb=8,
                                       worker_args=CI_WORKER_ARGS))
        """)
        result = pytester.runpytest_subprocess(*BASE, "--sgl-worker-url", f"llama={loose.url}", timeout=60)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["*the worker serves 'Qwen/Qwen3-0.6B', but model spec 'llama' is "
                                     "'meta-llama/Llama-3.2-1B'*"])
    finally:
        loose.stop()


def test_bad_option_values_are_usage_errors(pytester: pytest.Pytester, no_gpu_env: None) -> None:
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    result = pytester.runpytest_subprocess(*BASE, "--sgl-worker-url", "qwen3-0.6b", timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sgl-worker-url: 'qwen3-0.6b' is not NAME=URL*"])
    result = pytester.runpytest_subprocess(*BASE, "--sgl-model", "llama-1b", "--sgl-worker-url",
                                           "qwen3-0.6b=http://127.0.0.1:1", timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*'qwen3-0.6b' are attached but not selected by --sgl-model*"])


@pytest.mark.router
@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="the sglang router is not installed: pip install 'pytest-sglworker[router]'")
def test_real_router_in_front_of_two_attached_workers(
    pytester: pytest.Pytester, no_gpu_env: None, tmp_path: Path
) -> None:
    first, second = _deployment(tmp_path), _deployment(tmp_path)
    try:
        pytester.makepyfile("""
            import collections
            import pytest

            @pytest.mark.sgl_workers(count=2)
            @pytest.mark.sgl_router(policy="round_robin")
            def test_round_robin(sgl_router, sgl_workers):
                served = collections.Counter()
                for i in range(6):
                    resp = sgl_router.client.post("/generate", json={"text": f"p{i}",
                                                                     "sampling_params": {"max_new_tokens": 2}})
                    assert resp.status_code == 200, resp.text
                    served[resp.headers.get("X-SGLSim-Worker", "?").split("/")[0]] += 1
                assert sorted(served.values()) == [3, 3], served
        """)
        result = pytester.runpytest_subprocess(*BASE, "--sgl-worker-url", f"qwen3-0.6b={first.url}",
                                               "--sgl-worker-url", f"qwen3-0.6b={second.url}", timeout=120)
        result.assert_outcomes(passed=1)
        assert first.is_alive() and second.is_alive()
    finally:
        first.stop()
        second.stop()
