"""The drop-in for sglang's unittest suites (``pytest_sglworker.compat``) against the simulated engine.

One inner pytest session (``pytester.runpytest_subprocess``, ``--sgl-engine sim``, one declared GPU) runs a
unittest-style file written the way sglang's suites are: servers started in ``setUpClass`` with
``popen_launch_server(model, base_url, timeout, ...)`` and ended in ``tearDownClass``. Every class uses the same
``base_url`` and there is one GPU, so each class's launch shows that the previous server's lease and port came
back. The outer tests each assert one promise over that run (whichever runs first pays for it):

- the server is a worker of the plugin: on ``base_url``'s port, on a leased GPU (``CUDA_VISIBLE_DEVICES`` and the
  lease's holder record naming the test class), with the test's env, its log file per port, teed into
  ``return_stdout_stderr``, and a failing test gets the worker's log section;
- ``kill_process_tree`` of the drop-in, sglang's own kill (a file that keeps ``from sglang.srt.utils import
  kill_process_tree``), and a forgotten teardown all end the server, give the lease back and count as stops; a
  server killed while its tests run is a death that fails the class's teardown;
- a budget violation in ``other_args`` is an error naming the test class and the fix, unless
  ``budget_opt_out`` gives a reason;
- a startup failure (``SGLSIM_FAULT=crash_oom``) raises the worker error with its diagnosis and log tail;
- a non-loopback ``base_url``, an unknown model and a ``--port`` in ``other_args`` are refused with what to do;
- nothing is left running (the autouse check of ``tests/conftest.py``, by this test's process mark).

The mapping of model names to specs and the re-exported constants are tested directly (fast, no process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from port_grab import free_port_block
from session_helpers import shared_run

from pytest_sglworker import ModelSpec, SpecRegistry
from pytest_sglworker.compat import CompatError, ServerProcess
from pytest_sglworker.compat import models as compat_models
from pytest_sglworker.compat.launches import parse_base_url

# ------------------------------------------------------------------------------------------------ the inner run

INNER_CONFTEST = '''
from pytest_sglworker import ModelSpec
from pytest_sglworker.compat import budget_opt_out, map_model


def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec("tiny-sim", "org/tiny-sim", 1, features={"chat"}))


map_model("sglang-org/Small-Model", "tiny-sim")
budget_opt_out("TestE_BudgetOptedOut", reason="measures a larger KV pool on purpose")
'''

INNER_TESTS = '''
import glob
import io
import json
import os
import signal
import time
import unittest

import httpx
import psutil

from pytest_sglworker.compat import CompatError, kill_process_tree, popen_launch_server

PORT = int(os.environ["COMPAT_PORT"])
BASE_URL = f"http://127.0.0.1:{PORT}"
MODEL = "sglang-org/Small-Model"  # mapped to the spec tiny-sim by the conftest
OBS = os.environ["COMPAT_OBS"]


def record(**data):
    with open(OBS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(data) + "\\n")


def sglang_kill_process_tree(pid):
    """What sglang.srt.utils.kill_process_tree does (SIGKILL the children, then the root, then wait): a file that
    keeps sglang's own import ends its server this way."""
    root = psutil.Process(pid)
    procs = root.children(recursive=True) + [root]
    for proc in procs:
        proc.kill()
    psutil.wait_procs(procs, timeout=30)


def holders():
    found = []
    for path in glob.glob(os.path.join(os.environ["SGLWORKER_LOCK_DIR"], "gpu-*.json")):
        with open(path, encoding="utf-8") as fh:
            found.append(json.load(fh)["holder"])
    return found


