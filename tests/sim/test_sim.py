"""Tests of the simulated engine (``python -m pytest_sglworker.sim``): real subprocesses, real HTTP on
loopback, output to files (never pipes), every wait bounded by a deadline, nothing left running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sim_procs import (
    CI_ARGS,
    MODEL,
    TINY,
    Launcher,
    SimProc,
    alive,
    free_port,
    positions_in_order,
    run_cli,
    sse,
    tiny_sim,
    wait_for,
)

from pytest_sglworker.engine.ledger import predict_memory
from pytest_sglworker.engine.sglang_facts import MODEL_DIMS, flag_table
from pytest_sglworker.sim import faults as simfaults
from pytest_sglworker.sim import main as simmod
from pytest_sglworker.sim.plan import Plan
from pytest_sglworker.sim.tokens import load_model_dir

QWEN = MODEL_DIMS[MODEL]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.cleanup()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    """One ready server for the endpoint-shape tests."""
    launcher = Launcher(tmp_path_factory.mktemp("shared-sim"))
    try:
        sim = launcher(*CI_ARGS, "--enable-metrics", "--served-model-name", "qwen-sim", "--page-size", "1")
        sim.wait_ready()
        yield sim
    finally:
        launcher.cleanup()


# ------------------------------------------------------------------------------------------- in-process units


def _tokens(argv: list[str], gib: float = 80.0, free: int | None = None, tp: int = 1) -> int:
    return predict_memory(QWEN, round(gib * 1024), gpu_free_mib=free if free is not None else int(gib * 1024 * 0.98125),
                          argv=argv, tp=tp).kv_tokens


def test_plan_memory_arithmetic() -> None:
    parser = simmod.build_parser()

    def plan(argv: list[str], gib: float = 80.0) -> Plan:
        return simmod.make_plan(parser.parse_args(["--model", MODEL, *argv]), gib, argv=argv)

    auto = plan([])
    assert auto.fraction == 0.83  # the engine's automatic fraction on an 80 GiB card
    assert (f"{auto.avail_before:.2f}", f"{auto.weights:.2f}", f"{auto.avail_after:.2f}") == ("78.50", "1.11", "77.39")
    assert auto.max_total_tokens == _tokens([])
    ci = plan(list(CI_ARGS))
    assert ci.max_total_tokens == _tokens(list(CI_ARGS)) > 0
    assert ci.prefill_backend == "disabled" and ci.decode_backend == "full"
    assert plan(["--max-total-tokens", "4Ki", "--page-size=64"]).max_total_tokens == 4096
    assert plan(["--mem-fraction-static", "0.01"]).rest <= 0
    llama = simmod.make_plan(parser.parse_args(["--model", "meta-llama/Llama-3.1-8B-Instruct", "--tp-size=2"]), 80.0,
                             argv=["--tp-size=2"])
    assert llama.facts.architecture == "LlamaForCausalLM" and llama.kv_bytes_per_token == 65536
    tiny = simmod.make_plan(parser.parse_args(["--model", TINY]), 80.0, argv=[])
    assert (tiny.context_len, tiny.hidden_size, tiny.vocab_size) == (512, 64, 512)


CARDS = {"H100-80G": 81559, "A100-40G": 40960, "L4": 23034, "B200": 183359}
ARGVS = [[], list(CI_ARGS), ["--mem-fraction-static", "0.7", "--page-size", "16"],
         ["--disaggregation-mode", "decode", "--max-running-requests", "64"],
         ["--max-total-tokens", "100000", "--chunked-prefill-size", "2048"], ["--tp-size", "2"]]


@pytest.mark.parametrize("card", sorted(CARDS))
def test_kv_tokens_equal_the_ledgers(card: str) -> None:
    """For a card, an argv and the memory free at load, the sim's pool is the ledger's ``kv_tokens``."""
    parser = simmod.build_parser()
    total = CARDS[card]
    for argv in ARGVS:
        tp = 2 if "--tp-size" in argv else 1
        for free in (total, total - 7000, int(total * 0.9)):
            plan = simmod.make_plan(parser.parse_args(["--model", MODEL, *argv]), total / 1024, free_mib=free,
                                    argv=argv)
            ledger = predict_memory(QWEN, total, gpu_free_mib=free, argv=argv, tp=tp)
            assert plan.max_total_tokens == ledger.kv_tokens, (card, argv, free)
            assert plan.fraction == ledger.mem_fraction_static


def test_kv_line_follows_the_declared_card_and_free_memory(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_GPU_MEM_GIB": str(40960 / 1024),
                                                         "SGLSIM_GPU_FREE_MIB": "38000"})
    sim.wait_ready()
    tokens = predict_memory(QWEN, 40960, gpu_free_mib=38000, argv=list(CI_ARGS)).kv_tokens
    log = sim.log()
    assert f"#tokens: {tokens}," in log and f"max_total_num_tokens={tokens}," in log
    assert f"Load weight begin. avail mem={38000 / 1024:.2f} GB" in log
    info = sim.client.get("/server_info").json()
    assert info["max_total_num_tokens"] == tokens
    assert info["internal_states"][0]["memory_usage"]["startup_available"] == round(38000 / 1024, 3)


def test_parse_faults() -> None:
    faults = simfaults.parse_faults(" crash_oom, die_after=3 ,slow_health=0.5,flood=1.5,exit=7,escape_child ")
    assert faults.crash_oom and faults.escape_child and not faults.hang
    assert (faults.flood_mb, faults.exit_code) == (1.5, 7)
    startup, request = simfaults.parse_fault_spec("die_after=3,slow_health=0.5,fail_first=2,fail_rate=0.25,status=503,"
                                               "latency=0.1,hang_request=4,health_fail_after=2,api_key=k,"
                                               "max_payload=100,trickle=0.01,hang_requests,health_fail")
    assert startup == simfaults.Faults()
    assert (request.die_after, request.slow_health, request.fail_first, request.fail_rate) == (3, 0.5, 2, 0.25)
    assert (request.status, request.latency, request.hang_request, request.api_key) == (503, 0.1, 4, "k")
    assert (request.max_payload, request.trickle, request.hang_requests) == (100, 0.01, True)
    assert request.health_fail_after == 0.0  # health_fail came last: from now on
    assert simfaults.parse_faults("") == simfaults.Faults()
    for bad in ("bogus", "exit=x", "exit=300", "die_after", "die_after=0", "hang=1", "flood=-1", "slow_health=",
                "fail_rate=2", "status=99", "max_payload=0", "latency=-1", "api_key=", "fail_first=1.5"):
        with pytest.raises(simfaults.FaultError, match="SGLSIM_FAULT") as info:
            simfaults.parse_faults(bad)
        assert "known: crash_oom, " in str(info.value) and "trickle=..." in str(info.value)
        assert repr(bad.partition("=")[0]) in str(info.value)


def test_every_flag_of_the_real_parser_is_accepted() -> None:
    """The sim's parser is built from the committed table of sglang's: every option string parses."""
    parser = simmod.build_parser()
    samples = {"int": "1", "float": "0.5", "human_readable_int": "1k", "parse_cuda_graph_backend_arg": "full"}
    for flag in flag_table().flags:
        for option in flag.options:
            argv = ["--model-path", MODEL]
            if option in ("--model-path", "--model"):
                argv = []
            if not flag.takes_value:
                argv.append(option)
            else:
                value = flag.choices[0] if flag.choices else samples.get(flag.type or "", "x")
                argv += [option, value]
                if option in ("--model-path", "--model"):
                    argv = [option, MODEL]
            ns = parser.parse_args(argv)
            assert hasattr(ns, flag.dest), option


def test_import_is_light() -> None:
    code = "import sys, pytest_sglworker.sim; print(sorted({'httpx', 'asyncio', 'pytest'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------- CLI


def test_unknown_flag_exits_2() -> None:
    result = run_cli("--model-path", MODEL, "--no-such-flag", "8")
    assert result.returncode == 2
    assert "sglang serve: error: unrecognized arguments: --no-such-flag 8" in result.stderr


def test_ambiguous_abbreviation_exits_2_like_the_real_engine() -> None:
    # --cuda-graph-max-bs existed in sglang 0.5.12; 0.5.23 reads it as a prefix of two flags (as the real
    # engine's log in tests/data/logs/real_bad_flag_ambiguous.log says, word for word)
    result = run_cli("--model-path", MODEL, "--cuda-graph-max-bs", "8")
    assert result.returncode == 2
    real = (Path(__file__).resolve().parents[1] / "data" / "logs" / "real_bad_flag_ambiguous.log").read_text()
    real = real.splitlines()[-1]
    assert real in result.stderr.splitlines()


def test_abbreviated_flag_is_accepted_like_the_real_engine() -> None:
    ns = simmod.build_parser().parse_args(["--model-path", MODEL, "--mem-fraction=0.6", "--disaggregation-mode",
                                           "prefill", "--enable-custom-logit-processor"])
    assert ns.mem_fraction_static == 0.6 and ns.disaggregation_mode == "prefill"
    assert ns.enable_custom_logit_processor is True


def test_bad_choice_exits_2() -> None:
    result = run_cli("--model", MODEL, "--cuda-graph-backend-prefill=bogus")
    assert result.returncode == 2
    assert "invalid choice: 'bogus' (choose from 'full', 'breakable', 'disabled')" in result.stderr


def test_missing_model_path_exits_2() -> None:
    result = run_cli("--port", "1")
    assert result.returncode == 2
    assert "the following arguments are required: --model-path/--model" in result.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [("SGLSIM_FAULT", "bogus"), ("SGLSIM_FAULT", "die_after=soon"), ("SGLSIM_STARTUP_SECONDS", "slow")],
)
def test_bad_environment_exits_2(name: str, value: str) -> None:
    result = run_cli("--model", MODEL, "--port", str(free_port()), env={name: value})
    assert result.returncode == 2
    assert name in result.stderr


# ------------------------------------------------------------------------------------------- startup


def test_startup_lines_in_order(launch: Launcher) -> None:
    argv = [*CI_ARGS, "--cuda-graph-backend-prefill", "breakable", "--nccl-port", "41234", "--tp-size=1"]
    sim = launch(*argv)
    sim.wait_ready()
    log = sim.log()
    tokens = _tokens(argv)
    positions_in_order(
        log,
        [
            "server_args={'model_path': 'Qwen/Qwen3-0.6B',",
            "Init parallel begin.",
            "Init parallel ends.",
            "Memory baseline taken.",
            "Load weight begin. avail mem=78.50 GB",
            "Load weight end. elapsed=",
            "type=Qwen3ForCausalLM, avail mem=77.39 GB, mem usage=1.11 GB.",
            f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {tokens}, K size: ",
            "Memory pool end. avail mem=",
            "Capture target decode CUDA graph begin.",
            "Capturing batches (bs=256 avail_mem=",
            "| 36/36 [",
            "Capture target decode CUDA graph end.",
            "Capture target prefill CUDA graph begin. backend=breakable",
            "Capturing prefill shape (num_tokens=8192 avail_mem=",
            "| 58/58 [",
            "Capture target prefill CUDA graph end.",
            f"max_total_num_tokens={tokens}, chunked_prefill_size=8192, max_prefill_tokens=16384, ",
            f"INFO:     Uvicorn running on http://127.0.0.1:{sim.port} (Press CTRL+C to quit)",
            "INFO:     127.0.0.1:",  # the warmup request
            "The server is fired up and ready to roll!",
        ],
    )
    # with --tp-size 1 the real prefix has no rank; uvicorn's lines carry the timestamp too (0.5.23)
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] Load weight begin\. ", log, re.M)
    assert " TP0]" not in log
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] INFO:     Uvicorn running", log, re.M)
    info = sim.client.get("/server_info").json()
    assert info["nccl_port"] == 41234 and info["max_total_num_tokens"] == tokens


def test_tp2_repeats_per_rank_lines(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--tp-size", "2", "--skip-server-warmup")
    sim.wait_ready()
    log = sim.log()
    for rank in (0, 1):
        assert re.search(rf"^\[[\d :-]+ TP{rank}\] Load weight begin\. ", log, re.M)
        assert re.search(rf"^\[[\d :-]+ TP{rank}\] KV Cache is allocated\. ", log, re.M)
        assert re.search(rf"^\[[\d :-]+ TP{rank}\] Memory pool end\. ", log, re.M)
    assert re.search(r"^\[[\d :-]+ TP0\] max_total_num_tokens=", log, re.M)
    assert not re.search(r"TP1\] max_total_num_tokens=", log)  # rank 0 only
    assert log.count("Capturing batches (bs=") >= 1 and "TP1] Capturing" not in log


def test_disabled_graphs_and_max_total_tokens(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--cuda-graph-backend-decode=disabled", "--max-total-tokens", "1024", "--skip-server-warmup")
    sim.wait_ready()
    log = sim.wait_log("fired up and ready")
    assert "#tokens: 1024," in log and "max_total_num_tokens=1024," in log
    assert "Capture target" not in log
    assert '"POST /generate HTTP/1.1"' not in log  # no warmup request


def test_not_listening_while_loading_then_503_until_warmup_ends(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, startup="1.0", env={"SGLSIM_WARMUP_SECONDS": "1.0"})
    sim.wait_log("Load weight begin")
    # ~0.7 s remain before the bind: the port must refuse connections now.
    with pytest.raises(httpx.ConnectError):
        sim.client.get("/health", timeout=1.0)
    assert "Uvicorn running" not in sim.log()
    sim.wait_status("/v1/models", 200)  # bound: /v1/models is green before warmup ends ...
    assert sim.status("/health") == 503  # ... but health is not
    assert sim.status("/health_generate") == 503
    assert sim.status("/ping") == 200
    assert "fired up" not in sim.log()
    sim.wait_ready()
    assert "The server is fired up and ready to roll!" in sim.log()
    assert sim.status("/health_generate") == 200


def test_skip_server_warmup_is_ready_at_bind(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_WARMUP_SECONDS": "60"})
    sim.wait_ready(timeout=10)
    assert "fired up and ready" in sim.log()


def test_port_in_use(launch: Launcher) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        sim = launch(*CI_ARGS, port=port)
        expected = f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
        expected += "address already in use"
        sim.wait_log("Waiting for application shutdown.")
        assert sim.proc.poll() is None  # like sglang 0.5.23, it stays alive after a failed bind
        sim.proc.terminate()
        sim.wait_exit()
    log = sim.log()
    # uvicorn's order, as the real engine's log of a port in use shows it: the application's startup, then the bind
    positions_in_order(log, ["KV Cache is allocated", "INFO:     Started server process [",
                             "INFO:     Waiting for application startup.", "INFO:     Application startup complete.",
                             expected, "INFO:     Waiting for application shutdown."])
    assert "fired up" not in log


def test_cuda_visible_devices_too_few_for_tp(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--tp-size", "2", env={"CUDA_VISIBLE_DEVICES": "3"})
    assert sim.wait_exit() == 1
    assert "invalid device ordinal" in sim.log()


# ------------------------------------------------------------------------------------------- endpoints


def test_info_endpoints(shared: SimProc) -> None:
    c = shared.client
    assert c.get("/health").status_code == 200 and c.get("/ping").status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = c.get(path).json()
        assert info["model_path"] == MODEL and info["tokenizer_path"] == MODEL
        assert info["is_generation"] is True and info["architectures"] == ["Qwen3ForCausalLM"]
        assert {"preferred_sampling_params", "weight_version"} <= set(info)
    for path in ("/server_info", "/get_server_info"):
        info = c.get(path).json()
        assert info["version"] == "0.5.23-sim" and info["port"] == shared.port
        assert info["mem_fraction_static"] == 0.6 and info["cuda_graph_backend_prefill"] == "disabled"
        assert info["max_total_num_tokens"] > 0 and info["served_model_name"] == "qwen-sim"
    assert "deprecated" in shared.wait_log("Endpoint '/get_server_info' is deprecated")
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen-sim"
    assert models["data"][0]["max_model_len"] == 40960
    assert c.get("/v1/models/qwen-sim").json()["id"] == "qwen-sim"
    assert c.get("/v1/models/other").status_code == 404


def test_generate(shared: SimProc) -> None:
    c = shared.client
    r = c.post("/generate", json={"text": "alpha beta gamma", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200
    out = r.json()
    assert out["text"] == "alpha beta gamma alpha" and len(out["output_ids"]) == 4
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 4)
    assert {"id", "cached_tokens", "e2e_latency", "weight_versions", "dp_rank", "reasoning_tokens"} <= set(meta)
    assert all(0 <= i < 151936 for i in out["output_ids"])
    # below the natural length of 16 words, the model stops on its EOS token
    out = c.post("/generate", json={"text": "delta", "sampling_params": {"max_new_tokens": 100}}).json()
    meta = out["meta_info"]
    # 16 tokens, then the EOS token: counted and in output_ids, not in the text
    assert meta["finish_reason"] == {"type": "stop", "matched": 151645} and meta["completion_tokens"] == 17
    assert out["output_ids"][-1] == 151645 and out["text"] == " ".join(["delta"] * 16)
    assert meta["num_retractions"] == 0 and "total_retractions" not in meta
    stop = c.post("/generate", json={"text": "one two three", "sampling_params": {"stop": "three"}}).json()
    assert stop["text"] == "one two" and stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": "three"}
    ids = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}}).json()
    assert ids["meta_info"]["prompt_tokens"] == 2 and ids["meta_info"]["completion_tokens"] == 3
    batch = c.post("/generate", json={"text": ["a b", "c"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert [o["text"] for o in batch] == ["a b", "c c"]
    # PUT is accepted like the real route
    assert c.put("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_generate_stream(shared: SimProc) -> None:
    body = {"text": "stream me now", "sampling_params": {"max_new_tokens": 5}, "stream": True}
    with shared.client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 5
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert chunks[-1]["text"] == "stream me now stream me"


def test_chat_completions(shared: SimProc) -> None:
    body = {"model": "qwen-sim", "messages": [{"role": "user", "content": "hello there sim"}], "max_tokens": 2}
    out = shared.client.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion" and out["model"] == "qwen-sim"
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hello there", "reasoning_content": None}
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }
    body = {"messages": [{"role": "user", "content": "hey"}], "max_completion_tokens": 50}
    assert shared.client.post("/v1/chat/completions", json=body).json()["choices"][0]["finish_reason"] == "stop"


def test_chat_completions_stream(shared: SimProc) -> None:
    body = {
        "model": "qwen-sim",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x y"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with shared.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # sglang 0.5.23's deltas carry reasoning_content (the openai SDK reads delta.reasoning_content); its chat
    # chunks have no "usage" key at all but the last one (completions chunks carry "usage": null)
    assert chunks[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert all(c["choices"][0]["delta"]["reasoning_content"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "be brief x"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 4 + 3


def test_completions(shared: SimProc) -> None:
    out = shared.client.post("/v1/completions", json={"model": "m", "prompt": "red green", "max_tokens": 3}).json()
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == "red green red" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == 2 and out["usage"]["completion_tokens"] == 3
    body = {"prompt": "blue", "max_tokens": 2, "stream": True}
    with shared.client.stream("POST", "/v1/completions", json=body) as r:
        events = sse(r)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "blue blue"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_prefix_cache_and_flush(shared: SimProc) -> None:
    c = shared.client
    body = {"text": "cache probe one two three four", "sampling_params": {"max_new_tokens": 1}}
    assert c.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0
    assert c.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 5
    assert c.post("/flush_cache").status_code == 200
    r = c.get("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert c.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0


def test_metrics(shared: SimProc) -> None:
    shared.client.post("/generate", json={"text": "m e t", "sampling_params": {"max_new_tokens": 1}})
    r = shared.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("sglang:num_running_reqs", "sglang:token_usage", "sglang:cache_hit_rate", "sglang:num_queue_reqs"):
        assert f"# TYPE {name} gauge" in text
    prompt = re.search(r'^sglang:prompt_tokens_total\{.*model_name="qwen-sim".*\} (\S+)$', text, re.M)
    assert prompt and float(prompt.group(1)) >= 3


def test_request_errors(shared: SimProc) -> None:
    c = shared.client
    headers = {"content-type": "application/json"}
    assert c.post("/generate", content=b"{not json", headers=headers).status_code == 400
    assert c.post("/generate", json={"sampling_params": {}}).status_code == 400
    r = c.post("/v1/chat/completions", content=b"[", headers=headers)
    assert r.status_code == 400 and r.json()["object"] == "error"
    assert c.post("/v1/chat/completions", content=b'{"messages": []}', headers=headers).status_code == 400
    r = c.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400
    assert c.get("/no/such/path").status_code == 404
    assert c.get("/generate").status_code == 405
    assert c.get("/health").status_code == 200  # the server survived all of that
    assert '"GET /no/such/path HTTP/1.1" 404 Not Found' in shared.log()


def test_api_key_and_metrics_off(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--api-key", "sekret", "--skip-server-warmup")
    sim.wait_ready()
    c = sim.client
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    r = c.post("/generate", json=body)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert c.get("/v1/models").status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert c.post("/generate", json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert c.get("/health").status_code == 200 and c.get("/health_generate").status_code == 200
    assert c.get("/metrics").status_code == 404  # exempt from the key, but not enabled


# ------------------------------------------------------------------------------------------- signals, recording


def test_sigterm_drains_then_exits_0(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, env={"SGLSIM_TOKEN_SECONDS": "0.05"})
    sim.wait_ready()
    result: dict[str, Any] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"text": "slow", "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}, "stream": True}
        with (
            httpx.Client(base_url=sim.url, timeout=10.0, trust_env=False) as c,
            c.stream("POST", "/generate", json=body) as r,
        ):
            events = []
            for line in r.iter_lines():
                if line:
                    first_chunk.set()
                    events.append(line)
            result["events"] = events

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert first_chunk.wait(10)
        sim.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: sim.status("/health") == 503, 5.0, "/health -> 503 while draining")
    finally:
        worker.join(15)
    assert result["events"][-1] == "data: [DONE]" and len(result["events"]) == 21
    assert sim.wait_exit(30) == 0
    log = sim.log()
    positions_in_order(log, ["SIGTERM received.", "Gracefully exiting", "INFO:     Finished server process"])


def _tgkill(pid: int, tid: int, signum: int) -> None:
    """Send ``signum`` to one thread of ``pid`` (Linux's tgkill): where a process-directed signal lands when the
    kernel picks a thread other than the main one."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sys_tgkill = {"x86_64": 234, "aarch64": 131}[os.uname().machine]
    if libc.syscall(sys_tgkill, pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {signum})")


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="tgkill by syscall number")
@pytest.mark.parametrize("fault", ["", "hang"], ids=["serving", "hang-fault"])
def test_a_sigterm_that_lands_on_another_thread_still_shuts_it_down(launch: Launcher, fault: str) -> None:
    """The kernel may hand a process's SIGTERM to any of its threads (after a SIGCONT, the main thread may look
    busy with a pending signal). Python runs the handler on the main thread only when that thread runs: the
    engine's main thread must wake for it, or the engine would sleep through its shutdown until SIGKILL."""
    sim = launch(*CI_ARGS, env={"SGLSIM_FAULT": fault} if fault else None)
    if fault:
        sim.wait_log("Uvicorn running on")
    else:
        sim.wait_ready()
    # "Uvicorn running on" comes before the serving thread starts (uvicorn's order): wait for a thread besides the main
    others = wait_for(lambda: [t.id for t in psutil.Process(sim.proc.pid).threads() if t.id != sim.proc.pid], 30,
                      "a thread of the engine besides its main one")
    _tgkill(sim.proc.pid, others[0], signal.SIGTERM)
    assert sim.wait_exit(30) == 0  # without waking, the main thread sleeps on: no exit before a SIGKILL
    positions_in_order(sim.log(), ["SIGTERM received.", "Gracefully exiting", "INFO:     Finished server process"])


