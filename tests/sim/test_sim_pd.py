"""Prefill/decode disaggregation of the simulated engine, through the real ``sglang-router`` in PD mode.

One prefill sim (with its bootstrap server), one decode sim and the real router 0.3.2
(``python -m sglang_router.launch_router --pd-disaggregation ...``) for the whole module. What the router
does that the sim had to learn, each pinned by a test below:

- it probes every worker with ``GET /health``, then twice with an HTTP/2 prior-knowledge preface
  (``PRI * HTTP/2.0`` + ``SM``), then ``GET /server_info`` and ``GET /model_info`` on one HTTP/1.1
  connection; the sim answers the preface as uvicorn does (404, then 400 and a closed connection);
- it sends every request to both sides at once, adding ``bootstrap_host`` (the prefill's host),
  ``bootstrap_port`` (the port given after ``--prefill URL``) and a random 63-bit ``bootstrap_room``; it
  never calls the bootstrap port itself (the decode side does, and waits for its peer);
- it answers with the decode side's response; with ``return_logprob`` on a single (non-batch) ``/generate``
  it sets ``meta_info.input_token_logprobs`` to the prefill's followed by the decode's (0.3.2 merges only
  that field, as the gateway's ``merge_logprobs_in_json`` still does: ``input_top_logprobs`` stays the decode
  side's, which is ``[]`` in sglang 0.5.23, and a batch answer is passed through as is);
- ``--prometheus-host/--prometheus-port`` keep its metrics off the default port 29000.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = str(Path(__file__).resolve().parents[1] / "data" / "sim" / "tiny-llama")
ROUTER_HINT = "sglang-router is not installed: pip install sglang-router==0.3.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, path: str, deadline: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
        try:
            if httpx.get(url + path, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url}{path} not ready:\n{log.read_text(errors='replace')[-3000:]}")


@dataclass
class Cluster:
    router: str
    prefill: str
    decode: str
    bootstrap_port: int
    prefill_log: Path
    decode_log: Path


def _sim(port: int, mode: str, log: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SGLSIM_")}
    full.update({"SGLSIM_STARTUP_SECONDS": "0.1", "SGLSIM_PD_WAIT_SECONDS": "5"}, **(env or {}))
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pytest_sglworker.sim", "--model-path", MODEL, "--host",
                                 "127.0.0.1", "--port", str(port), "--disaggregation-mode", mode, *extra],
                                env=full, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pytest.importorskip("sglang_router", reason=ROUTER_HINT)
    root = tmp_path_factory.mktemp("pd")
    p_port, d_port, boot, r_port, prom = (_free_port() for _ in range(5))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_sim(p_port, "prefill", root / "prefill.log", "--disaggregation-bootstrap-port", str(boot),
                          "--disaggregation-transfer-backend", "mooncake", "--disaggregation-ib-device", "mlx5_0"))
        procs.append(_sim(d_port, "decode", root / "decode.log"))
        deadline = time.monotonic() + 30
        _wait(f"http://127.0.0.1:{p_port}", "/health", deadline, procs[0], root / "prefill.log")
        _wait(f"http://127.0.0.1:{d_port}", "/health", deadline, procs[1], root / "decode.log")
        with open(root / "router.log", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(r_port),
                 "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{p_port}", str(boot),
                 "--decode", f"http://127.0.0.1:{d_port}", "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(prom), "--log-level", "warn"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        router = f"http://127.0.0.1:{r_port}"
        _wait(router, "/readiness", time.monotonic() + 60, procs[2], root / "router.log")
        yield Cluster(router, f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}", boot,
                      root / "prefill.log", root / "decode.log")
    finally:
        _stop(procs[::-1])


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30.0, trust_env=False)


def _sse(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_workers_report_their_role(cluster: Cluster) -> None:
    prefill = httpx.get(cluster.prefill + "/server_info", trust_env=False).json()
    decode = httpx.get(cluster.decode + "/server_info", trust_env=False).json()
    assert prefill["disaggregation_mode"] == "prefill" and decode["disaggregation_mode"] == "decode"
    assert prefill["disaggregation_bootstrap_port"] == cluster.bootstrap_port
    assert prefill["disaggregation_transfer_backend"] == "mooncake"
    assert prefill["disaggregation_ib_device"] == "mlx5_0"
    assert httpx.get(cluster.decode + "/model_info", trust_env=False).json()["disaggregation_mode"] == "decode"


def test_bootstrap_server_answers_sglang_routes(cluster: Cluster) -> None:
    boot = f"http://127.0.0.1:{cluster.bootstrap_port}"
    assert httpx.get(boot + "/health", trust_env=False).text == "OK"
    r = httpx.get(boot + "/route", trust_env=False)
    assert r.status_code == 400 and r.text == "Missing inputs for bootstrap server."
    info = httpx.get(boot + "/route", params={"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1,
                                              "target_pp_rank": -1}, trust_env=False).json()
    assert info["attn_tp_size"] == 1 and info["page_size"] == 1 and info["follow_bootstrap_room"] is True
    rank = httpx.get(boot + "/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0,
                                              "target_pp_rank": 0}, trust_env=False).json()
    assert set(rank) == {"rank_ip", "rank_port"} and rank["rank_ip"] == "127.0.0.1"
    assert httpx.post(boot + "/route", trust_env=False).status_code == 405


def test_chat_through_the_router(cluster: Cluster) -> None:
    r = _post(cluster.router, "/v1/chat/completions", {"model": "m", "max_tokens": 3,
                                                        "messages": [{"role": "user", "content": "hi there"}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["usage"]["completion_tokens"] == 3
    assert out["usage"]["prompt_tokens"] == 12  # the tiny model's ChatML template, tokenized for real
    assert out["choices"][0]["message"]["reasoning_content"] is None


def test_streamed_chat_through_the_router(cluster: Cluster) -> None:
    body = {"model": "m", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=30.0, trust_env=False) as c, c.stream("POST", cluster.router + "/v1/chat/completions",
                                                                    json=body) as r:
        assert r.status_code == 200
        events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("reasoning_content" in c["choices"][0]["delta"] for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_generate_through_the_router(cluster: Cluster) -> None:
    r = _post(cluster.router, "/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (2, 4)
    # the decode side did the generating: the prefill side stops after its first token
    assert "Prefill batch" in cluster.prefill_log.read_text() and "Prefill batch" in cluster.decode_log.read_text()


def test_logprobs_merge(cluster: Cluster) -> None:
    """Like the gateway's ``test_pd_logprobs_merge``: input logprobs come from prefill, output from decode."""
    ids = [1, 5, 9, 20, 30, 40, 50, 60, 70, 80]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    merged = _post(cluster.router, "/generate", body).json()["meta_info"]
    assert len(merged["input_token_logprobs"]) == len(ids) and merged["input_token_logprobs"][0][0] is None
    assert [t for _, t, _ in merged["input_token_logprobs"]] == ids
    assert len(merged["output_token_logprobs"]) == 4 and merged["completion_tokens"] == 4
    # which side said what: the decode side has no prompt logprobs, the prefill side only its first token
    room = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}  # sglang's fake transfer: no peer needed
    decode = _post(cluster.decode, "/generate", {**body, **room}).json()["meta_info"]
    prefill = _post(cluster.prefill, "/generate", {**body, **room}).json()["meta_info"]
    assert decode["input_token_logprobs"] == [] and len(decode["output_token_logprobs"]) == 4
    # with top_logprobs_num the decode side has no prompt part either: input_top_logprobs is [] (0.5.23's
    # output streamer sends no input logprobs from a decode server), its output tops cover every token
    assert decode["input_top_logprobs"] == [] and len(decode["output_top_logprobs"]) == 4
    assert len(prefill["input_top_logprobs"]) == len(ids) and prefill["input_top_logprobs"][0] is None
    assert prefill["input_token_logprobs"] == merged["input_token_logprobs"]
    assert merged["input_top_logprobs"] == []  # the router merges input_token_logprobs only
    first = prefill["output_token_logprobs"]
    assert first == decode["output_token_logprobs"][:1] == merged["output_token_logprobs"][:1]
    assert prefill["finish_reason"] == {"type": "length", "length": 0}
    with httpx.Client(timeout=30.0, trust_env=False) as c, c.stream("POST", cluster.router + "/generate",
                                                                    json={**body, "stream": True}) as r:
        assert r.status_code == 200
        first = _sse(r)[0]
    assert "input_token_logprobs" in first["meta_info"] and "completion_tokens" in first["meta_info"]


