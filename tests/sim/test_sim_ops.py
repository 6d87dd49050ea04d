"""The simulated engine's load reports (``/v1/loads``, the legacy ``/get_load``), its death-on-arrival fault
(``die_on_request``) and its ``--help`` / ``--help-faults``: real subprocesses, every wait bounded by a deadline,
nothing left running."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sim_procs import CI_ARGS, MODEL, Launcher, SimProc, run_cli, wait_for

from pytest_sglworker.sim.faults import FaultError, parse_fault_spec

#: ``python -m pytest_sglworker.sim --help-faults``, word for word (a fault's record changes it: update it here).
HELP_FAULTS = """\
environment:
  SGLSIM_STARTUP_SECONDS=S     total simulated startup (default 0.3; 70 % before binding)
  SGLSIM_WARMUP_SECONDS=S      the warmup part after binding (default 30 % of the startup)
  SGLSIM_GPU_MEM_GIB=GIB       the card size (default 80)
  SGLSIM_GPU_FREE_MIB=MIB      memory free when the weights load (default 98.125 % of the card)
  SGLSIM_TOKEN_SECONDS=S       time per generated token (default 0)
  SGLSIM_PD_WAIT_SECONDS=S     how long a PD side waits for its peer (default 15)
  SGLSIM_RECORD=PATH           append start/ready/exit events as JSON lines
  SGLSIM_FAULT=F1,F2=V,...     faults, below