def test_recording(launch: Launcher, tmp_path: Path) -> None:
    record = tmp_path / "events.jsonl"
    env = {"SGLSIM_RECORD": str(record), "CUDA_VISIBLE_DEVICES": "2,3"}
    good = launch(*CI_ARGS, "--tp-size", "2", "--nccl-port", "45678", env=env)
    crashing = launch(*CI_ARGS, env={**env, "SGLSIM_FAULT": "crash_oom"})
    good.wait_ready()
    assert crashing.wait_exit() == -signal.SIGKILL
    good.proc.send_signal(signal.SIGTERM)
    assert good.wait_exit() == 0
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    mine = [e for e in lines if e["pid"] == good.proc.pid]
    assert [e["event"] for e in mine] == ["start", "ready", "exit"]
    for e in mine:
        assert (e["port"], e["nccl_port"], e["cuda_visible_devices"], e["model"]) == (good.port, 45678, "2,3", MODEL)
        assert e["tp_size"] == 2 and isinstance(e["time"], float)
    assert mine[0]["time"] <= mine[1]["time"] <= mine[2]["time"]
    assert mine[1]["startup_seconds"] > 0 and mine[2]["returncode"] == 0
    assert [e["event"] for e in lines if e["pid"] == crashing.proc.pid] == ["start"]


