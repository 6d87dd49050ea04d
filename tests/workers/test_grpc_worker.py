"""gRPC workers (``--grpc-mode``): the kind, its readiness over gRPC, the simulated engine's gRPC service, the
real router's gRPC mode in front of them, the missing-package paths, and (``real_engine`` tier) the real sglang
``--grpc-mode`` on the CPU behind the real router.

The sim tests run inner pytest sessions (``pytester.runpytest_subprocess``) with ``--sgl-engine sim``; they
need the gRPC packages here (``pip install 'pytest-sglworker[grpc]'``) and are skipped with that command
otherwise. The router tests also need the router and its offline vocab (``scripts/install-router-vocab.sh``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from pytest_sglworker.engine.grpc_facts import (
    INSTALL_HINT,
    ROUTER_VOCAB_HINT,
    grpc_missing_reason,
    missing_grpc_packages,
    router_vocab_dir,
    wants_grpc,
)
from pytest_sglworker.engine.specs import CI_WORKER_ARGS, ModelSpec
from pytest_sglworker.workers.config import WorkerConfig, default_kind
from pytest_sglworker.workers.grpc_worker import GrpcHealth, GrpcUnavailable, GrpcWorker
from pytest_sglworker.workers.kinds import HttpWorker

needs_grpc = pytest.mark.skipif(bool(missing_grpc_packages()), reason=f"the gRPC packages are missing: {INSTALL_HINT}")
needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None or router_vocab_dir() is None,
    reason="the sglang router's gRPC mode needs the router (pip install 'pytest-sglworker[router]') and its "
           f"offline o200k_base.tiktoken ({ROUTER_VOCAB_HINT})")

pytestmark = [pytest.mark.grpc]

TINY = str(Path(__file__).resolve().parents[1] / "data" / "sim" / "tiny-llama")
SIM = ["--sgl-engine", "sim", "-p", "no:cacheprovider"]
#: Specs of the inner sessions: a plain sim spec, the tiny Llama (its tokenizer serves the router) as a gRPC
#: spec (its vocab of 512 is below the servicer's warmup ids: --skip-server-warmup, as for the real engine),
#: and the same model over HTTP.
CONFTEST = f"""
from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

TINY = {TINY!r}

def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec(name="qwen-grpc", model="Qwen/Qwen3-0.6B", memory_gb=4,
                           worker_args=(*CI_WORKER_ARGS, "--grpc-mode")))
    registry.add(ModelSpec(name="tiny-grpc", model=TINY, memory_gb=1, features=frozenset({{"chat"}}),
                           worker_args=(*CI_WORKER_ARGS, "--grpc-mode", "--skip-server-warmup")))
    registry.add(ModelSpec(name="tiny-http", model=TINY, memory_gb=1, features=frozenset({{"chat"}}),
                           worker_args=tuple(CI_WORKER_ARGS)))
