"""The gateway drop-in at collection, as a suite meets it (``runpytest_subprocess``, ``--sgl-engine sim``): a test's
request (model id, backend, workers' shape) is resolved before any worker starts, as the plugin does for its own
markers. An unknown model id or a malformed ``workers`` marker is a usage error naming the test and the fix (under
xdist, that test's error); a shape the inventory can never hold is skipped before anything launches;
``E2E_MODELS`` / ``E2E_BACKENDS`` select what runs as upstream's pool does; and each configuration's tests stay
on one xdist worker, under ``--dist loadgroup`` and under the plugin's own scheduler, so that each is launched once.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.compat import models as compat_models

TINY = str(Path(__file__).resolve().parents[1] / "data" / "sim" / "tiny-llama")

pytestmark = [pytest.mark.router, pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None or importlib.util.find_spec("openai") is None,
    reason="the gateway drop-in's tier needs the sglang router and openai: pip install 'pytest-sglworker[test]'")]

CONFTEST = f'''
pytest_plugins = ["pytest_sglworker.compat.gateway"]

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec


def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec(name="tiny", model={TINY!r}, memory_gb=1, features=frozenset({{"chat"}}),
                           worker_args=(*CI_WORKER_ARGS, "--skip-server-warmup")))
'''

ENVS = ("SGLWORKER_MODELS", "SGLWORKER_LAUNCHER", "SGLWORKER_GPUS", "SGLWORKER_REPORT", "OPENAI_API_KEY", "E2E_MODEL",
        "E2E_MODELS", "E2E_BACKENDS", "SKIP_BACKEND_SETUP", "SKIP_MODEL_POOL", "E2E_STARTUP_TIMEOUT")


def _suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tests: str, models: str) -> None:
    for key in ENVS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(compat_models.ENV_MODELS, models)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=tests)


def _launched(report: Path) -> dict[str, Any]:
    """The run report's worker configurations by label (routers left out)."""
    workers = json.loads(report.read_text())["workers"].values() if report.is_file() else []
    return {w["label"]: w for w in workers if not w["label"].startswith("router ")}


BAD = '''
import pytest


@pytest.mark.model("no-such-model")
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestUnknownModel:
    def test_unknown(self, setup_backend):
        raise AssertionError("never set up")


@pytest.mark.workers(count=0)
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestBadMarker:
    def test_bad(self, setup_backend):
        raise AssertionError("never set up")


@pytest.mark.model("qwen-7b")
def test_unmapped_model(model_client):
    raise AssertionError("never set up")


def test_fine():
    pass
'''


