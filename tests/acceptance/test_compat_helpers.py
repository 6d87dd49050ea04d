"""The helpers of ``sglang.test.test_utils`` that start an engine themselves, as ``pytest_sglworker.compat`` hands
them out (:mod:`pytest_sglworker.compat.helpers`): routed through the plugin's launch, or refused naming the
supported path; and a file's ``timeout`` that is not ``--sgl-startup-timeout``, said.

One inner pytest session (``runpytest_subprocess``, ``--sgl-engine sim``, one declared GPU) imports the helpers from
the drop-in. Its ``sglang.test.test_utils`` is a small stand-in written beside it (the project's Python has no
sglang) shaped as 0.5.23's: helpers that call the module's global ``popen_launch_server`` (directly, or through
another helper as ``run_mmlu_test`` does), an offline benchmark run as ``python -m sglang.benchmark.one_batch``, a
decorator that reaches it, and a generic command runner. Its own ``popen_launch_server`` and ``kill_process_tree``
record that they ran: inside the plugin's session they never may. Which of 0.5.23's real helpers are which is
checked against the installed real engine's module (``real_engine`` tier).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from port_grab import free_port_block
from session_helpers import shared_run

from pytest_sglworker.compat import helpers

FAKE_TEST_UTILS = '''
import json
import os
import subprocess
import sys

DEFAULT_URL_FOR_TEST = "http://127.0.0.1:" + os.environ["COMPAT_PORT"]
DEFAULT_MODEL_NAME_FOR_TEST = "sglang-org/Small-Model"
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600


def record(**data):
    with open(os.environ["COMPAT_OBS"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(data) + "\\n")


def popen_launch_server(model, base_url, timeout, api_key=None, other_args=None, env=None, **kwargs):
    record(test="escaped", model=model)  # sglang's own launch: a server outside the plugin
    raise RuntimeError("sglang's own popen_launch_server ran")


def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
    record(test="escaped_kill", pid=parent_pid)


def popen_launch_pd_server(model, base_url, timeout, other_args=None, env=None):
    record(test="escaped_pd", model=model)


def run_bench_serving(model, num_prompts, request_rate, other_server_args, device="auto"):
    import httpx

    process = popen_launch_server(model, DEFAULT_URL_FOR_TEST, timeout=DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
                                  other_args=other_server_args)
    try:
        resp = httpx.post(DEFAULT_URL_FOR_TEST + "/generate", timeout=30,
                          json={"text": "hello", "sampling_params": {"max_new_tokens": 2}})
        return {"status": resp.status_code, "kind": type(process).__name__, "argv": list(process.args)}
    finally:
        kill_process_tree(process.pid)


def run_and_check_memory_leak(workload_func, disable_radix_cache):
    other_args = ["--chunked-prefill-size", "32"] + (["--disable-radix-cache"] if disable_radix_cache else [])
    process = popen_launch_server(DEFAULT_MODEL_NAME_FOR_TEST, DEFAULT_URL_FOR_TEST,
                                  timeout=DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH, other_args=other_args)
    workload_func(DEFAULT_URL_FOR_TEST, DEFAULT_MODEL_NAME_FOR_TEST)
    kill_process_tree(process.pid)


def run_mmlu_test(disable_radix_cache=False):
    def workload_func(base_url, model):
        import httpx

        record(test="workload", status=httpx.get(base_url + "/health", timeout=10).status_code, model=model)

    run_and_check_memory_leak(workload_func, disable_radix_cache)


def run_bench_one_batch(model, other_args):
    record(test="escaped_offline", model=model)
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # stands for python -m sglang.benchmark.one_batch


def intel_amx_benchmark(extra_args=None):
    def decorator(test_func):
        def wrapper(self):
            return run_bench_one_batch(test_func(self), ["--attention-backend", "intel_amx", *(extra_args or [])])
        return wrapper
    return decorator


def popen_with_error_check(command):
    record(test="ran_command", command=list(command))
'''

INNER_CONFTEST = '''
from pytest_sglworker import ModelSpec
from pytest_sglworker.compat import map_model


def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec("tiny-sim", "org/tiny-sim", 1, features={"chat"}))


map_model("sglang-org/Small-Model", "tiny-sim")
'''

INNER_TESTS = '''
import sys
import unittest

import pytest

from pytest_sglworker.compat import (CompatError, intel_amx_benchmark, popen_launch_pd_server, popen_with_error_check,
                                     run_bench_one_batch, run_bench_serving, run_mmlu_test)
from sglang.test.test_utils import record


class TestHelpers(unittest.TestCase):
    def test_a_routed(self):
        result = run_bench_serving("sglang-org/Small-Model", 1, 1, ["--max-total-tokens", "512"])
        record(test="routed", **result)

    def test_b_routed_through_another_helper(self):
        run_mmlu_test(disable_radix_cache=True)

    def test_c_budget(self):
        with pytest.raises(Exception) as info:
            run_bench_serving("sglang-org/Small-Model", 1, 1, ["--mem-fraction-static", "0.95"])
        record(test="budget", kind=type(info.value).__name__, text=str(info.value))

    def test_d_refused(self):
        for call in (lambda: run_bench_one_batch("sglang-org/Small-Model", []),
                     lambda: intel_amx_benchmark()(lambda self: "sglang-org/Small-Model")(self),
                     lambda: popen_launch_pd_server("sglang-org/Small-Model", "http://127.0.0.1:1", 60),
                     lambda: popen_with_error_check([sys.executable, "-m", "sglang.launch_server", "--model-path",
                                                     "sglang-org/Small-Model"])):
            with pytest.raises(CompatError) as info:
                call()
            record(test="refused", text=str(info.value))
        popen_with_error_check([sys.executable, "-c", "pass"])  # a command that starts no engine runs as upstream's
'''


_RUN_KEY = pytest.StashKey[Any]()


def _run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    obs = pytester.path / "obs.jsonl"
    port = free_port_block()
    monkeypatch.setenv("COMPAT_PORT", str(port))
    monkeypatch.setenv("COMPAT_OBS", str(obs))
    for key in ("SGLWORKER_MODELS", "SGLWORKER_LAUNCHER", "SGLWORKER_GPUS", "SGLWORKER_COMPAT_MODELS"):
        monkeypatch.delenv(key, raising=False)
    package = pytester.path / "sglang" / "test"
    package.mkdir(parents=True)
    (pytester.path / "sglang" / "__init__.py").write_text("", encoding="utf-8")
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "test_utils.py").write_text(FAKE_TEST_UTILS, encoding="utf-8")
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_helpers=INNER_TESTS)
    result = pytester.runpytest_subprocess(
        "-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim", "--sgl-gpus", "sim:1",
        "--sgl-lease-timeout", "20", "--sgl-startup-timeout", "60", timeout=300)
    lines = result.outlines + result.errlines
    return {"ret": int(result.ret), "lines": lines, "stdout": "\n".join(lines),
            "obs": [json.loads(line) for line in obs.read_text().splitlines()] if obs.is_file() else []}


@pytest.fixture
def inner(request: pytest.FixtureRequest) -> dict[str, Any]:
    return shared_run(request, _RUN_KEY, lambda get: _run_inner(get("pytester"), get("monkeypatch")))


pytestmark = pytest.mark.xdist_group("compat-helpers")


def _seen(inner: dict[str, Any], test: str) -> list[dict[str, Any]]:
    return [o for o in inner["obs"] if o["test"] == test]


def test_helpers_that_launch_go_through_the_plugin(inner: dict[str, Any], sim_env: dict[str, str]) -> None:
    """run_bench_serving and run_mmlu_test (through run_and_check_memory_leak) start their servers as the
    plugin's workers (the sim, the mapped spec, the budget check); sglang's own launch never runs."""
    tail = inner["stdout"][-6000:]
    assert not [o for o in inner["obs"] if o["test"].startswith("escaped")], tail
    assert "PASSED test_helpers.py::TestHelpers::test_a_routed" in inner["stdout"], tail
    routed = _seen(inner, "routed")[-1]
    assert routed["status"] == 200 and routed["kind"] == "ServerProcess", routed
    assert "pytest_sglworker.sim" in " ".join(routed["argv"]) and "org/tiny-sim" in routed["argv"], routed["argv"]
    assert "PASSED test_helpers.py::TestHelpers::test_b_routed_through_another_helper" in inner["stdout"], tail
    assert _seen(inner, "workload")[-1] == {"test": "workload", "status": 200, "model": "sglang-org/Small-Model"}
    budget = _seen(inner, "budget")[-1]
    assert budget["kind"] == "BudgetViolation" and "mem-fraction-static" in budget["text"], budget


def test_helpers_that_start_an_engine_the_plugin_cannot_serve_are_refused(inner: dict[str, Any]) -> None:
    tail = inner["stdout"][-6000:]
    assert "PASSED test_helpers.py::TestHelpers::test_d_refused" in inner["stdout"], tail
    texts = [o["text"] for o in _seen(inner, "refused")]
    assert len(texts) == 4, texts
    assert "run_bench_one_batch" in texts[0] and "run_bench_serving from pytest_sglworker.compat" in texts[0]
    assert "intel_amx_benchmark" in texts[1] and "through run_bench_one_batch" in texts[1]
    assert "sgl_workers(prefill=P, decode=D)" in texts[2]
    assert "sglang.launch_server" in texts[3] and "popen_launch_server from pytest_sglworker.compat" in texts[3]
    assert [o["command"][-2:] for o in _seen(inner, "ran_command")] == [["-c", "pass"]]


def test_a_files_timeout_over_the_startup_option_is_said(inner: dict[str, Any]) -> None:
    said = [line for line in inner["lines"] if "popen_launch_server(timeout=600)" in line]
    assert len(said) == 1, inner["stdout"][-6000:]
    assert "not --sgl-startup-timeout (60 s)" in said[0]


def test_classify_reads_the_code_not_a_list_of_names() -> None:
    """A helper is routed when it (or a helper it calls, even from a nested function) names popen_launch_server,
    refused when it reaches a refused one; others are handed out unchanged."""
    module = types.ModuleType("fake_test_utils")
    exec(compile(FAKE_TEST_UTILS.replace('os.environ["COMPAT_PORT"]', '"1"'), "fake_test_utils", "exec"),
         module.__dict__)
    routed, refused = helpers.classify(module)
    assert routed == {"run_bench_serving", "run_and_check_memory_leak", "run_mmlu_test"}
    assert refused == {"run_bench_one_batch", "intel_amx_benchmark", "popen_launch_pd_server"}
    assert helpers.helper("record", module) is None
    assert helpers.starts_engine(["python3", "-m", "sglang.benchmark.one_batch", "--batch-size", "1"])
    assert helpers.starts_engine("/venv/bin/sglang serve --model-path m")
    assert not helpers.starts_engine([sys.executable, "-m", "sglang.check_env"])


#: what 0.5.23's sglang.test.test_utils holds (read from the installed module by test_real_helpers_are_classified)
ROUTED_0_5_23 = {"run_and_check_memory_leak", "run_bench_one_batch_server", "run_bench_serving",
                 "run_bench_serving_multi", "run_embeddings_benchmark", "run_embeddings_benchmark_multi",
                 "run_mmlu_test", "run_mulit_request_test", "run_score_benchmark", "run_score_benchmark_multi"}
REFUSED_0_5_23 = {"intel_amx_benchmark", "popen_launch_pd_server", "run_bench_offline_throughput",
                  "run_bench_one_batch"}

CLASSIFY_REAL = """
import json, sys, types
sys.modules.setdefault("datasets", types.SimpleNamespace(load_dataset=None))  # imported, not used, by test_utils
import sglang.test.test_utils as module
from pytest_sglworker.compat.helpers import COMMAND_RUNNERS, classify
routed, refused = classify(module)
print("CLASSIFIED " + json.dumps([sorted(routed), sorted(refused), [n for n in COMMAND_RUNNERS if hasattr(module, n)]]))
"""


@pytest.mark.real_engine
def test_real_helpers_are_classified() -> None:
    """The installed sglang's helpers: every one that launches is routed or refused, as the how-to lists them."""
    import subprocess

    from pytest_sglworker.engine.cpu_engine import real_engine_missing_reason, real_engine_python

    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([str(python), "-c", CLASSIFY_REAL], capture_output=True, text=True, timeout=600,
                          cwd=repo, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("CLASSIFIED ")), None)
    assert line is not None, done.stderr[-4000:]
    routed, refused, runners = json.loads(line.split(" ", 1)[1])
    assert set(routed) == ROUTED_0_5_23 and set(refused) == REFUSED_0_5_23 and runners == list(helpers.COMMAND_RUNNERS)
    how_to = (repo / "docs" / "how-to" / "sglang-unittests.md").read_text(encoding="utf-8")
    for name in sorted(ROUTED_0_5_23 | REFUSED_0_5_23 | set(runners)):
        assert f"`{name}`" in how_to, name
