"""The real sglang 0.5.23 on the CPU, through the plugin as users meet it (the ``real_engine`` tier).

A real launch takes tens of seconds on a small CI machine (the scheduler and detokenizer processes each
import sglang), so the whole tier makes exactly two launches, in ONE inner pytest session
(``pytester.runpytest_subprocess``) that is run once and shared by the outer tests below:

- the good spec ``tiny-cpu`` (the CPU recipe of :func:`cpu_engine_spec` over the tiny model, built once per
  session): seven inner tests share one pooled worker (``1 launched, 6 reused``); they talk to the real HTTP
  API, read the real log while the worker runs, record the worker's process tree, and one fails on purpose;
- the bad spec ``tiny-missing`` (a model directory that does not exist), launched by ``sgl_spawn_worker``
  after the good tests (the good worker is retired after its last test, or evicted for this lease on
  ``--sgl-gpus sim:1``: a teardown in the middle of the session), then it fails fast with sglang's real
  traceback and the plugin's diagnosis;
- a last inner test checks, inside the session, that nothing of either launch is left.

Each outer test asserts one promise over that shared run; whichever runs first pays for it (a failed run
is cached too, so that it is not repeated). Leftover processes are checked three ways: by this test's
``SGLWORKER_TEST_MARK`` (the autouse check of ``conftest.py``), by the PIDs the inner tests recorded, and by
process name and command line (``sglang``), because sglang's children rename themselves with
setproctitle, which overwrites their environment block: ``/proc/<pid>/environ`` of ``sglang::scheduler``
no longer shows any marker, so an environment-only check cannot see them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from failure_goals import check_goals

from pytest_sglworker.engine.cpu_engine import (
    build_tiny_model,
    real_engine_launcher,
    real_engine_missing_reason,
    real_engine_python,
)

pytestmark = [pytest.mark.real_engine, pytest.mark.xdist_group("real-engine")]

MARK = "SGLWORKER_TEST_MARK"
#: Generous: a healthy launch took 27-67 s on a busy 2-core machine (most of it importing sglang).
STARTUP_TIMEOUT = 300
#: The inner tests that use the pooled good worker (the last two of the inner module do not).
POOLED_TESTS = 7


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def real_python() -> Path:
    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    return python


@pytest.fixture(scope="session")
def tiny_model(real_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight model, built once per session (~15 s: the builder imports torch)."""
    return build_tiny_model(real_python, tmp_path_factory.mktemp("real-engine") / "tiny-model")


INNER_CONFTEST = '''
import json

import pytest

from pytest_sglworker.engine.cpu_engine import cpu_engine_spec

MODEL = {model!r}
MISSING = {missing!r}
OBS = {obs!r}


def pytest_sglworker_register_specs(registry):
    registry.add(cpu_engine_spec("tiny-cpu", MODEL))
    registry.add(cpu_engine_spec("tiny-missing", MISSING))


@pytest.fixture
def record(request):
    """Append what a test saw to the observations file the outer test reads."""
    def _record(**data):
        data["test"] = request.node.originalname
        with open(OBS, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(data) + "\\n")
    return _record


@pytest.fixture
def observations():
    try:
        with open(OBS, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh]
    except FileNotFoundError:
        return []
'''

