"""The gateway e2e drop-in (``pytest_sglworker.compat.gateway``) as a suite meets it: one inner pytest session
(``runpytest_subprocess``, ``--sgl-engine sim``, the real ``sglang-router``) runs a file written the way sglang's
``sgl-model-gateway/e2e_test/`` files are (their markers, fixtures and ``from infra import ...``), with a conftest
whose only gateway line is ``pytest_plugins = ["pytest_sglworker.compat.gateway"]``. The inner tests assert what a
suite relies on (the tuple ``setup_backend`` yields, the router's workers, round robin over distinct workers, PD,
the worker API of an IGW gateway); the outer tests assert each promise over that one run (whichever runs first pays
for it): the outcomes, the skip and failure texts, the pooling (one launch serves several classes), the per-port logs,
and that nothing is left running (the autouse check of ``tests/conftest.py``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from session_helpers import shared_run

from pytest_sglworker.compat import models as compat_models

TINY = str(Path(__file__).resolve().parents[1] / "data" / "sim" / "tiny-llama")

needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None or importlib.util.find_spec("openai") is None,
    reason="the gateway drop-in's tier needs the sglang router and openai: pip install 'pytest-sglworker[test]'")

pytestmark = [pytest.mark.router, needs_router, pytest.mark.xdist_group("compat-gateway")]

#: The inner suite's conftest: the one line, and the spec that serves its model ids (the tiny Llama: its tokenizer
#: serves the router's gRPC mode; the vocab of 512 is below the servicer's warmup ids, hence --skip-server-warmup).
INNER_CONFTEST = f'''
pytest_plugins = ["pytest_sglworker.compat.gateway"]

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec


def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec(name="tiny", model={TINY!r}, memory_gb=1, features=frozenset({{"chat"}}),
                           worker_args=(*CI_WORKER_ARGS, "--skip-server-warmup")))
    registry.add(ModelSpec(name="tiny-oom", model={TINY!r}, memory_gb=1, features=frozenset({{"chat"}}),
                           worker_args=(*CI_WORKER_ARGS, "--skip-server-warmup"), env={{"SGLSIM_FAULT": "crash_oom"}}))
'''

#: Written as upstream's files are: the same markers, fixtures and imports.
INNER_TESTS = '''
import httpx
import pytest
from infra import DEFAULT_MODEL, ConnectionMode, Gateway, ModelPool, WorkerType


def generate(base_url, text):
    resp = httpx.post(f"{base_url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}},
                      timeout=30)
    assert resp.status_code == 200, resp.text


@pytest.mark.e2e
@pytest.mark.model("llama-8b")
@pytest.mark.parametrize("setup_backend", ["http", "grpc"], indirect=True)
class TestA_Chat:
    def test_chat(self, setup_backend):
        backend, model, client, gateway = setup_backend
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello world"}],
                                              max_tokens=4)
        assert resp.usage.completion_tokens == 4 and resp.choices[0].message.role == "assistant"
        workers = gateway.list_workers()
        assert len(workers) == 1 and workers[0].status == "healthy"
        assert workers[0].url.startswith("grpc://" if backend == "grpc" else "http://")

    def test_stream(self, setup_backend):
        _, model, client, gateway = setup_backend
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
        assert gateway.health() and len(gateway.list_models()) == 1
        listed = gateway.list_workers()[0]
        assert gateway.get_worker(listed.id).url == listed.url
        assert "smg_" in (gateway.get_metrics() or "")  # its Prometheus port, from the plugin's port block


@pytest.mark.workers(count=2)
@pytest.mark.gateway(policy="round_robin", extra_args=["--max-concurrent-requests", "64"])
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestB_TwoWorkers:
    def test_round_robin_over_two_distinct_workers(self, setup_backend):
        _, _, _, gateway = setup_backend
        urls = {w.url for w in gateway.list_workers()}
        assert len(urls) == 2
        members = gateway.router.group.workers
        before = [m.log_text().count('"POST /generate HTTP/1.1" 200') for m in members]
        for i in range(4):
            generate(gateway.base_url, f"prompt {i}")
        after = [m.log_text().count('"POST /generate HTTP/1.1" 200') for m in members]
        assert [a - b for a, b in zip(after, before)] == [2, 2]
        assert "--max-concurrent-requests" in gateway.router.argv


@pytest.mark.workers(prefill=1, decode=1)
@pytest.mark.parametrize("setup_backend", ["pd"], indirect=True)
class TestC_PD:
    def test_pd(self, setup_backend, model_pool):
        backend, model, client, gateway = setup_backend
        assert backend == "pd"
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=3)
        assert resp.usage.completion_tokens == 3
        assert [w.worker_type for w in model_pool.get_workers_by_type("llama-8b", WorkerType.PREFILL)] == \\
            [WorkerType.PREFILL]
        assert model_pool.get_workers_by_type("llama-8b", WorkerType.PREFILL)[0].bootstrap_port


@pytest.mark.parametrize("setup_backend", ["openai"], indirect=True)
class TestD_Cloud:
    def test_cloud(self, setup_backend):
        raise AssertionError("runs only with OPENAI_API_KEY")


@pytest.mark.e2e
class TestE_IGW:
    def test_igw_add_and_remove(self, model_pool: ModelPool):
        instance = model_pool.get(DEFAULT_MODEL, ConnectionMode.HTTP)
        assert model_pool.get(DEFAULT_MODEL, "http") is instance  # one instance per model and mode
        gateway = Gateway()
        gateway.start(igw_mode=True)
        try:
            assert gateway.igw_mode and gateway.health()
            ok, worker_id = gateway.add_worker(instance.worker_url)
            assert ok, worker_id
            assert [w.url for w in gateway.list_workers()] == [instance.worker_url]
            ok, msg = gateway.remove_worker(instance.worker_url)
            assert ok, msg
        finally:
            gateway.shutdown()
        assert not gateway.is_running

    def test_forgotten_gateway(self, model_pool: ModelPool):
        gateway = Gateway()
        gateway.start(worker_urls=[model_pool.get("llama-8b").worker_url], model_path="unused")
        assert gateway.is_running


@pytest.mark.parametrize("backend_router", ["http"], indirect=True)
def test_f_backend_router(backend_router):
    assert backend_router.health() and len(backend_router.list_workers()) == 1


@pytest.mark.model("llama-8b")
def test_g_model_client(model_client, model_base_url):
    assert httpx.get(f"{model_base_url}/health", timeout=10).status_code == 200
    assert model_client.models.list().data


@pytest.mark.model("qwen-7b")
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestK_StartupFailure:
    def test_never_runs(self, setup_backend):
        raise AssertionError("never set up")


@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestL_AFailingTest:
    def test_fails(self, setup_backend):
        _, _, _, gateway = setup_backend
        assert gateway.list_workers() == [], "fails on purpose: its report shows the worker and the router"


def test_j_not_offered():
    with pytest.raises(ImportError, match="the plugin leases GPUs itself"):
        from infra import GPUAllocator  # noqa: F401
'''


@dataclass
class InnerRun:
    ret: int
    stdout: str
    lines: list[str]
    report: dict[str, Any]
    log_dir: Path

    def outcomes(self, test: str) -> set[str]:
        pattern = re.compile(rf"^(PASSED|FAILED|ERROR|SKIPPED) \S*::{re.escape(test)}")
        found = {m.group(1) for m in map(pattern.search, self.lines) if m}
        skipped = re.compile(rf"^SKIPPED \[\d+\] \S+: .*{re.escape(test)}")
        return found | ({"SKIPPED"} if any(skipped.search(line) for line in self.lines) else set())

    def launches(self, role: str) -> list[dict[str, Any]]:
        return [launch for launch in self.report.get("launches", []) if launch.get("role") == role]


_RUN_KEY = pytest.StashKey[Any]()


def _run_inner(pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> InnerRun:
    report = pytester.path / "report.json"
    for key in ("SGLWORKER_MODELS", "SGLWORKER_LAUNCHER", "SGLWORKER_GPUS", "SGLWORKER_REPORT", "OPENAI_API_KEY",
                "E2E_MODEL", "SKIP_BACKEND_SETUP", "SKIP_MODEL_POOL", "E2E_STARTUP_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(compat_models.ENV_MODELS, "llama-8b=tiny,qwen-7b=tiny-oom")
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_gateway_suite=INNER_TESTS)
    # the suite's own infra/ left beside its files: shadowed by the drop-in, never imported
    own = pytester.mkpydir("infra")
    (own / "__init__.py").write_text("raise RuntimeError('the suite\'s own infra was imported')\n")
    result = pytester.runpytest_subprocess(
        "-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim", "--sgl-gpus", "sim:8",
        "--sgl-log-retention-policy", "all", "--sgl-report", str(report), timeout=400)
    lines = result.outlines + result.errlines
    return InnerRun(int(result.ret), "\n".join(lines), lines,
                    json.loads(report.read_text()) if report.is_file() else {}, Path(sim_env["SGLWORKER_LOG_DIR"]))


@pytest.fixture
def inner(request: pytest.FixtureRequest) -> InnerRun:
    return shared_run(request, _RUN_KEY, lambda get: _run_inner(get("pytester"), get("sim_env"), get("monkeypatch")))


def test_the_suites_tests_pass_through_the_one_line(inner: InnerRun) -> None:
    """Every test the drop-in serves passes: http and grpc backends (chat, streaming, the router's lists), two
    distinct workers in round robin with the gateway marker's policy and extra args, PD on the simulated engine,
    an IGW gateway's worker API over a pool instance, backend_router, model_client and model_base_url."""
    for test in ("TestA_Chat::test_chat[http]", "TestA_Chat::test_stream[http]", "TestA_Chat::test_chat[grpc]",
                 "TestA_Chat::test_stream[grpc]", "TestB_TwoWorkers::test_round_robin_over_two_distinct_workers",
                 "TestC_PD::test_pd[pd]", "TestE_IGW::test_igw_add_and_remove", "TestE_IGW::test_forgotten_gateway",
                 "test_f_backend_router[http]", "test_g_model_client", "test_j_not_offered"):
        assert inner.outcomes(test) == {"PASSED"}, f"{test}: {inner.outcomes(test)}\n{inner.stdout[-8000:]}"


def test_the_suites_own_infra_is_shadowed_and_another_one_refused(inner: InnerRun) -> None:
    """``from infra import ...`` resolves to the drop-in even with the suite's own ``infra/`` on the path (the inner
    run has one that raises when imported); an ``infra`` imported before the plugin is a usage error saying why."""
    assert "the suite's own infra was imported" not in inner.stdout
    assert inner.outcomes("test_j_not_offered") == {"PASSED"}
    # in a Python of its own: loading the plugin here would register its runtime with this session
    code = ("import sys, types; sys.modules['infra'] = types.ModuleType('infra'); "
            "import pytest_sglworker.compat.gateway")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert re.search(r"UsageError: pytest_sglworker\.compat\.gateway serves 'from infra import \.\.\.', but another "
                     r"module named 'infra' is already imported .*remove the suite's own conftest\.py", done.stderr), \
        done.stderr


def test_a_cloud_backend_skips_without_its_key(inner: InnerRun) -> None:
    assert any("SKIPPED" in line and "OPENAI_API_KEY not set, skipping openai tests" in line for line in inner.lines)
    assert "runs only with OPENAI_API_KEY" not in inner.stdout


def test_a_worker_that_fails_to_start_fails_its_class_with_the_diagnosis(inner: InnerRun) -> None:
    assert inner.outcomes("TestK_StartupFailure::test_never_runs[http]") == {"ERROR"}
    assert re.search(r"worker tiny-oom: CUDA out of memory .* exited during startup", inner.stdout), \
        inner.stdout[-6000:]
    assert "never set up" not in inner.stdout


def test_a_failing_tests_report_shows_its_worker_and_router(inner: InnerRun) -> None:
    assert inner.outcomes("TestL_AFailingTest::test_fails[http]") == {"FAILED"}
    start = next(i for i, line in enumerate(inner.lines) if "TestL_AFailingTest.test_fails" in line
                 and line.startswith("_"))
    end = next(i for i in range(start + 1, len(inner.lines)) if inner.lines[i].startswith(("_" * 5, "=" * 5)))
    section = "\n".join(inner.lines[start:end])
    assert re.search(r"-+ sglang worker tiny 127\.0\.0\.1:\d+ -+\nlog: \S+/sglang-worker-\d+(-\d+)?\.log", section), \
        section[:4000]
    assert re.search(r"log: \S+/sglang-router-\d+(-\d+)?\.log", section), section[:4000]


def test_workers_are_the_plugins_pooled_and_reused_across_classes(inner: InnerRun) -> None:
    """The http worker of TestA serves the IGW tests, backend_router and model_client too (one launch, pooled
    between owners); the grpc worker, the two-worker group and the PD group are one launch each: six workers."""
    workers = inner.launches("worker") + inner.launches("prefill") + inner.launches("decode")
    by_label: dict[str, list[dict[str, Any]]] = {}
    for launch in workers:
        by_label.setdefault(launch["label"], []).append(launch)
    assert sorted((label, len(launches)) for label, launches in by_label.items()) == [
        ("tiny [1P+1D]", 2), ("tiny [1x]", 1), ("tiny [1x] --grpc-mode", 1), ("tiny [2x]", 2),
        ("tiny-oom [1x]", 1)], by_label
    served = {t["nodeid"].split("::", 1)[1] for t in by_label["tiny [1x]"][0]["tests"]}
    assert {"TestA_Chat", "TestE_IGW::test_igw_add_and_remove", "test_f_backend_router[http]",
            "test_g_model_client"} <= served, served
    argvs = [launch.get("argv") or "" for launch in workers if launch["label"] != "tiny-oom [1x]"]
    assert all(" -m pytest_sglworker.sim " in argv and "--mem-fraction-static=0.6" in argv for argv in argvs), \
        [a for a in argvs if " -m pytest_sglworker.sim " not in a or "--mem-fraction-static=0.6" not in a]


def test_routers_are_the_real_router_with_a_log_per_port(inner: InnerRun) -> None:
    routers = inner.launches("router")
    assert routers and all("sglang_router.launch_router" in r["argv"] and "--host 127.0.0.1" in r["argv"]
                           and "--prometheus-host 127.0.0.1" in r["argv"] for r in routers)
    assert any("--enable-igw" in r["argv"] for r in routers)
    assert any("--pd-disaggregation" in r["argv"] for r in routers)
    logs = {p.name for p in inner.log_dir.rglob("sglang-router-*.log")}
    assert {f"sglang-router-{r['port']}.log" for r in routers} <= logs


def test_a_gateway_the_test_left_running_is_stopped_and_said(inner: InnerRun) -> None:
    assert re.search(r"pytest_sglworker\.compat\.gateway: router \(regular round_robin\) over .* started by "
                     r"test_gateway_suite\.py::TestE_IGW::test_forgotten_gateway, was still running after the test "
                     r"test_gateway_suite\.py::TestE_IGW::test_forgotten_gateway; stopped it \(call "
                     r"gateway\.shutdown\(\)\)", inner.stdout), inner.stdout[-6000:]


SKIPS = '''
import pytest


@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestSetup:
    def test_needs_backend(self, setup_backend):
        raise AssertionError("SKIP_BACKEND_SETUP is set")


@pytest.mark.model("llama-8b")
def test_needs_a_pool_worker(model_client):
    raise AssertionError("SKIP_MODEL_POOL is set")


@pytest.mark.parametrize("backend_router", ["grpc"], indirect=True)
def test_router_of_the_default_model(backend_router):
    raise AssertionError("SKIP_MODEL_POOL is set")
'''


def test_the_suites_switches_skip_as_upstreams_do(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``SKIP_BACKEND_SETUP`` skips ``setup_backend``; ``SKIP_MODEL_POOL`` makes an empty pool, so the tests that need
    a worker skip with upstream's words; ``E2E_MODEL`` is the model ``backend_router`` asks for."""
    monkeypatch.setenv("SKIP_BACKEND_SETUP", "1")
    monkeypatch.setenv("SKIP_MODEL_POOL", "true")
    monkeypatch.setenv("E2E_MODEL", "qwen-7b")
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_switches=SKIPS)
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           timeout=120)
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines_random([
        "SKIPPED * SKIP_BACKEND_SETUP is set",
        "SKIPPED * Model llama-8b not available in model pool",
        "SKIPPED * Model qwen-7b:grpc not available in pool",
    ])
    assert "sglang-worker" not in result.stdout.str()  # nothing launched