# ------------------------------------------------------------------------------------------- faults


ASSERT = ('RuntimeError: num_active_captures_ > 0 INTERNAL ASSERT FAILED at "/pytorch/c10/cuda/'
          'CUDACachingAllocator.cpp":2969, please report a bug to PyTorch. markCaptureEnd called with no captures '
          "in progress")


def test_fault_crash_oom(launch: Launcher) -> None:
    # the fault fires even with the prefill graph disabled, so that it can be used with the budget flags
    sim = launch(*CI_ARGS, env={"SGLSIM_FAULT": "crash_oom"})
    assert sim.wait_exit() == -signal.SIGKILL
    log = sim.log()
    # the layout of tests/data/logs/seed_prefill_capture_oom.log: the bar stops at the failing bucket (the 26th
    # from the top of 58), the breakable-graph context's own error record, then the scheduler's chained traceback
    positions_in_order(
        log,
        [
            "KV Cache is allocated.",
            "Capture target prefill CUDA graph begin.",
            "Capturing prefill shape (num_tokens=8192 avail_mem=",
            "Capturing prefill shape (num_tokens=704 avail_mem=",
            "| 25/58 [",
            f"] {ASSERT}\nFail when using backend: breakable for prefill runner.\nPossible suggestions:\n",
            "disable the prefill CUDA graph by --cuda-graph-backend-prefill=disabled",
            "] Scheduler hit an exception: Traceback (most recent call last):",
            "in capture_one_shape", "in capture_one", "in _end_current_segment", "in capture_end",
            "torch.AcceleratorError: CUDA error: out of memory",
            "During handling of the above exception, another exception occurred:",
            "in __exit__", "in _end_current_segment",
            ASSERT,
            "Received sigquit from a child process. It usually means the child failed.",
            f"kill_process_tree called: parent_pid={sim.proc.pid}, include_parent=True, pid={sim.proc.pid}",
        ],
    )
    assert "Capturing prefill shape (num_tokens=640" not in log
    assert "Uvicorn running" not in log and "Capture target prefill CUDA graph end" not in log