INNER_TESTS = '''
import json
import os
import time

import httpx
import psutil
import pytest

from pytest_sglworker.engine import diagnosis, log_lines
from pytest_sglworker.resources.processes import OWNER_ENV, SESSION_ID

from conftest import MISSING


def _tree(pid):
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return [{{"pid": p.pid, "name": p.name(), "create_time": p.create_time(), "sid": os.getsid(p.pid),
             "cmdline": " ".join(p.cmdline()).strip()}} for p in procs]


def _post_json(worker, path, payload):
    return worker.client.post(path, content=json.dumps(payload), headers={{"Content-Type": "application/json"}})


def test_a_ready_and_generate(sgl_worker, record):
    # The fixture hands out the worker only once the real engine is healthy: the readiness line is
    # already in the log, /ready answered 200 after it (the readiness probe: no generation), the engine never
    # answered 200 before it, and no health generation ran before this test's own requests.
    # sglang answers ready a moment before it logs its ready line: wait for the line, bounded
    deadline = time.monotonic() + 10
    while "The server is fired up and ready to roll!" not in sgl_worker.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "no ready line in the log 10 s after the engine answered ready"
        time.sleep(0.05)
    log = sgl_worker.log_path.read_text(errors="replace")
    lines = log.splitlines()
    ready = next(i for i, line in enumerate(lines) if "The server is fired up and ready to roll!" in line)
    health = [i for i, line in enumerate(lines) if '"GET /ready HTTP/1.1" 200' in line]
    # sglang is Up (and /ready answers 200) a moment before it logs the line: after its warmup request.
    warmup = next(i for i, line in enumerate(lines) if '"POST /generate HTTP/1.1" 200' in line)
    assert health and min(health) > warmup and ready - min(health) <= 2, "the engine answered 200 before it was ready"
    assert not any('"GET /health_generate HTTP/1.1"' in line for line in lines), "readiness cost a generation"
    not_ready = sum('"GET /ready HTTP/1.1" 503' in line for line in lines)
    assert sgl_worker.client.get("/health_generate").status_code == 200

    resp = _post_json(sgl_worker, "/generate",
                      {{"text": "The capital city of France is",
                       "sampling_params": {{"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert isinstance(body["text"], str) and len(body["output_ids"]) == 8
    assert body["meta_info"]["completion_tokens"] == 8
    assert body["meta_info"]["finish_reason"] == {{"type": "length", "length": 8}}
    record(pid=sgl_worker.pid, port=sgl_worker.port, startup_seconds=sgl_worker.startup_seconds,
           health_503_before_ready=not_ready)


def test_b_chat(sgl_worker, record):
    resp = _post_json(sgl_worker, "/v1/chat/completions",
                      {{"model": "tiny", "messages": [{{"role": "user", "content": "hello"}}], "max_tokens": 8}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    record(pid=sgl_worker.pid)


def test_c_chat_stream(sgl_worker, record):
    payload = {{"model": "tiny", "messages": [{{"role": "user", "content": "hello"}}], "max_tokens": 8,
               "stream": True}}
    with sgl_worker.client.stream("POST", "/v1/chat/completions", content=json.dumps(payload),
                                  headers={{"Content-Type": "application/json"}}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in events[:-1]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    record(pid=sgl_worker.pid, chunks=len(chunks))


def test_d_argv_accepted(sgl_worker, record):
    # The real engine runs the very argv the plugin built, and parsed it as meant.
    root = psutil.Process(sgl_worker.pid)
    assert root.cmdline() == sgl_worker.argv
    info = sgl_worker.client.get("/server_info").json()
    assert info["port"] == sgl_worker.port and info["host"] == "127.0.0.1"
    assert info["device"] == "cpu" and info["attention_backend"] == "torch_native"
    assert info["mem_fraction_static"] == 0.6
    assert info["max_total_num_tokens"] == 1024
    assert info["model_path"] == sgl_worker.spec.model
    # The CPU recipe's --sleep-on-idle: the engine between tests waits on its sockets instead of polling them
    # in a busy loop (without it an idle tiny engine used 77-102 % of a core; with it about 2 %).
    assert info["sleep_on_idle"] is True
    procs = [root, *root.children(recursive=True)]
    before = sum(sum(p.cpu_times()[:2]) for p in procs)
    window = 2.0
    time.sleep(window)  # a measuring window, not a wait for an event: the engine is idle throughout it
    idle_cpu = (sum(sum(p.cpu_times()[:2]) for p in procs) - before) / window
    assert idle_cpu < 0.25, f"an idle engine used {{idle_cpu:.0%}} of a core"
    record(pid=sgl_worker.pid, argv=sgl_worker.argv, nccl_port=info.get("nccl_port"),
           version=info.get("version"), idle_cpu=round(idle_cpu, 3))


def test_e_log_file(sgl_worker, record):
    # The per-port log holds the real engine's whole output, readable while it runs.
    path = sgl_worker.log_path
    assert path.name == f"sglang-worker-{{sgl_worker.port}}.log" and sgl_worker.is_alive()
    log = path.read_text(errors="replace")
    wanted = ["Load weight begin", "Load weight end", "KV Cache is allocated",
              "max_total_num_tokens=1024", f"Uvicorn running on http://127.0.0.1:{{sgl_worker.port}}",
              "The server is fired up and ready to roll!"]
    where = {{w: log.find(w) for w in wanted}}
    assert all(pos >= 0 for pos in where.values()), where
    assert list(where.values()) == sorted(where.values()), "startup lines out of order"
    assert log_lines.parse_kv_tokens(log) == 1024
    assert diagnosis.diagnose(log).kind is diagnosis.Kind.NONE  # its noise is not an error
    # The phases the plugin's status line shows, replayed over the real log, line by line.
    phases = []
    lines = log.splitlines()
    for i in range(1, len(lines) + 1):
        phase = log_lines.startup_phase("\\n".join(lines[:i]))
        if phase and (not phases or phases[-1] != phase):
            phases.append(phase)
    # The log grows while the worker serves: this test's own request is in it a moment later.
    size = path.stat().st_size
    sgl_worker.client.get("/model_info")
    deadline = time.monotonic() + 10
    while path.stat().st_size == size and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.stat().st_size > size
    assert '"GET /model_info HTTP/1.1" 200' in path.read_text(errors="replace")[size:]
    tree = _tree(sgl_worker.pid)
    # Whether each process's environment still shows the worker marker (setproctitle overwrites it).
    marker_visible = {{}}
    for p in tree:
        try:
            marker_visible[p["name"]] = OWNER_ENV in psutil.Process(p["pid"]).environ()
        except psutil.Error:
            marker_visible[p["name"]] = None
    record(pid=sgl_worker.pid, log_path=str(path), phases=phases,
           kv_line=next(line for line in lines if "KV Cache is allocated" in line),
           tree=tree, pids_seen=sorted(sgl_worker.pids_seen), marker_visible=marker_visible)


def test_f_fails_on_purpose(sgl_worker, record):
    record(pid=sgl_worker.pid)
    assert sgl_worker.client.get("/health_generate").status_code == 200
    assert False, "deliberate failure on a healthy pooled worker"


def test_g_reused_after_failure(sgl_worker, record):
    # A failed test does not retire a healthy worker: the next test gets the same one.
    assert sgl_worker.client.get("/health_generate").status_code == 200
    record(pid=sgl_worker.pid)


def test_h_startup_failure(sgl_spawn_worker, record):
    start = time.monotonic()
    try:
        sgl_spawn_worker("tiny-missing")
    finally:
        record(seconds=time.monotonic() - start)


def _ours(roots):
    """Processes of this session's workers still alive: by the worker marker, by session id (sglang's
    renamed children lost their environment), by command line."""
    found = {{}}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or ())
            owner = proc.environ().get(OWNER_ENV, "")
            if (owner.startswith(SESSION_ID + ":") or os.getsid(proc.pid) in roots or MISSING in cmdline
                    or proc.pid in roots):
                found[proc.pid] = f"{{proc.info['name']}}: {{cmdline}}"
        except (psutil.Error, OSError):
            continue
    return found


def test_i_nothing_left(observations, record):
    # Runs after the good worker was retired (its last test ran) and after the failed
    # launch: both teardowns are complete before the session ends.
    tree = next(o["tree"] for o in observations if o["test"] == "test_e_log_file")
    roots = {{tree[0]["pid"]}}
    gone = {{}}
    for p in tree:
        try:
            proc = psutil.Process(p["pid"])
            alive = proc.create_time() == p["create_time"] and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        gone[p["name"]] = not alive
    left = _ours(roots)
    record(gone=gone, left=left)
    assert all(gone.values()), gone
    assert not left, left
'''