class TestA_Served(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.out, cls.err = io.StringIO(), io.StringIO()
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60, api_key="sk-123456",
                                          other_args=["--max-total-tokens", 512], env={"COMPAT_OWN_ENV": "yes"},
                                          return_stdout_stderr=(cls.out, cls.err))

    @classmethod
    def tearDownClass(cls):
        pid = cls.process.pid
        kill_process_tree(pid)
        record(test="A_teardown", pid=pid, exists=psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie",
               poll=cls.process.poll(), holders=holders())

    def test_a_served_on_base_url(self):
        headers = {"Authorization": "Bearer sk-123456"}
        assert httpx.get(BASE_URL + "/health", timeout=10).status_code == 200
        resp = httpx.post(BASE_URL + "/generate", headers=headers, timeout=30,
                          json={"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        assert resp.status_code == 200, resp.text
        info = httpx.get(BASE_URL + "/server_info", headers=headers, timeout=10).json()
        environ = psutil.Process(self.process.pid).environ()
        worker = self.process.worker
        record(test="A", pid=self.process.pid, port=worker.port, info_port=info.get("port"),
               max_total_tokens=info.get("max_total_num_tokens"), gpus=worker.gpus,
               cvd=environ.get("CUDA_VISIBLE_DEVICES"), own_env=environ.get("COMPAT_OWN_ENV"),
               log=str(self.process.log_path), argv=self.process.args, poll=self.process.poll(), holders=holders(),
               popen_like=[callable(getattr(self.process, n, None)) for n in ("poll", "wait", "terminate", "kill")])

    def test_b_log_is_teed(self):
        deadline = time.monotonic() + 10
        while "GET /health" not in self.err.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = open(self.process.log_path, encoding="utf-8", errors="replace").read()
        record(test="B", tee=self.err.getvalue(), out=self.out.getvalue(), log_head=log[:2000])

    def test_c_fails_on_purpose(self):
        assert False, "deliberate failure while the compat server serves"


class TestB_SglangOwnKill(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60)

    @classmethod
    def tearDownClass(cls):
        sglang_kill_process_tree(cls.process.pid)

    def test_served(self):
        assert httpx.get(BASE_URL + "/health", timeout=10).status_code == 200
        record(test="B_served", pid=self.process.pid, holders=holders())


class TestC_Forgotten(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60)

    def test_served(self):
        assert httpx.get(BASE_URL + "/health", timeout=10).status_code == 200
        record(test="C_served", pid=self.process.pid)


class TestD_Budget(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60, other_args=["--mem-fraction-static", "0.8"])

    def test_never_runs(self):
        record(test="D_ran")


class TestE_BudgetOptedOut(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60, other_args=["--mem-fraction-static", "0.8"])

    @classmethod
    def tearDownClass(cls):
        kill_process_tree(cls.process.pid)

    def test_runs_with_the_fraction_asked(self):
        info = httpx.get(BASE_URL + "/server_info", timeout=10).json()
        record(test="E", fraction=info.get("mem_fraction_static"), pid=self.process.pid)


class TestF_StartupFailure(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        started = time.monotonic()
        try:
            cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60, env={"SGLSIM_FAULT": "crash_oom"})
        finally:
            record(test="F", seconds=time.monotonic() - started)

    def test_never_runs(self):
        record(test="F_ran")


class TestG_DiesDuringItsTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60)

    @classmethod
    def tearDownClass(cls):
        kill_process_tree(cls.process.pid)

    def test_server_killed_under_it(self):
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        record(test="G", pid=self.process.pid)


class TestH_Refused(unittest.TestCase):
    def _refused(self, name, **kwargs):
        args = {"model": MODEL, "base_url": BASE_URL, "timeout": 60, **kwargs}
        with self.assertRaises(CompatError) as caught:
            popen_launch_server(**args)
        record(test="H", case=name, message=str(caught.exception))

    def test_foreign_host(self):
        self._refused("foreign", base_url="http://10.0.0.5:30000")

    def test_unknown_model(self):
        self._refused("unknown", model="org/not-registered")

    def test_port_in_other_args(self):
        self._refused("port", other_args=["--port", "30001"])

    def test_pd(self):
        self._refused("pd", pd_separated=True)
'''


@dataclass
class InnerRun:
    ret: int
    stdout: str
    lines: list[str]
    report: dict[str, Any]
    obs: list[dict[str, Any]]
    port: int
    log_dir: Path

    def seen(self, test: str, **match: Any) -> list[dict[str, Any]]:
        return [o for o in self.obs if o["test"] == test and all(o.get(k) == v for k, v in match.items())]

    def one(self, test: str, **match: Any) -> dict[str, Any]:
        found = self.seen(test, **match)
        assert found, f"the inner test {test} {match} recorded nothing; inner output:\n{self.stdout[-6000:]}"
        return found[-1]

    def outcomes(self, cls: str, test: str) -> set[str]:
        """What the inner -rA summary says of ``cls::test``: PASSED, FAILED, SKIPPED, and ERROR for an error in its
        setup or teardown (a test that passed and then errored at teardown is both)."""
        pattern = re.compile(rf"^(PASSED|FAILED|ERROR|SKIPPED) \S*::{cls}::{test}\b")
        return {m.group(1) for m in map(pattern.search, self.lines) if m}

    def section(self, title: str) -> str:
        start = next((i for i, line in enumerate(self.lines) if title in line and line.startswith("__")), None)
        assert start is not None, f"no section {title!r} in the inner output:\n{self.stdout[-6000:]}"
        end = next((i for i in range(start + 1, len(self.lines)) if self.lines[i].startswith(("__", "="))),
                   len(self.lines))
        return "\n".join(self.lines[start:end])

    def launches(self) -> list[dict[str, Any]]:
        return list(self.report.get("launches", []))


_RUN_KEY = pytest.StashKey[Any]()


def _run_inner(pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> InnerRun:
    obs, report = pytester.path / "obs.jsonl", pytester.path / "report.json"
    port = free_port_block()
    monkeypatch.setenv("COMPAT_PORT", str(port))
    monkeypatch.setenv("COMPAT_OBS", str(obs))
    for key in ("SGLWORKER_MODELS", "SGLWORKER_LAUNCHER", "SGLWORKER_GPUS", "SGLWORKER_REPORT",
                compat_models.ENV_MODELS):
        monkeypatch.delenv(key, raising=False)
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_suite=INNER_TESTS)
    result = pytester.runpytest_subprocess(
        "-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim", "--sgl-gpus", "sim:1",
        "--sgl-lease-timeout", "20", "--sgl-startup-timeout", "60", "--sgl-report", str(report), timeout=300)
    lines = result.outlines + result.errlines
    return InnerRun(
        ret=int(result.ret), stdout="\n".join(lines), lines=lines,
        report=json.loads(report.read_text()) if report.is_file() else {},
        obs=[json.loads(line) for line in obs.read_text().splitlines()] if obs.is_file() else [],
        port=port, log_dir=Path(sim_env["SGLWORKER_LOG_DIR"]))


@pytest.fixture
def inner(request: pytest.FixtureRequest) -> InnerRun:
    return shared_run(request, _RUN_KEY, lambda get: _run_inner(get("pytester"), get("sim_env"), get("monkeypatch")))


pytestmark = pytest.mark.xdist_group("compat-sim")


# ------------------------------------------------------------------------------------------------ the promises


def test_server_is_a_plugin_worker_on_the_tests_url(inner: InnerRun) -> None:
    """The server listens on base_url's port, holds a GPU lease named after its test class, gets the test's env,
    its api key and the model name the test asked for; the object returned is Popen-like with the worker's pid."""
    assert inner.outcomes("TestA_Served", "test_a_served_on_base_url") == {"PASSED"}, inner.stdout[-6000:]
    seen = inner.one("A")
    assert seen["port"] == seen["info_port"] == inner.port
    assert seen["max_total_tokens"] == 512
    assert seen["gpus"] == seen["cvd"] == "0"
    assert seen["holders"] and all("test_suite.py::TestA_Served" in h for h in seen["holders"]), seen["holders"]
    assert seen["own_env"] == "yes" and seen["poll"] is None and all(seen["popen_like"])
    argv = seen["argv"]
    assert argv[argv.index("--port") + 1] == str(inner.port) and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--api-key") + 1] == "sk-123456"
    assert argv[argv.index("--served-model-name") + 1] == "sglang-org/Small-Model"
    assert argv[argv.index("--model-path") + 1] == "org/tiny-sim"
    assert "--mem-fraction-static=0.6" in argv and "--cuda-graph-backend-prefill=disabled" in argv


def test_log_file_per_port_teed_and_in_failure_sections(inner: InnerRun) -> None:
    """The worker logs to sglang-worker-<port>.log in the session's log dir; return_stdout_stderr gets its lines;
    a test that fails while the server is up gets the worker's section with the log's path and tail."""
    seen, teed = inner.one("A"), inner.one("B")
    log = Path(seen["log"])
    assert log.parent == inner.log_dir and re.fullmatch(rf"sglang-worker-{inner.port}(-\d+)?\.log", log.name)
    assert "GET /health" in teed["tee"] and teed["tee"].startswith(teed["log_head"][:200])
    assert teed["out"] == ""  # one merged log: its lines go to the stderr stream
    assert inner.outcomes("TestA_Served", "test_c_fails_on_purpose") == {"FAILED"}
    section = inner.section("test_c_fails_on_purpose")
    assert "deliberate failure while the compat server serves" in section
    assert f"sglang worker tiny-sim 127.0.0.1:{inner.port}" in inner.stdout
    assert f"log: {log}" in inner.stdout  # the section names the log (kept: a test of it failed)
    assert log.is_file()


def test_every_teardown_path_returns_the_lease(inner: InnerRun) -> None:
    """The drop-in's kill_process_tree, sglang's own kill and a forgotten teardown each end the server and give its
    lease and port back: the next class on the same URL and the single GPU starts."""
    teardown = inner.one("A_teardown")
    assert not teardown["exists"] and teardown["poll"] is not None and teardown["holders"] == []
    for cls, test in (("TestB_SglangOwnKill", "test_served"), ("TestC_Forgotten", "test_served"),
                      ("TestE_BudgetOptedOut", "test_runs_with_the_fraction_asked")):
        assert inner.outcomes(cls, test) == {"PASSED"}, f"{cls}: {inner.stdout[-6000:]}"
    held = inner.one("B_served")["holders"]
    assert held and all("TestB_SglangOwnKill" in h for h in held), held
    forgotten = inner.one("C_served")["pid"]
    assert re.search(rf"worker tiny-sim on 127\.0\.0\.1:{inner.port} \(pid {forgotten}.*launched by "
                     r"test_suite\.py::TestC_Forgotten, was still running after the teardown", inner.stdout)
    by_pid = {launch["pid"]: launch for launch in inner.launches()}
    assert by_pid[inner.one("A")["pid"]]["outcome"] == "stopped"
    assert by_pid[inner.one("B_served")["pid"]]["outcome"] == "stopped"  # sglang's kill in tearDownClass: a stop
    assert by_pid[inner.one("E")["pid"]]["outcome"] == "stopped"
    assert all(launch["t_released"] for launch in inner.launches())
    assert inner.ret == pytest.ExitCode.TESTS_FAILED  # the deliberate failures, no internal error


def test_a_server_killed_during_its_tests_is_a_death(inner: InnerRun) -> None:
    """A server that dies while its class's tests run is reported as a death at the class's teardown, with the
    diagnosis of its log, and counted as a death; its tearDownClass still runs."""
    assert inner.outcomes("TestG_DiesDuringItsTests", "test_server_killed_under_it") == {"PASSED", "ERROR"}
    text = inner.section("test_server_killed_under_it")
    assert re.search(r"worker tiny-sim exited while the tests of test_suite\.py::TestG_DiesDuringItsTests ran: .* "
                     r"\(on 127\.0\.0\.1:\d+, pid \d+", text), text
    assert "log: " in text
    launch = next(la for la in inner.launches() if la["pid"] == inner.one("G")["pid"])
    assert launch["outcome"] == "died"


def test_budget_violation_names_the_class_and_the_fix(inner: InnerRun) -> None:
    """other_args that loosen the budget stop the launch before anything starts; budget_opt_out lets another
    class through with the fraction it asked for."""
    assert inner.outcomes("TestD_Budget", "test_never_runs") == {"ERROR"}
    assert not inner.seen("D_ran")
    text = inner.section("test_never_runs")
    assert ("popen_launch_server('sglang-org/Small-Model', other_args=['--mem-fraction-static', '0.8']) in "
            "test_suite.py::TestD_Budget (setUpClass) (model spec 'tiny-sim') breaks the mandatory worker "
            "budget") in text
    assert "budget_opt_out('TestD_Budget', reason='why')" in text and "sgl_budget_opt_out" in text
    assert inner.one("E")["fraction"] == 0.8
    assert any("(budget opt-out: measures a larger KV pool on purpose)" in la["label"] for la in inner.launches())


def test_startup_failure_raises_the_worker_error_with_its_diagnosis(inner: InnerRun) -> None:
    """A server that dies during startup fails its class at once with the plugin's diagnosis and log tail."""
    assert inner.outcomes("TestF_StartupFailure", "test_never_runs") == {"ERROR"}
    assert not inner.seen("F_ran")  # failing at once: the exit (below), not the startup timeout
    text = inner.section("TestF_StartupFailure")
    assert "WorkerStartupError" in text
    assert re.search(r"worker tiny-sim: CUDA out of memory .* — exited during startup .*\(on 127\.0\.0\.1:\d+, "
                     r"pid \d+, GPUs 0\)", text), text
    assert "last lines of the log" in text
    assert "Received sigquit from a child process" in text  # the tail of the engine's log


def test_refusals_say_what_to_change(inner: InnerRun) -> None:
    messages = {o["case"]: o["message"] for o in inner.seen("H")}
    assert set(messages) == {"foreign", "unknown", "port", "pd"}, inner.stdout[-4000:]
    assert "workers listen on 127.0.0.1 only: use http://127.0.0.1:PORT" in messages["foreign"]
    assert "no registered model spec serves 'org/not-registered'" in messages["unknown"]
    assert "SGLWORKER_COMPAT_MODELS" in messages["unknown"] and "map_model" in messages["unknown"]
    assert "the port comes from base_url" in messages["port"]
    assert "sgl_workers(prefill=P, decode=D)" in messages["pd"]


# ------------------------------------------------------------------------------------------------ direct


def test_model_names_resolve_to_specs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(compat_models.ENV_MODELS, raising=False)
    monkeypatch.delenv("SGLWORKER_MODEL_ROOT", raising=False)
    monkeypatch.delenv("ROUTER_LOCAL_MODEL_PATH", raising=False)
    registry = SpecRegistry.with_builtins()
    local = tmp_path / "tiny"
    registry.add(ModelSpec("tiny", str(local), 1))
    registry.add(ModelSpec("tiny-twin", str(local), 1))
    try:
        # By the model a spec serves (the built-in llama-1b is sglang's DEFAULT_SMALL_MODEL_NAME_FOR_TEST).
        assert compat_models.resolve_spec("meta-llama/Llama-3.2-1B-Instruct", registry).name == "llama-1b"
        assert compat_models.resolve_spec("tiny-twin", registry).name == "tiny-twin"  # by name
        with pytest.raises(CompatError, match=re.escape("served by several registered specs ('tiny', 'tiny-twin')")):
            compat_models.resolve_spec(str(local), registry)
        compat_models.map_model("meta-llama/Llama-3.2-1B-Instruct", "tiny")
        assert compat_models.resolve_spec("meta-llama/Llama-3.2-1B-Instruct", registry).name == "tiny"
        monkeypatch.setenv(compat_models.ENV_MODELS, "meta-llama/Llama-3.2-1B-Instruct=tiny-twin")
        assert compat_models.resolve_spec("meta-llama/Llama-3.2-1B-Instruct", registry).name == "tiny-twin"
        # The model constants follow the mapping; others and unmapped ones are unchanged.
        assert compat_models.mapped_constant("DEFAULT_SMALL_MODEL_NAME_FOR_TEST", "meta-llama/Llama-3.2-1B-Instruct",
                                             registry) == str(local)
        assert compat_models.mapped_constant("DEFAULT_URL_FOR_TEST", "meta-llama/Llama-3.2-1B-Instruct",
                                             registry) == "meta-llama/Llama-3.2-1B-Instruct"
        unknown = compat_models.mapped_constant("DEFAULT_MOE_MODEL_NAME_FOR_TEST", "org/unknown", registry)
        assert unknown == "org/unknown"
        monkeypatch.setenv(compat_models.ENV_MODELS, "meta-llama/Llama-3.2-1B-Instruct=nope")
        with pytest.raises(CompatError, match=re.escape("maps 'meta-llama/Llama-3.2-1B-Instruct' to the model "
                                                        "spec 'nope', which is not registered")):
            compat_models.resolve_spec("meta-llama/Llama-3.2-1B-Instruct", registry)
        monkeypatch.setenv(compat_models.ENV_MODELS, "just-a-name")
        with pytest.raises(CompatError, match="is not NAME=SPEC"):
            compat_models.env_mapping()
    finally:
        compat_models.clear()


def test_budget_opt_outs_match_node_ids() -> None:
    try:
        compat_models.budget_opt_out("TestSRTEndpoint", reason="upstream asks for 0.7")
        compat_models.budget_opt_out("*test_other.py::*", reason="the whole file")
        assert compat_models.opt_out_for("test_srt_endpoint.py::TestSRTEndpoint") == "upstream asks for 0.7"
        assert compat_models.opt_out_for("a/test_other.py::TestX::test_y") == "the whole file"
        assert compat_models.opt_out_for("test_srt_endpoint.py::TestTokenizeDetokenize") is None
        with pytest.raises(CompatError, match="needs a reason"):
            compat_models.budget_opt_out("TestX", reason=" ")
    finally:
        compat_models.clear()


@pytest.mark.parametrize("url, fragment", [
    ("http://10.1.2.3:21000", "workers listen on 127.0.0.1 only"),
    ("http://[::1]:21000", "workers listen on 127.0.0.1 only"),
    ("https://127.0.0.1:21000", "must be http://HOST:PORT"),
    ("http://127.0.0.1:21000/v1", "must be http://HOST:PORT"),
    ("http://127.0.0.1", "needs a port"),
    ("http://127.0.0.1:65535", "needs a port"),
])
def test_base_url_is_loopback_with_a_port(url: str, fragment: str) -> None:
    with pytest.raises(CompatError, match=re.escape(fragment)):
        parse_base_url(url)
    assert parse_base_url("http://localhost:21000") == ("localhost", 21000)
    assert parse_base_url("http://127.0.0.1:21000/") == ("127.0.0.1", 21000)


def test_outside_pytest_without_sglang_is_a_clear_error(tmp_path: Path) -> None:
    """Outside a pytest session the drop-ins are sglang's own; where sglang is not importable either, that says so
    (and importing a re-exported sglang name says why it cannot)."""
    code = (
        "import sys\n"
        "sys.modules['sglang'] = None  # as where sglang is not installed\n"
        "from pytest_sglworker.compat import CompatError, popen_launch_server\n"
        "try:\n"
        "    popen_launch_server('org/m', 'http://127.0.0.1:21000', 60)\n"
        "except CompatError as exc:\n"
        "    print('LAUNCH:', exc)\n"
        "try:\n"
        "    from pytest_sglworker.compat import CustomTestCase\n"
        "except ImportError as exc:\n"
        "    print('IMPORT:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={**os.environ}, check=False)
    assert out.returncode == 0, out.stderr
    assert "LAUNCH: no pytest session with pytest-sglworker is running here" in out.stdout
    assert "run the file with pytest" in out.stdout
    assert "IMPORT: pytest_sglworker.compat re-exports 'CustomTestCase' from sglang.test.test_utils" in out.stdout


def test_server_process_is_not_a_popen() -> None:
    """sglang's CustomTestCase starts its os._exit watcher only for a subprocess.Popen: the drop-in's process is
    not one, so a dying server fails a test instead of ending the whole pytest run."""
    assert not issubclass(ServerProcess, subprocess.Popen)


def test_renamed_flags() -> None:
    try:
        compat_models.rename_flag("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", reason="0.5.23 split it")
        args, notes = compat_models.renamed_args(["--cuda-graph-max-bs", "8", "--cuda-graph-max-bs=4",
                                                  "--cuda-graph-max-bs-prefill", "2", "--mem-fraction-static", "0.5"])
        assert args == ["--cuda-graph-max-bs-decode", "8", "--cuda-graph-max-bs-decode=4",
                        "--cuda-graph-max-bs-prefill", "2", "--mem-fraction-static", "0.5"]
        assert notes == ["--cuda-graph-max-bs -> --cuda-graph-max-bs-decode (0.5.23 split it)"]
        with pytest.raises(CompatError, match="needs a reason"):
            compat_models.rename_flag("--a", "--b", reason="")
        with pytest.raises(CompatError, match="flags are '--name' strings"):
            compat_models.rename_flag("-a", "--b", reason="x")
    finally:
        compat_models.clear()
    assert compat_models.renamed_args(["--cuda-graph-max-bs", "8"]) == (["--cuda-graph-max-bs", "8"], [])


def test_importable_without_pytest(tmp_path: Path) -> None:
    """A test module that imports the drop-in is imported again where there is no pytest: sglang's scheduler
    unpickles a custom logit processor by importing the module that defined it."""
    code = (
        "import sys\n"
        "sys.modules['pytest'] = None  # as in an engine's Python without pytest\n"
        "from pytest_sglworker.compat import budget_opt_out, kill_process_tree, map_model, popen_launch_server\n"
        "assert 'pytest_sglworker.compat.launches' not in sys.modules\n"
        "assert 'pytest_sglworker.plugin' not in sys.modules\n"
        "print('IMPORTED')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         check=False)
    assert out.returncode == 0 and "IMPORTED" in out.stdout, out.stderr


def test_a_dying_process_is_told_from_a_running_one() -> None:
    from pytest_sglworker.compat.launches import _dying

    assert not _dying(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not _dying(proc.pid)
        proc.kill()
        # Killed but not yet reaped: the kernel has torn it down as far as it goes (PF_EXITING stays set on the
        # zombie). waitid with WNOWAIT returns once it has exited and leaves it unreaped.
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        assert _dying(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)
    assert not _dying(proc.pid)  # gone
