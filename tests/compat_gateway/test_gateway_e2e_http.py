"""The older ``e2e_http/`` suite's fixtures through the gateway drop-in, as that suite meets them (its own
``conftest.py`` gone, ``runpytest_subprocess``, ``--sgl-engine sim``, the real router): a test written as upstream's
``e2e_http/test_regular_router.py`` is, attaching the two ``--dp-size 2`` workers of ``e2e_two_workers_dp2`` to the
worker-less router of ``e2e_router_only_rr``, then calling ``genai_bench_runner``, which skips with why.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pytest_sglworker.compat import models as compat_models
from pytest_sglworker.compat.gateway.e2e_http import HARNESS_SKIP

TINY = str(Path(__file__).resolve().parents[1] / "data" / "sim" / "tiny-llama")

pytestmark = [pytest.mark.router, pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None or importlib.util.find_spec("openai") is None,
    reason="the gateway drop-in's tier needs the sglang router and openai: pip install 'pytest-sglworker[test]'")]

CONFTEST = f'''
pytest_plugins = ["pytest_sglworker.compat.gateway"]

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec


def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec(name="tiny", model={TINY!r}, memory_gb=1, worker_args=(*CI_WORKER_ARGS,)))
'''

TESTS = '''
import time

import pytest
import requests


@pytest.mark.e2e
def test_attach_then_bench(e2e_router_only_rr, e2e_two_workers_dp2, e2e_model, e2e_primary_worker, genai_bench_runner):
    assert e2e_model.endswith("tiny-llama")
    assert requests.get(f"{e2e_router_only_rr.url}/workers", timeout=10).json()["workers"] == []
    urls = [w.url for w in e2e_two_workers_dp2] + [e2e_primary_worker.url]
    assert len(set(urls)) == 3 and all(w.proc.poll() is None for w in e2e_two_workers_dp2)
    for url in urls[:2]:
        r = requests.post(f"{e2e_router_only_rr.url}/workers", json={"url": url}, timeout=60)
        assert r.status_code == 202, r.text
    deadline = time.monotonic() + 60
    while len(requests.get(f"{e2e_router_only_rr.url}/workers", timeout=10).json()["workers"]) < 2:
        assert time.monotonic() < deadline, "the router never listed the two workers"
        time.sleep(0.2)
    genai_bench_runner(router_url=e2e_router_only_rr.url, model_path=e2e_model, experiment_folder="x")
    raise AssertionError("genai_bench_runner skips")
'''


def test_the_e2e_http_fixtures_come_from_the_pool(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``e2e_model`` is the path of the default model's spec; ``e2e_two_workers_dp2`` is one group of two
    ``--dp-size 2`` workers and ``e2e_primary_worker`` another worker, both from the pool; the router of
    ``e2e_router_only_rr`` starts with no worker and takes them with ``POST /workers``; ``genai_bench_runner`` skips
    the test where it is called, saying it is upstream's benchmark harness."""
    for key in ("SGLWORKER_MODELS", "SGLWORKER_GPUS", "E2E_PRIMARY_MODEL", "E2E_MODEL", "E2E_MODELS", "E2E_BACKENDS",
                "SKIP_MODEL_POOL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(compat_models.ENV_MODELS, "llama-8b=tiny")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_e2e_http=TESTS)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-gpus", "sim:6", "--sgl-report", str(report), timeout=180)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED * {HARNESS_SKIP}"])
    workers = {w["label"]: w["launches"] for w in json.loads(report.read_text())["workers"].values()}
    assert workers == {"tiny [2x] --dp-size 2": 1, "tiny [1x]": 1, "router (round_robin) over tiny": 1}, workers