@dataclass
class InnerRun:
    """What the shared inner session left behind."""

    ret: int
    stdout: str
    lines: list[str]
    seconds: float
    report: dict[str, Any]
    obs: list[dict[str, Any]]
    log_dir: Path
    missing: Path
    leftovers: dict[int, str] = field(default_factory=dict)
    recorded_alive: dict[int, str] = field(default_factory=dict)

    def seen(self, test: str) -> list[dict[str, Any]]:
        return [o for o in self.obs if o["test"] == test]

    def one(self, test: str) -> dict[str, Any]:
        found = self.seen(test)
        assert found, f"the inner test {test} recorded nothing; inner output:\n{self.stdout[-6000:]}"
        return found[-1]

    def outcome(self, test: str) -> str | None:
        pattern = re.compile(rf"::{re.escape(test)}(?:\[[^\]]*\])? (PASSED|FAILED|ERROR|SKIPPED)")
        for line in self.lines:
            m = pattern.search(line)
            if m:
                return m.group(1)
        return None

    def section(self, title: str) -> str:
        """The text of the inner failure section whose header line contains ``title``."""
        start = next((i for i, line in enumerate(self.lines) if title in line and line.startswith("_")), None)
        assert start is not None, f"no failure section {title!r} in the inner output:\n{self.stdout[-6000:]}"
        end = next((i for i in range(start + 1, len(self.lines)) if self.lines[i].startswith(("_", "="))),
                   len(self.lines))
        return "\n".join(self.lines[start:end])