@pytest.mark.parametrize("how", ["fault", "tiny-fraction"])
def test_fault_kv_oom(launch: Launcher, how: str) -> None:
    if how == "fault":
        sim = launch(*CI_ARGS, env={"SGLSIM_FAULT": "kv_oom"})
        fraction = "0.6"
    else:
        sim = launch("--mem-fraction-static", "0.01")
        fraction = "0.01"
    assert sim.wait_exit() == 1
    positions_in_order(
        sim.log(),
        [
            "Load weight end.",
            "Scheduler hit an exception: Traceback (most recent call last):",
            "in init_target_memory_pool", "in alloc_memory_pool", "in configure", "in _resolve_memory_pool_config",
            "in _profile_available_bytes",
            f"Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static={fraction}.",
            "Received sigquit from a child process.",
            "kill_process_tree called: parent_pid=",
        ],
    )
    assert "KV Cache is allocated" not in sim.log()


def test_fault_exit_code(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, env={"SGLSIM_FAULT": "exit=3"})
    assert sim.wait_exit() == 3
    positions_in_order(sim.log(), ["Load weight begin", "Traceback (most recent call last):", "exit=3"])


def test_fault_hang(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, env={"SGLSIM_FAULT": "hang"})
    sim.wait_status("/v1/models", 200)
    time.sleep(0.5)  # well past the 0.03 s warmup this startup would take
    assert sim.status("/health") == 503 and sim.proc.poll() is None
    assert "fired up" not in sim.log()
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit(30) == 0


