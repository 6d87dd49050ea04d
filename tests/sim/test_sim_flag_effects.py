"""Server flags of ``docs/SIM_FLAGS.md`` that the simulated engine acts on, each held by a test of its own: what a
client (or the startup log a person reads) sees with the flag and without it. sglang 0.5.23's own behaviour is what
the sim's code cites (``pytest_sglworker/sim``); ``tests/data/sim/server_flags_real.json`` recorded none of these on
the real CPU engine, so they are the sim's alone here. Real subprocesses on loopback; nothing left running."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sim_procs import CI_ARGS, TINY, Launcher, SimProc, sse, wait_for

from pytest_sglworker.engine.sglang_facts import decode_capture_sizes


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    pytest.importorskip("tokenizers", reason="the tiny Llama's prompts are tokenized with tokenizers")
    launcher = Launcher(tmp_path_factory.mktemp("flag-effects"))
    try:
        yield launcher
    finally:
        launcher.cleanup()


def _sim(launcher: Callable[..., SimProc], *flags: str, env: dict[str, str] | None = None) -> SimProc:
    sim = launcher(*CI_ARGS, "--skip-server-warmup", "--max-total-tokens", "1024", *flags, model=TINY, env=env)
    sim.wait_ready()
    return sim


@pytest.fixture(scope="module")
def plain(launcher: Launcher) -> SimProc:
    return _sim(launcher)


@pytest.fixture
def launch(launcher: Launcher) -> Iterator[Callable[..., SimProc]]:
    """The module's launcher for one test: what the test started is stopped at its end."""
    started: list[SimProc] = []

    def start(*args: str, **kwargs: Any) -> SimProc:
        started.append(launcher(*args, **kwargs))
        return started[-1]

    yield start
    for sim in started:
        if sim.proc.poll() is None:
            sim.proc.terminate()
            sim.wait_exit(15)


def _chat(sim: SimProc, **body: Any) -> httpx.Response:
    return sim.client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hello there"}], **body})


def _generate(sim: SimProc, **body: Any) -> tuple[int, Any]:
    r = sim.client.post("/generate", json=body)
    return r.status_code, r.json()


def test_allow_auto_truncate_lifts_the_refusal_of_a_long_max_tokens(launch: Callable[..., SimProc]) -> None:
    strict = _sim(launch, "--context-length", "64")
    refused = _chat(strict, max_tokens=100)
    assert refused.status_code == 400
    assert "max_completion_tokens is too large: 100.This model supports at most 64" in refused.text
    lenient = _sim(launch, "--context-length", "64", "--allow-auto-truncate")
    served = _chat(lenient, max_tokens=100, ignore_eos=True)
    assert served.status_code == 200, served.text
    usage = served.json()["usage"]  # sglang truncates max_new_tokens to what the context leaves
    assert usage["completion_tokens"] == 64 - usage["prompt_tokens"] > 0
    status, body = _generate(lenient, text="word " * 100, sampling_params={"max_new_tokens": 8})
    # the input cut to the context length (no room left to generate), then to the scheduler's longest input
    assert status == 200 and 0 < body["meta_info"]["prompt_tokens"] < 64, body
    assert body["meta_info"]["completion_tokens"] == 0 and body["meta_info"]["finish_reason"]["length"] == 0
    assert _generate(strict, text="word " * 100, sampling_params={"max_new_tokens": 8})[0] == 400