_RUN_KEY = pytest.StashKey[Any]()


def _marked(mark: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARK) == mark:
                found[proc.pid] = " ".join(proc.info["cmdline"] or ()) or proc.info["name"]
        except (psutil.Error, OSError):
            continue
    return found


def _sglang_leftovers(mark: str, roots: Iterable[int], since: float, needles: Iterable[str]) -> dict[int, str]:
    """Processes of the run still alive: carrying the test's mark, in the session of a worker root (the
    renamed children), or named/commanded 'sglang' and started during the run by a session leader that is
    gone or ours (an orphan). A concurrent, unrelated sglang server on the machine is not counted."""
    roots = set(roots)
    needles = [n for n in needles if n]
    found: dict[int, str] = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status", "create_time"]):
        try:
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            name = proc.info["name"] or ""
            cmdline = " ".join(proc.info["cmdline"] or ())
            desc = f"{name}: {cmdline}".strip()
            if proc.environ().get(MARK) == mark or any(n in cmdline for n in needles):
                found[proc.pid] = desc
                continue
            if "sglang" not in name and "sglang" not in cmdline:
                continue
            sid = os.getsid(proc.pid)
            if sid in roots or proc.pid in roots:
                found[proc.pid] = desc
                continue
            if proc.info["create_time"] >= since:
                try:
                    leader_ours = psutil.Process(sid).environ().get(MARK) == mark
                except psutil.NoSuchProcess:
                    leader_ours = True  # an orphan of a session that is gone
                if leader_ours:
                    found[proc.pid] = desc
        except (psutil.Error, OSError):
            continue
    return found


def _wait_empty(check: Any, timeout: float = 15.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        left = check()
        if not left or time.monotonic() >= deadline:
            return dict(left)
        time.sleep(0.2)


def _run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, python: Path, model: Path) -> InnerRun:
    base = pytester.path
    log_dir, obs, report, missing = base / "logs", base / "obs.jsonl", base / "report.json", base / "no-such-model"
    pytester.makeconftest(INNER_CONFTEST.format(model=str(model), missing=str(missing), obs=str(obs)))
    pytester.makepyfile(test_inner=INNER_TESTS.format())
    for key, value in {"SGLWORKER_LOG_DIR": str(log_dir), "SGLWORKER_LOCK_DIR": str(base / "locks")}.items():
        monkeypatch.setenv(key, value)
    for key in ("SGLWORKER_MODELS", "SGLWORKER_ENGINE", "SGLWORKER_LAUNCHER", "SGLWORKER_REUSE",
                "SGLWORKER_KEEP_LOGS", "SGLWORKER_GPUS", "SGLWORKER_REPORT"):
        monkeypatch.delenv(key, raising=False)
    launcher = shlex.join(real_engine_launcher(python))
    since = time.time()
    start = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-v", "-p", "no:cacheprovider", "--sgl-model", "tiny-cpu", "--sgl-launcher", launcher,
        "--sgl-gpus", "sim:1", "--sgl-startup-timeout", str(STARTUP_TIMEOUT), "--sgl-report", str(report),
        timeout=3 * STARTUP_TIMEOUT,
    )
    seconds = time.monotonic() - start
    lines = result.outlines + result.errlines
    run = InnerRun(
        ret=int(result.ret), stdout="\n".join(lines), lines=lines, seconds=seconds,
        report=json.loads(report.read_text()) if report.is_file() else {},
        obs=[json.loads(line) for line in obs.read_text().splitlines()] if obs.is_file() else [],
        log_dir=log_dir, missing=missing,
    )
    # Every root the run had: the good worker (recorded by the inner tests) and the failed one (named in
    # its failure message). Checked now, before anything else could start processes under this mark.
    tree: list[dict[str, Any]] = next((o["tree"] for o in run.obs if "tree" in o), [])
    failed_roots = re.findall(r"tiny-missing on [\d.:]+ \(pid (\d+)", run.stdout)
    roots = {p["pid"] for p in tree[:1]} | {int(pid) for pid in failed_roots}
    mark = os.environ[MARK]
    run.leftovers = _wait_empty(lambda: _sglang_leftovers(mark, roots, since, [str(missing), str(model)]))
    run.recorded_alive = _wait_empty(lambda: {
        p["pid"]: p["name"] for p in tree if _alive_as_recorded(p["pid"], p["create_time"])
    })
    return run