def test_decode_side_logprobs_have_no_prompt_part(tmp_path: Path) -> None:
    """sglang 0.5.23's decode server sends no input logprobs (``output_streamer.py``: "Decode server does not send
    input logprobs"): with ``top_logprobs_num`` its ``input_top_logprobs`` is ``[]`` like its
    ``input_token_logprobs``, streamed or not, batched or not; its output logprobs cover every token."""
    port = _free_port()
    proc = _sim(port, "decode", tmp_path / "decode.log")
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url, "/health", time.monotonic() + 20, proc, tmp_path / "decode.log")
        body = {"input_ids": [1, 5, 9, 20], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
                "logprob_start_len": 0, "top_logprobs_num": 2, "bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
        meta = _post(url, "/generate", body).json()["meta_info"]
        assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 3
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])
        batch = _post(url, "/generate", {**body, "input_ids": [[1, 5, 9, 20]], "bootstrap_room": [1]}).json()
        assert batch[0]["meta_info"]["input_top_logprobs"] == []
        with httpx.Client(timeout=30.0, trust_env=False) as c, c.stream("POST", url + "/generate",
                                                                        json={**body, "stream": True}) as r:
            chunks = [e for e in _sse(r) if e != "[DONE]"]
        assert chunks and all(e["meta_info"]["input_top_logprobs"] == [] for e in chunks)
    finally:
        _stop([proc])


def test_decode_without_bootstrap_fields_is_refused(cluster: Cluster) -> None:
    r = _post(cluster.decode, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("Invalid request: Disaggregated request received without bootstrap room id. req.rid=")
    r = _post(cluster.decode, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "BadRequestError"
    assert "without bootstrap room id" in r.json()["message"]


def test_decode_waits_for_its_peer_then_aborts(tmp_path: Path) -> None:
    """A room no prefill side ever takes: sglang's decode aborts it with 500 once its wait is over."""
    port = _free_port()
    proc = _sim(port, "decode", tmp_path / "decode.log", env={"SGLSIM_PD_WAIT_SECONDS": "0.6"})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url, "/health", time.monotonic() + 20, proc, tmp_path / "decode.log")
        tic = time.monotonic()
        r = _post(url, "/generate", {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": _free_port(),
                                     "bootstrap_room": 7})
        assert time.monotonic() - tic > 0.4  # it waited for its peer (a lower bound: load only adds to it)
        assert r.status_code == 500
        body = r.json()
        assert body["type"] == "500" and "Could not fetch prefill parallel info" in body["message"]
        assert "Decode handshake failed for request rank=0" in body["message"]
    finally:
        _stop([proc])