@pytest.mark.parametrize("xdist", [False, True], ids=["session", "xdist"])
def test_an_unknown_model_or_a_bad_marker_is_a_collection_error(xdist: bool, pytester: pytest.Pytester,
                                                                 sim_env: dict[str, str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any worker starts: the session stops with a usage error naming each test and what to change (an
    xdist worker cannot stop the session: each such test errors with the same text, the others run)."""
    _suite(pytester, monkeypatch, BAD, "llama-8b=tiny")
    args = ["-n", "2"] if xdist else ["-p", "no:xdist"]
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", *args, "--sgl-engine", "sim", timeout=120)
    text = "\n".join(result.outlines + result.errlines)
    unknown = ("test test_suite.py::TestUnknownModel::test_unknown[http]: no registered model spec serves "
               "'no-such-model'")
    unmapped = ("test test_suite.py::test_unmapped_model: no registered model spec serves the suite's model 'qwen-7b' "
                "(Qwen/Qwen2.5-7B-Instruct): map it, e.g. SGLWORKER_COMPAT_MODELS='qwen-7b=<spec>'")
    bad = "@pytest.mark.workers(count=0) on test_suite.py::TestBadMarker::test_bad[http]: count is a whole number >= 1"
    for said in (unknown, unmapped, bad, "is not one of the suite's model ids: llama-8b, llama-1b"):
        assert said in text, text
    assert "INTERNALERROR" not in text and "never set up" not in text
    if xdist:
        result.assert_outcomes(passed=1, errors=3)
    else:
        assert result.ret == pytest.ExitCode.USAGE_ERROR, text
        assert "test_fine" not in text  # nothing ran
    assert "sglang-worker" not in text  # nothing launched


SHAPES = '''
import pytest


@pytest.mark.workers(count=3)
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestThreeWorkers:
    def test_three(self, setup_backend):
        raise AssertionError("never set up")


@pytest.mark.workers(prefill=2, decode=1)
@pytest.mark.parametrize("setup_backend", ["pd"], indirect=True)
class TestThreePD:
    def test_pd(self, setup_backend):
        raise AssertionError("never set up")
'''


def test_a_shape_the_inventory_can_never_hold_is_skipped_at_collection(pytester: pytest.Pytester,
                                                                      sim_env: dict[str, str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Three workers (or 2P+1D) on two GPUs: skipped with the reason before anything launches, as the plugin's own
    ``sgl_workers`` tests are."""
    _suite(pytester, monkeypatch, SHAPES, "llama-8b=tiny")
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-gpus", "sim:2", timeout=120)
    result.assert_outcomes(skipped=2)
    text = "\n".join(result.outlines + result.errlines)
    assert text.count("SKIPPED") >= 2 and "GPU" in text and "never set up" not in text, text
    assert "sglang-worker" not in text


SELECTED = '''
import pytest


@pytest.mark.model("llama-8b")
@pytest.mark.parametrize("setup_backend", ["http", "grpc"], indirect=True)
class TestDefault:
    def test_default(self, setup_backend):
        backend = setup_backend[0]
        assert backend == "http", "E2E_BACKENDS=http leaves grpc out"


@pytest.mark.model("qwen-7b")
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestOther:
    def test_other(self, setup_backend):
        raise AssertionError("E2E_MODELS=llama-8b leaves qwen-7b out")


@pytest.mark.parametrize("backend_router", ["grpc"], indirect=True)
def test_router(backend_router):
    raise AssertionError("E2E_BACKENDS=http leaves grpc out")


def test_pool_get(model_pool):
    with pytest.raises(KeyError, match="not qwen-7b:http"):
        model_pool.get("qwen-7b")
'''


def test_e2e_models_and_backends_select_what_runs(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``E2E_MODELS=llama-8b E2E_BACKENDS=http``: the http class of llama-8b runs; the grpc one, the other model's and
    ``backend_router[grpc]`` are skipped at collection with the variables named, and the pool's ``get`` of a model
    they leave out raises ``KeyError`` (upstream's pool starts only those)."""
    _suite(pytester, monkeypatch, SELECTED, "llama-8b=tiny,qwen-7b=tiny")
    monkeypatch.setenv("E2E_MODELS", "llama-8b")
    monkeypatch.setenv("E2E_BACKENDS", "http")
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-report", str(report), timeout=180)
    text = "\n".join(result.outlines + result.errlines)
    result.assert_outcomes(passed=2, skipped=3)
    said = ("E2E_MODELS='llama-8b', E2E_BACKENDS='http': the pool serves llama-8b over http, not {} (upstream's pool "
            "starts only those)")
    for left_out in ("llama-8b:grpc", "qwen-7b:http"):
        assert said.format(left_out) in text, text
    assert "leaves" not in text.replace("E2E_BACKENDS=http leaves", "")  # no skipped test ran
    assert list(_launched(report)) == ["tiny [1x]"]


GROUPED = '''
import pytest


# interleaved on purpose: the grouping, not the file order, keeps a configuration together
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestA1:
    @pytest.mark.parametrize("i", range(2))
    def test_a(self, setup_backend, i):
        pass


@pytest.mark.workers(count=2)
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestB1:
    @pytest.mark.parametrize("i", range(2))
    def test_b(self, setup_backend, i):
        assert len(setup_backend[3].list_workers()) == 2


@pytest.mark.parametrize("backend_router", ["http"], indirect=True)
@pytest.mark.parametrize("i", range(2))
def test_a_router(backend_router, i):
    pass


@pytest.mark.workers(count=2)
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestB2:
    @pytest.mark.parametrize("i", range(2))
    def test_b(self, setup_backend, i):
        pass


@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestA2:
    @pytest.mark.parametrize("i", range(2))
    def test_a(self, setup_backend, i):
        pass
'''


@pytest.mark.parametrize("dist", ["loadgroup", "sgl"])
def test_each_configuration_stays_on_one_xdist_worker_and_launches_once(dist: str, pytester: pytest.Pytester,
                                                                         sim_env: dict[str, str],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two configurations (one worker; two workers), their classes interleaved over ``-n 2``: under ``--dist
    loadgroup`` each test's node id carries its configuration's group (``@sgl-<key>``), and under the plugin's own
    scheduler each configuration is handed to one xdist worker; either way each is launched once, and the other
    classes of that configuration reuse it."""
    _suite(pytester, monkeypatch, GROUPED, "llama-8b=tiny")
    report = pytester.path / "report.json"
    args = ["--dist", "loadgroup"] if dist == "loadgroup" else []
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", "-n", "2", *args, "--sgl-engine", "sim",
                                           "--sgl-gpus", "sim:4", "--sgl-report", str(report), timeout=300)
    text = "\n".join(result.outlines + result.errlines)
    result.assert_outcomes(passed=10)
    if dist == "loadgroup":
        result.stdout.re_match_lines([r".*PASSED .*TestA1::test_a\[0-http\]@sgl-tiny-\w+\s*$",
                                      r".*PASSED .*test_a_router\[0-http\]@sgl-tiny-\w+\s*$"], consecutive=False)
    workers = _launched(report)
    assert sorted(workers) == ["tiny [1x]", "tiny [2x]"], text
    assert [workers[label]["launches"] for label in sorted(workers)] == [1, 1], workers


AHEAD = '''
import time

import pytest


@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestA:
    @pytest.mark.parametrize("i", range(2))
    def test_a(self, setup_backend, i):
        time.sleep(1.5)


@pytest.mark.workers(count=2)
@pytest.mark.parametrize("setup_backend", ["http"], indirect=True)
class TestB:
    def test_b(self, setup_backend):
        pass
'''


def test_the_next_configuration_is_launched_ahead(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Startups of 2 s: the two-worker group of the next class starts while the first class's tests run (the
    plugin's launch ahead, which reads the configurations resolved at collection), and is ready when its class
    begins."""
    _suite(pytester, monkeypatch, AHEAD, "llama-8b=tiny")
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "2")
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-gpus", "sim:4", "--sgl-report", str(report), timeout=180)
    result.assert_outcomes(passed=3)
    launches = json.loads(report.read_text())["launches"]
    a = [r for r in launches if r["label"] == "tiny [1x]"]
    b = [r for r in launches if r["label"] == "tiny [2x]"]
    assert len(a) == 1 and len(b) == 2, [r["label"] for r in launches]
    a_end = max(t["t_end"] for t in a[0]["tests"])
    b_start = min(t["t_start"] for r in b for t in r["tests"])
    assert all(r["t_leased"] < a_end for r in b), "B's workers were not started during A's tests"
    assert all(r["t_ready"] <= b_start for r in b), "B was not ready when its class began"