def _alive_as_recorded(pid: int, create_time: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == create_time and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def real_run(request: pytest.FixtureRequest, real_python: Path, tiny_model: Path) -> InnerRun:
    """The shared inner session, run by the first outer test that needs it (its outcome, a failure
    included, is cached for the others: the tier never launches twice)."""
    cached = request.config.stash.get(_RUN_KEY, None)
    if cached is None:
        pytester = request.getfixturevalue("pytester")
        try:
            cached = _run_inner(pytester, request.getfixturevalue("monkeypatch"), real_python, tiny_model)
        except Exception as exc:  # cache the failure too: the others must not launch again
            cached = exc
        request.config.stash[_RUN_KEY] = cached
    if isinstance(cached, Exception):
        pytest.fail(f"the shared real-engine inner session could not run: {cached!r}")
    return cached


# ------------------------------------------------------------------------------------------------ tests


def test_pooled_real_worker_serves_generate_and_chat(real_run: InnerRun) -> None:
    """1. The fixture returns the worker only when the real engine is healthy; /generate and chat (plain and
    streaming) work through it; seven tests share one launch."""
    for test in ("test_a_ready_and_generate", "test_b_chat", "test_c_chat_stream", "test_g_reused_after_failure"):
        assert real_run.outcome(test) == "PASSED", f"{test}: {real_run.outcome(test)}\n{real_run.stdout[-8000:]}"
    pids = {o["pid"] for o in real_run.obs if "pid" in o}
    assert len(pids) == 1, f"the pooled tests did not share one worker: {pids}"
    assert real_run.one("test_c_chat_stream")["chunks"] >= 1
    stats = real_run.report["workers"]["tiny-cpu"]
    assert (stats["launches"], stats["reuses"], stats["failures"], stats["deaths"]) == (1, POOLED_TESTS - 1, 0, 0)
    assert any(re.search(rf"^tiny-cpu: 1 launched, {POOLED_TESTS - 1} reused, startup min/median/max [\d.]+/", line)
               for line in real_run.lines), real_run.stdout[-3000:]
    assert "failed with the real engine" not in real_run.stdout


def test_plugin_argv_is_accepted_by_the_real_engine(real_run: InnerRun, real_python: Path, tiny_model: Path) -> None:
    """2. The argv the plugin builds starts the real engine, which parses it as meant (the parser check of
    every built-in spec's argv is in test_engine_args.py)."""
    assert real_run.outcome("test_d_argv_accepted") == "PASSED", real_run.stdout[-8000:]
    argv = real_run.one("test_d_argv_accepted")["argv"]
    assert argv[:3] == [str(real_python), "-m", "sglang.launch_server"]
    assert argv[3:5] == ["--model-path", str(tiny_model)] and "--nccl-port" in argv
    assert {"--mem-fraction-static=0.6", "--cuda-graph-backend-prefill=disabled", "--device"} <= set(argv)
    # The session checked the same flags with the engine's own parser before launching anything.
    assert any(re.search(r"worker flags checked by sglang [\d.]+'s own parser", line) for line in real_run.lines), (
        "\n".join(real_run.lines[:10]))


def test_teardown_leaves_no_sglang_process(real_run: InnerRun) -> None:
    """3. No sglang::scheduler, sglang::detokenizer or other child survives: the worker that served passing
    tests and a failing one (torn down mid-session), nor the launch that failed."""
    tree = real_run.one("test_e_log_file")["tree"]
    names = [p["name"] for p in tree]
    assert "sglang::scheduler" in names and "sglang::detokenizer" in names, names
    # The renamed children are in the root's session (start_new_session), whatever their environment says,
    # and the plugin knew them (from the process tree) before any teardown.
    assert {p["sid"] for p in tree} == {tree[0]["pid"]}, tree
    assert {p["pid"] for p in tree} <= set(real_run.one("test_e_log_file")["pids_seen"])
    assert real_run.ret == pytest.ExitCode.TESTS_FAILED, real_run.stdout[-4000:]  # no internal error, no crash
    assert real_run.outcome("test_f_fails_on_purpose") == "FAILED"
    assert real_run.outcome("test_h_startup_failure") == "FAILED"
    # The served worker is torn down mid-session: retired after the last test of its configuration (test_g),
    # or evicted for test_h's lease if it were still pooled; test_i checks that nothing of it is left.
    assert real_run.outcome("test_i_nothing_left") == "PASSED", real_run.one("test_i_nothing_left")
    assert not real_run.recorded_alive, f"worker processes alive after the session: {real_run.recorded_alive}"
    assert not real_run.leftovers, f"processes left after the session: {real_run.leftovers}"


def test_real_startup_failure_is_fast_and_diagnosed(real_run: InnerRun) -> None:
    """4. A missing model directory is reported well before the startup timeout, with sglang's own traceback
    in the tail and the plugin's diagnosis."""
    text = real_run.section("test_h_startup_failure")
    # Either the process exited (its code is the launcher's own uncaught exception's, 1) or, on a machine too loaded
    # for sglang to end its children within the plugin's grace, it was seen logging its fatal error and not exiting:
    # both are the crash, told when it happened; which one depends on how fast the engine ends, not on the plugin.
    m = re.search(r"worker tiny-missing: the model could not be found.* — (?:exited during startup with code "
                  r"(?P<code>-?\d+) after [\d.]+ s|logged a fatal error during startup and did not exit within "
                  r"[\d.]+ s \(after [\d.]+ s\)) \(on 127\.0\.0\.1:\d+, pid \d+(?:, GPUs \w+)?\)", text)
    assert m, text
    # One failure text, its headline once, within the goals of every failure text.
    assert text.count(" during startup ") == 1, "the failure is reported more than once"
    check_goals("the real engine's startup crash", text.strip("\n"), "the model could not be found")
    assert m["code"] is None or int(m["code"]) == 1  # the launcher's own uncaught exception
    # well before the startup timeout: the headline is the exit ("exited during startup", matched above), seen
    # when it happened, never "did not become healthy within" the timeout
    assert "did not become healthy within" not in text
    assert re.search(r"first error \(log line \d+\): .*HFValidationError", text), text
    assert str(real_run.missing) in text
    # sglang's own traceback, its frames in sglang's package (the outermost ones, runpy to launch_server, fold)
    assert "Traceback (most recent call last):" in text and "site-packages/sglang/srt/" in text, text
    stats = real_run.report["workers"]["tiny-missing"]
    assert (stats["launches"], stats["failures"]) == (0, 1)


def test_kv_line_and_phases_reach_the_report(real_run: InnerRun) -> None:
    """5. The startup phases and the KV line the plugin reads are the real engine's."""
    assert real_run.outcome("test_e_log_file") == "PASSED", real_run.stdout[-8000:]
    seen = real_run.one("test_e_log_file")
    assert "#tokens: 1024" in seen["kv_line"]
    assert seen["phases"] == ["loading weights", "allocating KV pool", "starting HTTP server", "warming up",
                              "ready"], seen["phases"]
    stats = real_run.report["workers"]["tiny-cpu"]
    assert stats["kv_tokens"]["actual"] == 1024
    assert len(stats["startup_seconds"]["samples"]) == 1
    assert any(re.search(r"^tiny-cpu: .*KV #tokens 1024\b", line) for line in real_run.lines), real_run.stdout[-3000:]
    waiting = [line for line in real_run.lines if re.search(r"\[sglworker\] \d+ s .*: worker tiny-cpu", line)]
    assert waiting, "no status line while the real engine started"
    known = {"starting", "loading weights", "allocating KV pool", "starting HTTP server", "warming up", "ready"}
    phases = [re.search(r"\] \d+ s ([\w ]+): worker", line) for line in waiting]
    assert all(m is not None and m.group(1) in known for m in phases), waiting


def test_log_file_holds_the_real_output_and_failed_logs_are_kept(real_run: InnerRun) -> None:
    """6. The log per port is the real engine's whole output, readable while it runs; the logs of the
    worker that served a failing test and of the failed launch are kept, and listed."""
    assert real_run.outcome("test_e_log_file") == "PASSED", real_run.stdout[-8000:]
    good = Path(real_run.one("test_e_log_file")["log_path"])
    kept = [line.split("log kept: ", 1)[1].split(" (kept ", 1)[0] for line in real_run.lines if "log kept: " in line]
    assert str(good) in kept, kept
    bad = [Path(p) for p in kept if p != str(good)]
    assert len(bad) == 1 and bad[0].parent == real_run.log_dir, kept
    text = good.read_text(errors="replace")
    assert "Load weight end" in text and "SIGTERM received" in text  # the whole life, shutdown included
    failed = bad[0].read_text(errors="replace")
    assert "HFValidationError" in failed and str(real_run.missing) in failed
    # The tainted worker's section in the deliberate failure's report carries the real log's tail.
    section = real_run.section("test_f_fails_on_purpose")
    assert "deliberate failure on a healthy pooled worker" in section
    assert re.search(r"sglang worker tiny-cpu 127\.0\.0\.1:\d+", section), section
    assert f"log: {good}" in section