def test_fault_hang_before_bind(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, env={"SGLSIM_FAULT": "hang_before_bind"})
    sim.wait_log("max_total_num_tokens=")
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):
        sim.client.get("/health", timeout=1.0)
    assert sim.proc.poll() is None
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit(30) == 0


def test_fault_flood_to_files(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, env={"SGLSIM_FAULT": "flood=2"})
    sim.wait_ready(timeout=20)
    assert sim.out.stat().st_size >= 2 * 2**20
    assert sim.err.stat().st_size >= 2 * 2**20


def test_fault_ignore_sigterm(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "ignore_sigterm"})
    sim.wait_ready()
    sim.proc.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        sim.proc.wait(0.5)
    assert sim.status("/health") == 200
    sim.proc.kill()
    assert sim.wait_exit() == -signal.SIGKILL


def test_fault_shutdown_takes_its_seconds_then_exits_0(launch: Launcher) -> None:
    """sglang's clean shutdown takes seconds (its scheduler and detokenizer stop first): ``shutdown=S`` models it."""
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "shutdown=0.5"})
    sim.wait_ready()
    sent = time.monotonic()
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit() == 0
    assert time.monotonic() - sent >= 0.5


def test_fault_escape_child_survives_group_kill(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "escape_child"})
    sim.wait_ready()
    (pid,) = sim.escaped_pids()
    child = psutil.Process(pid)
    assert child.environ().get("SGLSIM_ESCAPED") == "1"
    assert os.getsid(pid) != os.getsid(sim.proc.pid) and os.getpgid(pid) != sim.proc.pid
    os.killpg(sim.proc.pid, signal.SIGKILL)  # the sim leads its own group (start_new_session)
    assert sim.wait_exit() == -signal.SIGKILL
    time.sleep(0.2)
    assert alive(pid), "the escaped child must survive a kill of its parent's process group"
    # the launcher's cleanup kills it by PID and checks that it is gone