startup faults (SGLSIM_FAULT only, comma-separated):
  crash_oom              CUDA OOM in the prefill-graph capture (forced even with the prefill
                         graph disabled), the breakable-graph error record, the
                         num_active_captures_ assert, 'Received sigquit', then SIGKILL of itself
                         (returncode -9)
  kv_oom                 0.5.23's 'Loaded weights leave no GPU memory for the KV cache' failure,
                         exit 1
  exit=N                 a scheduler traceback after the weights load, exit N
  hang                   binds, then never becomes ready
  hang_before_bind       never binds
  flood=MB               MB MiB of log lines to stdout and as many to stderr while the weights
                         load
  ignore_sigterm         SIGTERM is ignored (SIGINT and SIGKILL still work)
  shutdown=S             on SIGTERM or SIGINT, its clean shutdown takes S seconds more before it
                         exits 0 (sglang's stops its scheduler and detokenizer first: about 4 s)
  escape_child           spawns a child in its own session (SGLSIM_ESCAPED=1), logged as
                         'spawned scheduler pid=N'; it outlives a kill of the sim's process
                         group, exits by itself after 600 s

request faults (SGLSIM_FAULT, or at run time through /_sim/faults):
  die_after=N            SIGKILL of itself right after answering the N-th inference request
  die_on_request=N       SIGKILL of itself when the N-th inference request (from when it is set)
                         arrives, before any byte of its answer: the client's connection just
                         closes
  slow_health=S          every /health, /health_generate and /ready answer is delayed by S
                         seconds
  fail_first=N           the first N inference requests (from when it is set) fail with 500 (or
                         status=)
  fail_rate=P            a fraction P of the inference requests fail with 500 (or status=),
                         deterministically: request k fails when crc32('<seed>:<k>') / 2**32 < P
  fail_seed=N            the seed of fail_rate (default 0)
  status=CODE            the status code of the failures; alone, every inference request answers
                         it
  latency=S              every inference request waits S seconds in the queue (counted in its
                         load) before it is answered
  hang_request=N         the N-th inference request (from when it is set) is never answered (0:
                         none)
  hang_requests          every inference request is never answered
  health_fail_after=S    /health, /health_generate and /ready answer 503 from S seconds after
                         the fault is set (0: from now on)
  health_fail            /health, /health_generate and /ready answer 503 from now on
                         (health_fail_after=0)
  api_key=KEY            require 'Authorization: Bearer KEY' on everything but /health*,
                         /ready*, /metrics* and /_sim/* (like --api-key, which it overrides)
  max_payload=N          a request body over N bytes is refused with 413 (sglang and uvicorn
                         have no limit)
  trickle=S              every response (health included) is written one byte every S seconds

control endpoint (exempt from the API key and the faults):
  GET  /_sim/faults   the request faults in force, counters since they were set, the worker
  POST /_sim/faults   {"fail_first": 2, "latency": 0.1}, {"spec": "fail_first=2"}, {"reset": true};
                      null clears one fault; a bad body answers 400 with the error
every response carries X-SGLSim-Worker: <port>/<pid>.
"""


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.cleanup()


def _loads(sim: SimProc, query: str = "") -> list[dict[str, Any]]:
    r = sim.client.get("/v1/loads" + query)
    assert r.status_code == 200, r.text
    loads = r.json()["loads"]
    assert isinstance(loads, list)
    return loads


class _Requests:
    """``n`` slow generation requests in threads; ``join`` waits for them (bounded) and returns their statuses."""

    def __init__(self, sim: SimProc, n: int, tokens: int) -> None:
        self.statuses: list[int] = []
        self.errors: list[BaseException] = []
        body = {"text": "alpha beta gamma", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}

        def post() -> None:
            try:
                with httpx.Client(base_url=sim.url, timeout=30.0, trust_env=False) as client:
                    self.statuses.append(client.post("/generate", json=body).status_code)
            except BaseException as exc:  # reported by join()
                self.errors.append(exc)

        self.threads = [threading.Thread(target=post, daemon=True) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def join(self, timeout: float = 30.0) -> list[int]:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a request did not finish in time"
        assert not self.errors, self.errors
        return self.statuses


# ------------------------------------------------------------------------------------------- loads


def test_a_worker_with_requests_in_flight_reports_a_higher_load_than_an_idle_one(launch: Launcher) -> None:
    busy = launch(*CI_ARGS, "--skip-server-warmup", "--max-total-tokens", "2048", env={"SGLSIM_TOKEN_SECONDS": "0.05"})
    idle = launch(*CI_ARGS, "--skip-server-warmup", "--max-total-tokens", "2048")
    busy.wait_ready()
    idle.wait_ready()
    requests = _Requests(busy, 3, tokens=40)  # 2 s of generation each
    load = wait_for(lambda: next((lo for lo in _loads(busy) if lo["num_running_reqs"] == 3), None), 10.0,
                    "three running requests in /v1/loads")
    assert load["num_used_tokens"] >= 3 * 3 and load["num_total_tokens"] >= load["num_used_tokens"]
    assert load["token_usage"] > 0 and load["num_waiting_reqs"] == 0
    # the tokens grow as the sequences decode
    wait_for(lambda: _loads(busy)[0]["num_used_tokens"] > load["num_used_tokens"], 10.0, "the used tokens to grow")
    legacy = busy.client.get("/get_load").json()
    assert [entry["dp_rank"] for entry in legacy] == [0] and legacy[0]["num_reqs"] == 3
    assert legacy[0]["num_tokens"] > 9 and set(legacy[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens",
                                                              "num_pending_tokens", "ts_tic"}
    calm = _loads(idle)[0]
    assert (calm["num_running_reqs"], calm["num_used_tokens"], calm["num_total_tokens"]) == (0, 0, 0)
    assert idle.client.get("/get_load").json()[0]["num_tokens"] == 0 < legacy[0]["num_tokens"]
    assert requests.join() == [200, 200, 200]
    done = wait_for(lambda: next((lo for lo in _loads(busy) if lo["num_running_reqs"] == 0), None), 10.0,
                    "the load to fall back to zero")
    assert done["num_used_tokens"] == 0 and done["decode_moments"][0] >= 3 * 40
    assert "Endpoint '/get_load' is deprecated" in busy.log()


def test_a_request_held_by_the_latency_fault_counts_in_the_load(launch: Launcher) -> None:
    """A slow worker (the ``latency`` fault) must look busy to a load-aware router while it holds requests."""
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "latency=1.5"})
    sim.wait_ready()
    requests = _Requests(sim, 2, tokens=1)
    legacy = wait_for(lambda: next((lo for lo in sim.client.get("/get_load").json() if lo["num_reqs"] == 2), None),
                      10.0, "two queued requests in /get_load")
    assert legacy["num_tokens"] > 0
    assert requests.join() == [200, 200]
    wait_for(lambda: _loads(sim)[0]["num_running_reqs"] == 0, 10.0, "the load to fall back to zero")


def test_loads_per_dp_rank_and_the_queue_beyond_max_running_requests(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", "--dp-size", "2", "--max-running-requests", "1",
                 env={"SGLSIM_TOKEN_SECONDS": "0.05"})
    sim.wait_ready()
    assert [lo["dp_rank"] for lo in _loads(sim)] == [0, 1]
    requests = _Requests(sim, 3, tokens=40)  # rank 0 gets two (one waits), rank 1 one

    def queued() -> list[dict[str, Any]] | None:
        loads = _loads(sim)
        return loads if sum(lo["num_running_reqs"] + lo["num_waiting_reqs"] for lo in loads) == 3 else None

    loads = wait_for(queued, 10.0, "three requests in the loads")
    assert [(lo["num_running_reqs"], lo["num_waiting_reqs"]) for lo in loads] == [(1, 1), (1, 0)]
    assert loads[0]["num_total_tokens"] > loads[0]["num_used_tokens"]  # the waiting one's tokens are pending
    assert loads[0]["queues"]["waiting"] == 1 and loads[0]["num_waiting_uncached_tokens"] > 0
    assert [lo["num_running_reqs"] for lo in _loads(sim, "?dp_rank=1")] == [1]
    assert _loads(sim, "?dp_rank=5") == []
    assert requests.join() == [200, 200, 200]


def test_v1_loads_queries_answer_like_the_real_engine(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup")
    sim.wait_ready()
    c = sim.client
    full = c.get("/v1/loads").json()
    assert set(full) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    assert {"memory", "disaggregation", "queues"} <= set(full["loads"][0])
    core = _loads(sim, "?include=core")[0]
    assert "memory" not in core and "queues" not in core and core["max_running_requests"] > 0
    assert set(_loads(sim, "?include=core,queues")[0]) == set(core) | {"queues"}
    r = c.get("/v1/loads?format=prometheus")
    assert r.headers["content-type"].startswith("text/plain")
    assert '# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs{dp_rank="0"} 0\n' in r.text
    assert 'sglang_disagg_decode_prealloc_queue_reqs{dp_rank="0"} 0' in r.text
    # an unknown section raises inside the real handler: uvicorn's bare 500, the connection closed
    r = httpx.get(sim.url + "/v1/loads?include=bogus", timeout=5.0, trust_env=False)
    assert (r.status_code, r.text) == (500, "Internal Server Error")
    r = c.get("/v1/loads?dp_rank=x")
    assert r.status_code == 400 and r.json()["type"] == "Bad Request"


# ------------------------------------------------------------------------------------------- die_on_request


def test_die_on_request_kills_the_worker_when_the_request_arrives(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "die_on_request=2"})
    sim.wait_ready()
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    assert sim.client.post("/generate", json=body).status_code == 200
    for path in ("/health", "/v1/models", "/v1/loads"):  # not inference requests: not counted
        assert sim.client.get(path).status_code == 200
    with pytest.raises(httpx.TransportError):  # no status line, no byte: the connection just closes
        sim.client.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
    assert sim.wait_exit() == -signal.SIGKILL
    assert "RuntimeError: simulated death on request 2 (SGLSIM_FAULT=die_on_request=2)" in sim.log()


def test_die_on_request_set_at_run_time_counts_from_then(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup")
    sim.wait_ready()
    c = sim.client
    for _ in range(3):
        assert c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    assert c.post("/_sim/faults", json={"die_on_request": 1}).json()["faults"]["die_on_request"] == 1
    with pytest.raises(httpx.TransportError):
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert sim.wait_exit() == -signal.SIGKILL


def test_die_on_request_needs_a_positive_count() -> None:
    assert parse_fault_spec("die_on_request=3")[1].die_on_request == 3
    with pytest.raises(FaultError, match="fault 'die_on_request' needs a positive integer, got '0'"):
        parse_fault_spec("die_on_request=0")


# ------------------------------------------------------------------------------------------- --help


def test_help_starts_with_the_simulated_engine_then_its_faults_then_sglangs_flags() -> None:
    result = run_cli("--help")
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[:4] == [
        "usage: python -m pytest_sglworker.sim [-h] [--help-faults] --model-path MODEL_PATH [sglang 0.5.23 flags ...]",
        "",
        "pytest-sglworker's simulated sglang engine: a CPU-only stand-in for sglang 0.5.23's server (its flags, "
        "endpoints,",
        "log lines, gRPC and PD protocols) on a real port, with switchable faults. --help-faults prints only the "
        "faults",
    ]
    faults_at = result.stdout.index(HELP_FAULTS)  # the faults and variables, whole, before sglang's flags
    flags_at = result.stdout.index("sglang 0.5.23's flags (accepted and rejected as its own parser does):\n")
    assert 0 < faults_at < flags_at < result.stdout.index("  --model-path MODEL_PATH, --model MODEL_PATH")
    assert "usage: sglang serve" not in result.stdout and len(lines) < 700


def test_help_faults_prints_the_faults_and_variables_only() -> None:
    result = run_cli("--help-faults")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == HELP_FAULTS
    # a usage error still reads as sglang's own parser's
    result = run_cli("--model-path", MODEL, "--help-fault")
    assert result.returncode == 2 and "sglang serve: error: unrecognized arguments: --help-fault" in result.stderr