def test_base_gpu_id_past_the_visible_gpus_is_refused_as_tp_size_is(launch: Callable[..., SimProc]) -> None:
    sim = launch(*CI_ARGS, "--base-gpu-id", "1", model=TINY, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert sim.wait_exit(30) == 1
    log = sim.log()
    assert "invalid device ordinal" in log and "--base-gpu-id=1" in log
    fits = launch(*CI_ARGS, "--base-gpu-id", "1", "--skip-server-warmup", model=TINY,
                    env={"CUDA_VISIBLE_DEVICES": "0,1"})
    fits.wait_ready()


def _decode_capture_sizes(log: str) -> list[int]:
    return [int(bs) for bs in re.findall(r"Capturing batches \(bs=(\d+) ", log)]


def test_cuda_graph_max_bs_decode_bounds_the_captured_batch_sizes(launch: Callable[..., SimProc],
                                                                  plain: SimProc) -> None:
    bounded = _sim(launch, "--cuda-graph-max-bs-decode", "12")
    sizes = _decode_capture_sizes(bounded.log())
    assert sizes[:-1] == sorted(decode_capture_sizes(12), reverse=True) == [12, 8, 4, 2, 1]
    assert max(_decode_capture_sizes(plain.log())) > 12  # the card's default is larger


def test_disable_cuda_graph_warns_of_its_deprecation_and_captures_nothing(launch: Callable[..., SimProc],
                                                                          plain: SimProc) -> None:
    sim = _sim(launch, "--disable-cuda-graph")
    log = sim.log()
    assert "'--disable-cuda-graph' is deprecated and will be removed in a future release." in log
    assert "Capture target decode CUDA graph begin" not in log and not _decode_capture_sizes(log)
    assert "Capture target decode CUDA graph begin" in plain.log()


@pytest.mark.parametrize("flag", ["--prefill-attention-backend", "--decode-attention-backend"])
def test_a_triton_prefill_or_decode_backend_on_the_cpu_dies_as_the_attention_backend(launch: Callable[..., SimProc],
                                                                                     flag: str) -> None:
    """As ``--attention-backend triton --device cpu`` (tests/sim/test_sim_server_flags.py): the real engine binds
    and its scheduler dies at the first forward pass, here the warmup request."""
    sim = launch(*CI_ARGS, "--max-total-tokens", "1024", "--device", "cpu", flag, "triton", model=TINY)
    assert sim.wait_exit(60) == -9
    assert "RuntimeError: 0 active drivers ([]). There should only be one." in sim.log()


def test_hierarchical_cache_says_its_host_memory(launch: Callable[..., SimProc], plain: SimProc) -> None:
    def start(*flags: str) -> SimProc:  # the card's whole KV pool (not _sim's 1024 tokens): gigabytes
        sim = launch(*CI_ARGS, "--skip-server-warmup", "--enable-hierarchical-cache", *flags, model=TINY)
        sim.wait_ready()
        return sim

    once = start("--hicache-ratio", "3").log()
    line = re.search(r"Allocating ([0-9.]+) GB host memory for hierarchical KV cache\.", once)
    assert line is not None and float(line.group(1)) > 0
    doubled = start("--hicache-ratio", "6")
    again = re.search(r"Allocating ([0-9.]+) GB host memory", doubled.log())
    assert again is not None and float(again.group(1)) == pytest.approx(2 * float(line.group(1)), rel=0.02)
    assert "hierarchical KV cache" not in plain.log()


def test_host_is_the_address_it_binds(launch: Callable[..., SimProc]) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup", "--host", "127.0.0.2", model=TINY)
    sim.wait_log(f"Uvicorn running on http://127.0.0.2:{sim.port}")
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        wait_for(lambda: client.get(f"http://127.0.0.2:{sim.port}/health").status_code == 200, 10, "health")
        with pytest.raises(httpx.ConnectError):
            client.get(f"http://127.0.0.1:{sim.port}/health")


def test_a_kv_events_config_that_is_not_json_ends_the_startup(launch: Callable[..., SimProc]) -> None:
    sim = launch(*CI_ARGS, "--kv-events-config", "{not json", model=TINY)
    assert sim.wait_exit(30) == 1
    assert "json.decoder.JSONDecodeError" in sim.log()
    _sim(launch, "--kv-events-config", '{"publisher": "null"}')  # JSON: it starts


def test_max_prefill_tokens_in_server_info_and_the_startup_log(launch: Callable[..., SimProc], plain: SimProc) -> None:
    sim = _sim(launch, "--max-prefill-tokens", "4096")
    assert sim.client.get("/server_info").json()["max_prefill_tokens"] == 4096
    assert "max_prefill_tokens=4096," in sim.log()
    assert plain.client.get("/server_info").json()["max_prefill_tokens"] == 16384  # sglang's default


def _usage_chunks(sim: SimProc, **body: Any) -> list[Any]:
    r = _chat(sim, max_tokens=3, stream=True, **body)
    return [e for e in sse(r) if e != "[DONE]" and e.get("usage")]


def test_stream_response_default_include_usage_ends_a_stream_with_its_usage(launch: Callable[..., SimProc],
                                                                            plain: SimProc) -> None:
    sim = _sim(launch, "--stream-response-default-include-usage")
    (last,) = _usage_chunks(sim)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert _usage_chunks(plain) == []  # without the flag: only when the request asks for it
    assert len(_usage_chunks(plain, stream_options={"include_usage": True})) == 1


def test_smg_grpc_mode_serves_grpc_and_its_http_sidecar(launch: Callable[..., SimProc]) -> None:
    pytest.importorskip("grpc", reason="the sim's gRPC mode needs grpcio (pytest-sglworker[grpc])")
    from sim_procs import free_port

    sidecar = free_port()
    sim = launch(*CI_ARGS, "--skip-server-warmup", "--smg-grpc-mode", "--smg-http-sidecar-port", str(sidecar),
                   model=TINY)
    sim.wait_log(f"HTTP sidecar server started on http://127.0.0.1:{sidecar}", timeout=30)
    sim.wait_log(f"gRPC server listening on 127.0.0.1:{sim.port}", timeout=30)
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        assert client.get(f"http://127.0.0.1:{sidecar}/health").status_code == 404  # the sidecar has no health
        assert client.post(f"http://127.0.0.1:{sidecar}/start_profile").status_code == 200