def test_fault_die_after(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "die_after=2"})
    sim.wait_ready()
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    assert sim.client.post("/generate", json=body).status_code == 200
    for path in ("/health", "/v1/models", "/server_info", "/ping"):  # not counted
        assert sim.client.get(path).status_code == 200
    assert sim.proc.poll() is None
    assert sim.client.post("/v1/completions", json={"prompt": "y", "max_tokens": 1}).status_code == 200
    assert sim.wait_exit() == -signal.SIGKILL
    assert "simulated death after 2 requests" in sim.log()


def test_fault_slow_health(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "slow_health=0.4"})
    sim.wait_ready()
    tic = time.monotonic()
    assert sim.client.get("/health").status_code == 200
    assert time.monotonic() - tic >= 0.4


# ------------------------------------------------------------------------------------------- CLI documentation


def test_help_documents_every_fault_and_the_control_endpoint() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    out = result.stdout
    for name in (*simfaults.STARTUP_FAULTS, *simfaults.REQUEST_FAULTS):
        assert re.search(rf"^  {name}(=\S+)?\s", out, re.M), name
    for text in ("GET  /_sim/faults", "POST /_sim/faults", "X-SGLSim-Worker", "SGLSIM_GPU_FREE_MIB",
                 "SGLSIM_PD_WAIT_SECONDS"):
        assert text in out


def test_bad_fault_exits_2_with_one_line_on_stderr_and_in_the_log() -> None:
    result = run_cli("--model", MODEL, "--port", str(free_port()), env={"SGLSIM_FAULT": "latency=0.1,bogus=3"})
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "SGLSIM_FAULT: unknown fault 'bogus'" in line and "known: crash_oom, " in line and "trickle=..." in line
    assert line.split("error: ", 1)[1] in result.stdout
    result = run_cli("--model", MODEL, env={"SGLSIM_FAULT": "fail_rate=1.5"})
    assert result.returncode == 2 and "fault 'fail_rate' needs a number between 0 and 1, got '1.5'" in result.stderr


# ------------------------------------------------------------------------------------------- real tokens, logprobs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    """A sim over the tiny Llama's config and tokenizer (tokens for real when ``tokenizers`` is importable)."""
    yield from tiny_sim(tmp_path_factory, "tiny-sim")


def _needs_tokenizers() -> None:
    pytest.importorskip("tokenizers", reason="the sim tokenizes for real only with the tokenizers package")


def test_tiny_model_counts_tokens_like_the_real_engine(tiny: SimProc) -> None:
    _needs_tokenizers()
    c = tiny.client
    # the figures the real engine answered for this model (tests/sim/test_sim_differential.py compares them live)
    assert c.post("/tokenize", json={"prompt": "hello world"}).json() == {"tokens": [460, 377], "count": 2,
                                                                            "max_model_len": 512}
    assert c.post("/detokenize", json={"tokens": [5, 6, 7]}).json() == {"text": "#$%"}
    chat = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == 10  # the ChatML template's tokens
    out = c.post("/generate", json={"text": "x " * 100, "sampling_params": {"max_new_tokens": 3}}).json()
    assert out["meta_info"]["prompt_tokens"] == 200 and all(0 <= i < 512 for i in out["output_ids"])
    assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 512