"""


def _run(pytester: pytest.Pytester, *args: str, timeout: float = 120) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    return pytester.runpytest_subprocess(*SIM, *args, timeout=timeout)


# ------------------------------------------------------------------------------------------------ the kind


def test_grpc_mode_selects_the_grpc_kind_from_a_spec_or_the_args() -> None:
    assert wants_grpc(["--grpc-mode"]) and wants_grpc(["--smg-grpc-mode"]) and wants_grpc(["--grpc-m"])
    assert not wants_grpc(["--grpc-port", "4000"]) and not wants_grpc([])
    assert isinstance(default_kind("worker", ["--grpc-mode"]), GrpcWorker)
    assert isinstance(default_kind("worker", []), HttpWorker)
    spec = ModelSpec(name="g", model="Qwen/Qwen3-0.6B", memory_gb=4, worker_args=(*CI_WORKER_ARGS, "--grpc-mode"))
    (member,) = WorkerConfig.of(spec).members()
    assert isinstance(member.kind, GrpcWorker) and member.extra_args == ()
    plain = ModelSpec(name="h", model="Qwen/Qwen3-0.6B", memory_gb=4, worker_args=tuple(CI_WORKER_ARGS))
    (member,) = WorkerConfig.of(plain, ["--grpc-mode"]).members()
    assert isinstance(member.kind, GrpcWorker) and member.extra_args == ("--grpc-mode",)
    kind = GrpcWorker()
    assert kind.url("127.0.0.1", 20004) == "grpc://127.0.0.1:20004"
    assert kind.port_names == ("grpc", "nccl", "sidecar")
    assert kind.role_args({"grpc": 20004, "nccl": 20005, "sidecar": 20006}) == [
        "--grpc-mode", "--smg-http-sidecar-port", "20006"]
    # the legacy mode derives grpc_port = port + 10000 and refuses one above 65535
    assert kind.role_args({"grpc": 60000, "nccl": 60001, "sidecar": 60002})[-2:] == ["--grpc-port", "60000"]
    assert isinstance(kind.readiness(), GrpcHealth)


def test_without_the_packages_a_launch_says_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "grpc", None)  # find_spec then finds nothing
    assert missing_grpc_packages()[0] == "grpcio"
    assert INSTALL_HINT in grpc_missing_reason()
    spec = ModelSpec(name="g", model="Qwen/Qwen3-0.6B", memory_gb=4, worker_args=(*CI_WORKER_ARGS, "--grpc-mode"))
    with pytest.raises(GrpcUnavailable, match=r"worker g \(--grpc-mode\) needs grpcio.*pytest-sglworker\[grpc\]"):
        GrpcWorker().check_available(spec)


def test_the_sim_without_the_packages_exits_with_one_line() -> None:
    code = ("import sys; sys.modules['grpc'] = None; from pytest_sglworker.sim.main import main; "
            "sys.exit(main(['--model-path', 'Qwen/Qwen3-0.6B', '--grpc-mode']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--grpc-mode needs grpcio" in lines[0] and INSTALL_HINT in lines[0], proc.stderr


# ------------------------------------------------------------------------------------------------ readiness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Target:
    """What the wait needs of a process, around a sim started by hand."""

    host: str
    port: int
    process: subprocess.Popen[bytes]
    ours: bool = True
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    ready_probe_seconds: float = 0.0
    log_path: Path = Path(os.devnull)

    def owns_port(self) -> bool:
        return self.ours

    def failure(self, kind: Any, event: str, *, alive: bool = False) -> Any:
        return kind(event)

    def fatal_in_log(self) -> bool:
        return False


@needs_grpc
def test_grpc_health_probe_not_listening_warming_up_serving_and_stale(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "SGLSIM_STARTUP_SECONDS": "0.1", "SGLSIM_WARMUP_SECONDS": "1.5"}
    log = open(tmp_path / "sim.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pytest_sglworker.sim", "--model-path", "Qwen/Qwen3-0.6B",
                             "--host", "127.0.0.1", "--port", str(port), *CI_WORKER_ARGS, "--grpc-mode"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        target = _Target("127.0.0.1", port, proc)
        health = GrpcHealth()
        alive = lambda: proc.poll() is not None  # noqa: E731
        first = health.probe(target, time.monotonic() + 5, alive)
        assert not first.ready and not first.listening and "not listening yet" in first.status
        deadline = time.monotonic() + 30
        seen = set()
        while True:
            probe = health.probe(target, time.monotonic() + 5, alive)
            seen.add(probe.status)
            if probe.ready or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert probe.ready, seen
        assert probe.status == "Health/Check sglang.grpc.scheduler.SglangScheduler: SERVING"
        assert "Health/Check sglang.grpc.scheduler.SglangScheduler: NOT_SERVING" in seen  # during the warmup
        target.ours = False
        stale = health.probe(target, time.monotonic() + 5, alive)
        assert not stale.ready and stale.stale and "not this worker" in stale.status
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()
    text = (tmp_path / "sim.log").read_text()
    assert "gRPC server listening on 127.0.0.1:" in text and "Shutting down gRPC server" in text


# ------------------------------------------------------------------------------------------------ the plugin


@needs_grpc
def test_a_grpc_sim_worker_is_ready_over_grpc(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pytest_sglworker.engine.grpc_facts import SCHEDULER_SERVICE
from pytest_sglworker.workers.grpc_worker import GrpcWorker


def http_status(port, path):
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.sgl_worker(args=["--grpc-mode"], env={"SGLSIM_WARMUP_SECONDS": "0.5"})
def test_ready_over_grpc(sgl_worker):
    w = sgl_worker
    assert isinstance(w.kind, GrpcWorker)
    assert w.url == f"grpc://127.0.0.1:{w.port}"
    assert w.ports == {"grpc": w.port, "nccl": w.port + 1, "sidecar": w.port + 2}  # pinned from its block
    assert w.argv[w.argv.index("--smg-http-sidecar-port") + 1] == str(w.ports["sidecar"])
    log = w.log_text()
    listening = log.index(f"gRPC server listening on 127.0.0.1:{w.port}")
    assert log.index("Health service status set to SERVING") > listening  # after the 0.5 s warmup
    assert "The server is fired up and ready to roll!" in log
    assert f"HTTP sidecar server started on http://127.0.0.1:{w.ports['sidecar']}" in log
    # nothing serves HTTP health here (the sidecar has no /health): the readiness was proven over gRPC
    assert http_status(w.ports["sidecar"], "/health") == 404
    assert http_status(w.ports["sidecar"], "/health_generate") == 404
    with grpc.insecure_channel(f"127.0.0.1:{w.port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert w.responds(timeout=5)


@pytest.mark.sgl_worker(args=["--grpc-mode"], env={"SGLSIM_WARMUP_SECONDS": "0.5"})
def test_reused_after_a_grpc_probe(sgl_worker):
    assert sgl_worker.url.startswith("grpc://127.0.0.1:")


def test_a_spec_with_grpc_mode(sgl_spawn_worker):
    w = sgl_spawn_worker("qwen-grpc")
    assert isinstance(w.kind, GrpcWorker) and w.url == f"grpc://127.0.0.1:{w.port}"
""")
    result = _run(pytester, "--sgl-model", "qwen3-0.6b", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*qwen3-0.6b --grpc-mode env SGLSIM_WARMUP_SECONDS=0.5: 1 launched, 1 reused*"])


@needs_grpc
def test_a_grpc_worker_that_crashes_at_startup_gets_the_same_report(pytester: pytest.Pytester,
                                                                    sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
import pytest

@pytest.mark.sgl_worker(args=["--grpc-mode"], env={"SGLSIM_FAULT": "crash_oom"})
def test_oom(sgl_worker):
    raise AssertionError("never reached")

def test_warmup_ids_beyond_the_vocab(sgl_spawn_worker):
    sgl_spawn_worker("tiny-http", args=["--grpc-mode"])  # no --skip-server-warmup: as the real servicer
""")
    result = _run(pytester, "--sgl-model", "qwen3-0.6b", "--sgl-startup-timeout", "300", "-rA")
    result.assert_outcomes(errors=1, failed=1)
    # failing fast: the failure is the exit when it happened (below), not the 300 s startup timeout running out
    assert "did not become healthy within" not in result.stdout.str()
    result.stdout.fnmatch_lines([
        "*worker qwen3-0.6b: CUDA out of memory while capturing the prefill CUDA graph — exited during startup "
        "with code -9 (SIGKILL) after * s (on 127.0.0.1:*",
        "*memory ledger (predicted for this GPU):*",
        "*argv: *--grpc-mode --grpc-mode --smg-http-sidecar-port*",
        "*log: *sglang-worker-*.log",
        "*last lines of the log*:",
    ])
    result.stdout.fnmatch_lines([
        "*worker tiny-http: * — exited during startup with code -9 (SIGKILL)*",
        "*IndexError: index out of range in self*",
    ])
    result.stdout.fnmatch_lines(["*log kept: *sglang-worker-*.log (kept 7 days, until *)"])


@needs_grpc
@needs_router
def test_the_real_router_routes_generate_and_chat_to_grpc_workers(pytester: pytest.Pytester,
                                                                  sim_env: dict[str, str]) -> None:
    pytester.makepyfile(f"""
import pytest

TINY = {TINY!r}


def served_by(workers):
    return [w.log_text().count("Receive generation request: ") for w in workers]


@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(policy="round_robin")
def test_generate_and_chat(sgl_router, sgl_workers):
    assert all(url.startswith("grpc://127.0.0.1:") for url in sgl_workers.urls)
    listed = sgl_router.workers()
    assert {{w["url"] for w in listed}} == set(sgl_workers.urls)
    assert {{w["connection_mode"] for w in listed}} == {{"gRPC"}} and all(w["is_healthy"] for w in listed)
    # it started at all: it was given its Harmony vocab (without it, and offline, it panics at startup)
    from pytest_sglworker.workers.router import router_env
    assert list(router_env(sgl_workers)) == ["TIKTOKEN_ENCODINGS_BASE"]
    before = served_by(sgl_workers)
    # gRPC mode: the router tokenizes with the worker's tokenizer (GetModelInfo's tokenizer_path) and routes
    # /generate only with the model named in the body
    resp = sgl_router.client.post("/generate", json={{"model": TINY, "text": "Hello world",
                                                      "sampling_params": {{"max_new_tokens": 4}}}}, timeout=30)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    out = out[0] if isinstance(out, list) else out
    assert out["meta_info"]["completion_tokens"] == 4 and out["meta_info"]["finish_reason"]["type"] == "length"
    chat = {{"model": TINY, "messages": [{{"role": "user", "content": "hello world"}}], "max_tokens": 6}}
    for i in range(3):
        resp = sgl_router.client.post("/v1/chat/completions", json=chat, timeout=30)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
    text = body["choices"][0]["message"]["content"]
    assert "hello world" in text  # the sim echoes the prompt's tokens, decoded by the router's tokenizer
    with sgl_router.client.stream("POST", "/v1/chat/completions", json={{**chat, "stream": True}},
                                  timeout=30) as stream:
        assert stream.status_code == 200
        chunks = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    import json
    deltas = [json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]
              if json.loads(c)["choices"]]
    assert "".join(deltas) == text
    served = [a - b for a, b in zip(served_by(sgl_workers), before)]
    assert sorted(served) == [2, 3], served  # round robin over the two gRPC workers


@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(policy="round_robin")
def test_one_http_worker_beside_a_grpc_one(sgl_router, sgl_workers, sgl_spawn_worker):
    http = sgl_spawn_worker("tiny-http")
    assert http.url.startswith("http://")
    sgl_router.add_worker(http.url)
    listed = {{w["url"]: w for w in sgl_router.wait_for_workers(2)}}
    assert listed[http.url]["connection_mode"] == "HTTP"
    assert listed[sgl_workers.urls[0]]["connection_mode"] == "gRPC"
    before = served_by(sgl_workers)[0]
    chat = {{"model": TINY, "messages": [{{"role": "user", "content": "mixed"}}], "max_tokens": 2}}
    for _ in range(4):
        assert sgl_router.client.post("/v1/chat/completions", json=chat, timeout=30).status_code == 200
    # sglang-router 0.3.2 accepts and health-checks the HTTP worker, but its single router is the gRPC one:
    # every request goes to the gRPC worker
    assert served_by(sgl_workers)[0] - before == 4
    assert http.log_text().count("POST /v1/chat/completions") == 0


REGEX = "(yes|no)-[a-z]{{3,8}}-[0-9]{{2}}"


@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(policy="round_robin")
def test_a_regex_reaches_the_grpc_worker(sgl_router, sgl_workers):
    # the router sends sglang's `regex` extra as the proto's constraint; the worker's output follows it
    import re
    chat = {{"model": TINY, "messages": [{{"role": "user", "content": "a json"}}], "max_tokens": 64, "regex": REGEX}}
    resp = sgl_router.client.post("/v1/chat/completions", json=chat, timeout=30)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert re.fullmatch(REGEX, choice["message"]["content"]), choice
    assert choice["finish_reason"] == "stop"
    # a regex that does not compile: the worker ends the stream with INVALID_ARGUMENT and sglang's message, which
    # sglang-router 0.3.2 answers as its 500 start_generation_failed, the worker's message kept
    bad = sgl_router.client.post("/v1/chat/completions", json={{**chat, "regex": "(unclosed"}}, timeout=30)
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "start_generation_failed", bad.text
    assert "Client specified an invalid argument" in bad.text and "Failed to compile regex grammar" in bad.text


@pytest.mark.sgl_workers(count=1, args=["--is-embedding"])
@pytest.mark.sgl_router(policy="round_robin")
def test_embeddings_over_grpc_are_the_routers_no_response(sgl_router, sgl_workers):
    # sglang-router 0.3.2 reads EmbedResponse as the old oneof (complete = 2, error = 3); the servicer 0.14.1 (and
    # the sim) send the flat fields 4-6: the router finds no answer. The real engine gives the same 500.
    resp = sgl_router.client.post("/v1/embeddings", json={{"model": TINY, "input": "hello"}}, timeout=30)
    assert resp.status_code == 500, resp.text
    assert resp.json()["error"]["code"] == "embedding_no_response", resp.text
    assert "Receive embedding request: " in sgl_workers[0].log_text()  # the worker was asked and answered
""")
    result = _run(pytester, "--sgl-model", "tiny-grpc", "--sgl-gpus", "sim:3", "-v")
    result.assert_outcomes(passed=4)


@needs_grpc
def test_a_missing_grpc_package_skips_a_marker_and_refuses_a_selected_spec(pytester: pytest.Pytester,
                                                                          sim_env: dict[str, str]) -> None:
    pytester.makepyfile(test_marker="""
import sys

import pytest

sys.modules["grpc_health"] = None  # as if grpcio-health-checking were not installed

@pytest.mark.sgl_worker(args=["--grpc-mode"])
def test_grpc(sgl_worker):
    raise AssertionError("never reached")

def test_http(sgl_worker):
    assert sgl_worker.url.startswith("http://")
""")
    result = _run(pytester, "--sgl-model", "qwen3-0.6b", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    skipped = [line for line in result.stdout.lines if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "a gRPC worker (--grpc-mode) needs grpcio-health-checking, missing for " in \
        skipped[0] and skipped[0].endswith(INSTALL_HINT), skipped
    result = _run(pytester, "--sgl-model", "qwen-grpc", "-rs")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    error = result.stderr.str()
    assert "model spec 'qwen-grpc' runs --grpc-mode (its worker_args): a gRPC worker (--grpc-mode) needs " \
        "grpcio-health-checking, missing for " in error and INSTALL_HINT in error, error


# ------------------------------------------------------------------------------------------------ real engine


@pytest.fixture(scope="module")
def real_grpc_python() -> Path:
    from pytest_sglworker.engine.cpu_engine import real_engine_missing_reason, real_engine_python

    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    probe = subprocess.run([str(python), "-c", "import smg_grpc_servicer, smg_grpc_proto"], capture_output=True,
                           timeout=60)
    if probe.returncode != 0:
        pytest.skip("the real engine's venv lacks smg-grpc-servicer (sglang's --grpc-mode): rerun "
                    "'sglworker install-real-engine'")
    return python


@pytest.mark.real_engine
@pytest.mark.slow  # a second real engine startup (about 80 s on 2 CPUs): -m real_engine or -m slow selects it
@needs_grpc
@needs_router
def test_real_sglang_grpc_mode_behind_the_real_router(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                      real_grpc_python: Path,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    from pytest_sglworker.engine.cpu_engine import build_tiny_model, real_engine_launcher

    model = build_tiny_model(real_grpc_python, tmp_path_factory.mktemp("real-grpc") / "tiny-model")
    pids = pytester.path / "pids.json"
    pytester.makeconftest(f"""
from pytest_sglworker.engine.cpu_engine import cpu_engine_spec

def pytest_sglworker_register_specs(registry):
    # the servicer's warmup ids (up to 890) overflow the tiny model's vocab of 512: no warmup
    registry.add(cpu_engine_spec("tiny-cpu-grpc", {str(model)!r}, extra_args=["--grpc-mode", "--skip-server-warmup"]))
""")
    pytester.makepyfile(f"""
import json

import psutil
import pytest

MODEL = {str(model)!r}


@pytest.mark.sgl_workers(count=1)
@pytest.mark.sgl_router(policy="round_robin")
def test_chat(sgl_router, sgl_workers):
    w = sgl_workers[0]
    tree = [w.pid] + [p.pid for p in psutil.Process(w.pid).children(recursive=True)]
    with open({str(pids)!r}, "w") as fh:
        json.dump(tree, fh)
    assert w.url == f"grpc://127.0.0.1:{{w.port}}"
    log = w.log_text()
    assert f"gRPC server listening on 127.0.0.1:{{w.port}}" in log
    assert f"HTTP sidecar server started on http://127.0.0.1:{{w.ports['sidecar']}}" in log
    assert "Health service status set to SERVING" in log
    (listed,) = sgl_router.workers()
    assert listed["url"] == w.url and listed["connection_mode"] == "gRPC" and listed["is_healthy"]
    chat = {{"model": MODEL, "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 8,
             "temperature": 0}}
    resp = sgl_router.client.post("/v1/chat/completions", json=chat, timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    assert "Receive generation request" in w.log_text()
""")
    start = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--sgl-model", "tiny-cpu-grpc", "--sgl-gpus", "sim:1",
        "--sgl-launcher", " ".join(real_engine_launcher(real_grpc_python)), "--sgl-startup-timeout", "300",
        "-v", timeout=420)
    elapsed = time.monotonic() - start
    result.assert_outcomes(passed=1)
    left = []
    deadline = time.monotonic() + 30
    for pid in json.loads(pids.read_text()):
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:
                break
            time.sleep(0.1)
        if psutil.pid_exists(pid):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.Error:
                pass
    assert not left, f"the real engine's processes outlived the session: {left}"
    print(f"real --grpc-mode launch, one chat through the router: {elapsed:.1f} s")