def test_request_checks_of_the_real_engine(tiny: SimProc) -> None:
    c = tiny.client

    def error(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        r = c.post(path, json=body)
        return r.status_code, r.json()

    status, body = error("/generate", {"text": "x " * 600, "sampling_params": {"max_new_tokens": 2}})
    words = 600 if not load_model_dir(TINY, vocab_size=512, eos_token_id=2).vocab.real else 1200
    assert status == 400 and body == {"error": {"message": f"The input ({words} tokens) is longer than the model's "
                                                           "context length (512 tokens)."}}
    status, body = error("/generate", {"text": "x", "sampling_params": {"temperature": -1}})
    assert body["error"]["message"] == "temperature must be a non-negative finite number, got -1."
    status, body = error("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "temperature": -1})
    assert (status, body["type"], body["message"]) == (400, "BadRequestError",
                                                       "temperature must be a non-negative finite number, got -1.0.")
    status, body = error("/v1/completions", {"model": "m", "prompt": "hi", "logit_bias": {"9999": 1}})
    assert (status, body["message"]) == (400, "logit_bias must has keys in [0, 511], got 9999.")
    status, body = error("/v1/chat/completions", {"model": "m", "messages": []})
    assert (status, body["message"]) == (400, "Messages cannot be empty.")
    status, body = error("/v1/completions", {"model": "m"})
    assert status == 400 and body["type"] == "Bad Request" and body["message"].startswith("1 validation error")


def test_generate_logprobs(shared: SimProc) -> None:
    body = {"text": "alpha beta gamma", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3}}
    meta = shared.client.post("/generate", json=body).json()["meta_info"]
    assert [len(meta[k]) for k in ("input_token_logprobs", "output_token_logprobs")] == [3, 3]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    lp, token, text = meta["output_token_logprobs"][0]
    assert lp < 0 and isinstance(token, int) and text == "alpha"
    assert meta["output_top_logprobs"][0][0] == [lp, token, text]  # the chosen token is the top-1
    assert len(meta["output_top_logprobs"][0]) == 2 and meta["output_top_logprobs"][0][1][0] < lp
    assert meta["output_token_logprobs_length"] == 3
    again = shared.client.post("/generate", json=body).json()["meta_info"]
    assert again["output_token_logprobs"] == meta["output_token_logprobs"]  # deterministic, seeded by the prompt
    plain = shared.client.post("/generate", json={**body, "logprob_start_len": None, "top_logprobs_num": 0,
                                                  "return_text_in_logprobs": False}).json()["meta_info"]
    assert plain["input_token_logprobs"] == [] and "input_top_logprobs" not in plain
    assert plain["output_token_logprobs"][0][2] is None


def test_openai_logprobs(shared: SimProc) -> None:
    c = shared.client
    chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2,
                                                "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["a", "b"] and content[0]["bytes"] == [97]
    assert len(content[0]["top_logprobs"]) == 2 and set(content[0]["top_logprobs"][0]) == {"token", "bytes", "logprob"}
    done = c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "logprobs": 1, "echo": True}).json()
    probs = done["choices"][0]["logprobs"]
    assert probs["tokens"] == ["a", "b", "a", "b"] and probs["token_logprobs"][0] is None
    assert probs["text_offset"] == [-1] * 4 and probs["top_logprobs"][0] is None and len(probs["top_logprobs"]) == 4


def test_more_endpoints(shared: SimProc) -> None:
    c = shared.client
    score = c.post("/v1/score", json={"query": "q", "items": ["a", "b"], "label_token_ids": [5, 6]}).json()
    assert score["object"] == "scoring" and len(score["scores"]) == 2 and all(0 < p < 1 for p in score["scores"][0])
    resp = c.post("/v1/responses", json={"model": "m", "input": "one two", "max_output_tokens": 2}).json()
    assert resp["object"] == "response" and resp["output"][0]["content"][0]["text"] == "one two"
    assert resp["usage"]["output_tokens"] == 2
    r = c.post("/v1/embeddings", json={"model": "m", "input": "hi"})
    assert r.status_code == 400 and "--is-embedding" in r.json()["message"]
    assert c.post("/encode", json={"text": "hi"}).json()["error"]["message"].startswith("This model does not appear")


def test_embedding_model(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--is-embedding", model=TINY)
    sim.wait_ready()
    c = sim.client
    out = c.post("/v1/embeddings", json={"model": "m", "input": ["a", "b c"]}).json()
    assert [len(d["embedding"]) for d in out["data"]] == [64, 64] and out["object"] == "list"
    assert abs(sum(x * x for x in out["data"][0]["embedding"]) - 1) < 1e-3  # normalized, like the real pooler
    assert c.post("/v1/embeddings", json={"model": "m", "input": ["a", "b c"]}).json()["data"] == out["data"]
    b64 = c.post("/v1/embeddings", json={"model": "m", "input": "a", "encoding_format": "base64"}).json()
    assert isinstance(b64["data"][0]["embedding"], str)
    enc = c.post("/encode", json={"text": "a"}).json()
    assert len(enc["embedding"]) == 64 and enc["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert c.get("/model_info").json()["is_generation"] is False
    r = c.post("/generate", json={"text": "x"})
    assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------- request faults


def test_worker_header_and_http2_probe(shared: SimProc) -> None:
    r = shared.client.get("/health")
    assert r.headers["x-sglsim-worker"] == f"{shared.port}/{shared.proc.pid}"
    with socket.create_connection(("127.0.0.1", shared.port), timeout=5) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 404 ") and b"HTTP/1.1 400 Bad Request" in data
    assert b"Invalid HTTP request received." in data
    assert '"PRI %2A HTTP/2.0" 404 Not Found' in shared.wait_log("PRI %2A")


def test_request_faults_at_run_time(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "fail_first=1"})
    sim.wait_ready()
    c = sim.client
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    r = c.post("/generate", json=body)
    assert r.status_code == 500 and r.json()["type"] == "500" and "fail_first=1" in r.json()["message"]
    assert c.post("/generate", json=body).status_code == 200
    state = c.get("/_sim/faults").json()
    assert state["worker"] == f"{sim.port}/{sim.proc.pid}" and state["faults"]["fail_first"] == 1
    # switch: every request answers 503, after 0.2 s of latency
    assert c.post("/_sim/faults", json={"status": 503, "latency": 0.2, "fail_first": None}).status_code == 200
    tic = time.monotonic()
    assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 503
    assert time.monotonic() - tic >= 0.2
    assert c.get("/health").status_code == 200  # health is not an inference request
    # a deterministic fraction
    c.post("/_sim/faults", json={"reset": True, "spec": "fail_rate=0.5,fail_seed=7"})
    first = [c.post("/generate", json=body).status_code for _ in range(12)]
    c.post("/_sim/faults", json={"reset": True, "spec": "fail_rate=0.5,fail_seed=7"})
    assert [c.post("/generate", json=body).status_code for _ in range(12)] == first and {200, 500} == set(first)
    # an API key from now on; health and the control endpoint stay open
    c.post("/_sim/faults", json={"reset": True, "api_key": "k2"})
    assert c.post("/generate", json=body).status_code == 401
    assert c.post("/generate", json=body, headers={"Authorization": "Bearer k2"}).status_code == 200
    assert c.get("/health").status_code == 200
    # payload limit: 413 like a proxy in front of the server would (sglang and uvicorn have none)
    c.post("/_sim/faults", json={"reset": True, "max_payload": 64})
    r = c.post("/generate", json={"text": "y" * 200})
    assert r.status_code == 413 and r.json()["code"] == 413
    assert c.post("/generate", json=body).status_code == 200
    # health fails from now on, then not
    c.post("/_sim/faults", json={"reset": True, "health_fail": True})
    assert c.get("/health").status_code == 503 and c.get("/health_generate").status_code == 503
    c.post("/_sim/faults", json={"health_fail": None})
    assert c.get("/health").status_code == 200
    # a bad body changes nothing and says why
    r = c.post("/_sim/faults", json={"crash_oom": True})
    assert r.status_code == 400 and "startup fault" in r.json()["error"]
    r = c.post("/_sim/faults", json={"latency": "soon"})
    assert r.status_code == 400 and "fault 'latency' needs a non-negative number of seconds" in r.json()["error"]
    assert c.get("/_sim/faults").json()["faults"]["latency"] == 0.0


def test_hang_request_and_health_fail_after(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", env={"SGLSIM_FAULT": "hang_request=2,health_fail_after=0.5"})
    sim.wait_ready()
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    assert sim.client.post("/generate", json=body).status_code == 200
    with pytest.raises(httpx.ReadTimeout):
        sim.client.post("/generate", json=body, timeout=0.5)
    assert sim.client.post("/generate", json=body).status_code == 200
    wait_for(lambda: sim.status("/health") == 503, 30.0, "/health -> 503 after 0.5 s")


def test_trickled_health_still_passes_the_plugins_readiness_wait(tmp_path: Path) -> None:
    from pytest_sglworker.engine.specs import ModelSpec
    from pytest_sglworker.workers.launcher import LaunchOptions, sim_launcher, spawn_worker

    options = LaunchOptions(launcher=tuple(sim_launcher()), log_dir=tmp_path / "logs", lock_dir=tmp_path / "locks",
                            startup_timeout=60)
    spec = ModelSpec(name="qwen-trickle", model=MODEL, memory_gb=1)
    tic = time.monotonic()
    with spawn_worker(spec, options=options, env={"SGLSIM_STARTUP_SECONDS": "0.1",
                                                  "SGLSIM_FAULT": "trickle=0.005"}) as worker:
        assert worker.is_alive()
        assert time.monotonic() - tic > 0.5  # the health answers really were trickled



def test_the_simulated_startup_counts_from_the_process_s_start(tmp_path: Path) -> None:
    # SGLSIM_STARTUP_SECONDS is the whole time to ready, as a real server's startup includes its interpreter and
    # imports: a process that took 2 s to reach the sim's main is ready at once (no warmup asked), where the sim
    # used to sleep its 2 s startup on top
    code = ("import time; time.sleep(0.3); from pytest_sglworker.sim.main import process_age; "
            "print(process_age())")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    age = float(out.stdout)
    assert 0.3 <= age <= time.monotonic() - started + 0.02, (age, out.stderr)  # /proc's clock ticks: 10 ms
    record, port = tmp_path / "record.jsonl", free_port()
    slow_start = ("import runpy, sys, time; time.sleep(2.0); sys.argv[0] = 'sim'; "
                  "runpy.run_module('pytest_sglworker.sim', run_name='__main__')")
    env = {**os.environ, "SGLSIM_STARTUP_SECONDS": "2.0", "SGLSIM_WARMUP_SECONDS": "0", "SGLSIM_RECORD": str(record)}
    proc = subprocess.Popen([sys.executable, "-c", slow_start, "--model-path", MODEL, "--port", str(port), *CI_ARGS],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def ready() -> dict[str, Any] | None:
            events = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
            return next((e for e in events if e.get("event") == "ready"), None)

        event = wait_for(ready, 60, "the sim's ready event")
        assert event["startup_seconds"] < 1.0, event  # counted from main(): the 70 % before binding was spent
    finally:
        proc.kill()
        proc.wait(30)
    assert not alive(proc.pid)
