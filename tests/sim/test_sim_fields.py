"""Request options of sglang 0.5.23 the simulated engine honours as the real engine does (each found different
by ``test_sim_fidelity.py``, which compares every field live; these hold the sim to what the real engine
answered, without it): refusals of what the server was not launched for, the chat adapter's refusals, the error
event of a ``/generate`` stream, msgspec's refusal of an unknown sampling key, token ids and meta info in OpenAI
answers, usage in every streamed chunk, ``n: 0``, a batch's own sampling params, stop regexes and stop token ids
on the OpenAI endpoints, the flat raw top logprobs, ``token_ids_logprob``, the sampling mask and a beam search's
answer. The tiny Llama's tokenizer, real subprocesses, nothing left running."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sim_procs import SimProc, sse, tiny_sim

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True}
COMPLETION = {"model": "m", "prompt": "hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
GENERATE = {"text": "hello there", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
#: the tiny Llama's tokens of "hello there" (the real engine's /tokenize)
HELLO_THERE = [460, 268, 273]
LORA = ("LoRA adapter 'some-adapter' was requested, but LoRA is not enabled. Please launch the server with "
        "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
HIDDEN = ("The server is not configured to return hidden states. Please set `--return-hidden-states-mode last`, "
          "`--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    pytest.importorskip("tokenizers", reason="the tiny Llama's prompts are tokenized with tokenizers")
    yield from tiny_sim(tmp_path_factory, "fields-tiny")


def _post(sim: SimProc, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = sim.client.post(path, json=body)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return r.status_code, sse(r)
    return r.status_code, r.json()


def test_what_the_server_was_not_launched_for_is_refused(tiny: SimProc) -> None:
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        for extra, message in (({"lora_path": "some-adapter"}, LORA), ({"return_hidden_states": True}, HIDDEN),
                               ({"routed_dp_rank": 3}, "routed_dp_rank=3 out of range [0, 1)"),
                               ({"watermark": {"enabled": True}},
                                "request watermarking requires the server to enable --enable-watermark")):
            for stream in (False, True):
                status, body = _post(tiny, path, {**base, **extra, "stream": stream})
                assert (status, body["message"], body["type"]) == (400, message, "BadRequestError"), (path, extra)
    status, body = _post(tiny, "/generate", {**GENERATE, "custom_logit_processor": "{}"})
    assert status == 400 and body["error"]["message"].startswith("The server is not configured to enable custom")
    status, body = _post(tiny, "/generate", {**GENERATE, "max_thinking_tokens": 2})
    assert body == {"error": {"message": "max_thinking_tokens requires the server to be launched with "
                                         "--enable-strict-thinking"}}


def test_a_generate_stream_carries_its_refusal_as_an_error_event(tiny: SimProc) -> None:
    status, events = _post(tiny, "/generate", {**GENERATE, "lora_path": "some-adapter", "stream": True})
    assert status == 200
    assert events == [{"error": {"message": LORA, "type": "invalid_request_error", "code": 400, "retryable": False}},
                      "[DONE]"]
    status, events = _post(tiny, "/generate", {"sampling_params": {"temperature": -1}, "text": "x", "stream": True})
    assert status == 200 and events[0]["error"]["message"] == "temperature must be a non-negative finite number, " \
                                                              "got -1."
    # a session the server does not know: the scheduler's abort, in its one chunk
    status, events = _post(tiny, "/generate", {**GENERATE, "session_params": {"id": "nope"}, "stream": True})
    assert status == 200 and events[0]["meta_info"]["finish_reason"]["message"] == (
        "Invalid request: session id nope does not exist")


def test_an_unknown_sampling_key_is_msgspecs_400_streamed_or_not(tiny: SimProc) -> None:
    for stream in (False, True):
        status, body = _post(tiny, "/generate", {**GENERATE, "sampling_params": {"stop_strs": ["x"]},
                                                 "stream": stream})
        assert status == 400
        assert body["error"].startswith("unknown field `stop_strs`, expected one of `max_new_tokens`, `stop`, ")
        assert body["error"].endswith("`beam_width`, `watermark`, `choice`")


def test_the_chat_adapters_refusals(tiny: SimProc) -> None:
    status, body = _post(tiny, "/v1/chat/completions", {**CHAT, "return_token_ids": True, "stream": True})
    assert (status, body["type"]) == (400, "BadRequest")
    assert body["message"].startswith("return_token_ids is not supported with streaming on /v1/chat/completions.")
    status, body = _post(tiny, "/v1/chat/completions", {**CHAT, "tool_choice": "required"})
    assert (status, body["message"]) == (400, "Tools cannot be empty if tool choice is set to required.")
    status, body = _post(tiny, "/v1/chat/completions", {**CHAT, "return_sampling_mask": True})
    assert (status, body["message"]) == (400, "return_sampling_mask requires return_meta_info=true.")


def test_token_ids_and_meta_info_in_openai_answers(tiny: SimProc) -> None:
    _, body = _post(tiny, "/v1/completions", {**COMPLETION, "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == HELLO_THERE and len(choice["token_ids"]) == 3
    _, events = _post(tiny, "/v1/completions", {**COMPLETION, "return_token_ids": True, "stream": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == HELLO_THERE
    assert [len(e["choices"][0]["token_ids"]) for e in events[:-1]] == [1, 1, 1]
    _, body = _post(tiny, "/v1/chat/completions", {**CHAT, "return_token_ids": True, "return_meta_info": True,
                                                   "return_input_ids_in_sglext": True,
                                                   "return_output_ids_in_sglext": True})
    choice = body["choices"][0]
    assert len(choice["response_token_ids"]) == 3 and choice["prompt_token_ids"] == body["sglext"]["input_ids"]
    assert body["sglext"]["output_ids"] == [choice["response_token_ids"]]
    assert choice["meta_info"]["completion_tokens"] == 3 and choice["meta_info"]["finish_reason"]["type"] == "length"
    _, events = _post(tiny, "/v1/chat/completions", {**CHAT, "return_output_ids_in_sglext": True, "stream": True})
    assert events[-2]["choices"] == [] and events[-2]["usage"] is None and len(events[-2]["sglext"]["output_ids"][0])
    _, body = _post(tiny, "/generate", {**GENERATE, "return_prompt_token_ids": True})
    assert body["prompt_token_ids"] == HELLO_THERE


def test_continuous_usage_stats_put_usage_in_every_content_chunk(tiny: SimProc) -> None:
    options = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, events = _post(tiny, "/v1/chat/completions", {**CHAT, **options})
    content = [e for e in events[:-1] if e["choices"] and "content" in e["choices"][0]["delta"]
               and "role" not in e["choices"][0]["delta"]]
    assert [e["usage"]["completion_tokens"] for e in content] == [1, 2, 3]
    _, events = _post(tiny, "/v1/completions", {**COMPLETION, **options})
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 3]


def test_n_zero_is_sglangs_range_error_unless_streamed(tiny: SimProc) -> None:
    status, body = _post(tiny, "/v1/completions", {**COMPLETION, "n": 0})
    assert (status, body["message"], body["type"]) == (400, "range() arg 3 must not be zero", "BadRequest")
    status, events = _post(tiny, "/v1/completions", {**COMPLETION, "n": 0, "stream": True})
    assert status == 200 and {e["choices"][0]["index"] for e in events[:-1]} == {0}


def test_a_batch_gives_each_prompt_its_own_sampling_params(tiny: SimProc) -> None:
    _, body = _post(tiny, "/generate", {"text": ["a b", "c"], "sampling_params": [
        {"max_new_tokens": 1, "ignore_eos": True}, {"max_new_tokens": 2, "ignore_eos": True}]})
    assert [b["meta_info"]["completion_tokens"] for b in body] == [1, 2]


def test_stop_regex_and_stop_token_ids_end_openai_generations(tiny: SimProc) -> None:
    # the sim echoes the prompt: "hello there hello there ..."
    _, body = _post(tiny, "/v1/completions", {**COMPLETION, "max_tokens": 8, "stop_regex": "th[a-z]+"})
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["matched_stop"]) == ("stop", "th[a-z]+")
    _, body = _post(tiny, "/v1/completions", {**COMPLETION, "max_tokens": 8, "stop_token_ids": [273],
                                              "ignore_eos": False})
    assert body["choices"][0]["matched_stop"] == 273 and body["usage"]["completion_tokens"] == 3
    _, body = _post(tiny, "/generate", {"text": "hello there", "sampling_params": {
        "max_new_tokens": 8, "stop_regex": ["zz", "th[a-z]+"]}})
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "th[a-z]+"}


def test_logprob_extras_of_generate(tiny: SimProc) -> None:
    lp = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    _, body = _post(tiny, "/generate", {**GENERATE, **lp, "return_flat_raw_top_logprobs": True,
                                        "return_flat_raw_output_top_logprobs": True})
    meta = body["meta_info"]
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
    assert (meta["input_top_logprobs_shape"], meta["input_top_logprobs_null_prefix"]) == ([2, 2], 1)
    assert meta["output_top_logprobs_shape"] == [3, 2] and len(meta["output_top_logprobs_idx_flat"]) == 6
    _, body = _post(tiny, "/generate", {**GENERATE, **lp, "return_flat_raw_top_logprobs": True,
                                        "return_flat_raw_top_logprobs_b64": True})
    assert body["meta_info"]["input_top_logprobs_val_flat_b64_dtype"] == "float32"
    status, body = _post(tiny, "/generate", {**GENERATE, "return_flat_raw_top_logprobs_b64": True})
    assert status == 400 and body["error"]["message"].startswith("return_flat_raw_top_logprobs_b64 requires")
    _, body = _post(tiny, "/generate", {**GENERATE, "return_logprob": True, "logprob_start_len": 1,
                                        "token_ids_logprob": [5, 6], "return_sampling_mask": True})
    meta = body["meta_info"]
    assert [e[0] is None for e in meta["input_token_logprobs"]] == [True, False]  # the first reported one: null
    assert [[t for _, t, _ in step] for step in meta["output_token_ids_logprobs"]] == [[5, 6]] * 3
    assert meta["output_token_sampling_mask"] == [[t] for t in body["output_ids"]]
    _, body = _post(tiny, "/generate", {**GENERATE, "sampling_params": {**GENERATE["sampling_params"],
                                                                         "beam_width": 2}})
    assert isinstance(body["meta_info"]["sequence_score"], float) and len(body["meta_info"]["beam_results"]) == 1


def test_greedy_requests_take_any_top_k(tiny: SimProc) -> None:
    # sglang's normalization: temperature 0 samples the top token, whatever top_k says
    assert _post(tiny, "/generate", {**GENERATE, "sampling_params": {"temperature": 0, "top_k": 0}})[0] == 200
    status, body = _post(tiny, "/generate", {**GENERATE, "sampling_params": {"temperature": 0.5, "top_k": 0}})
    assert status == 400 and body["error"]["message"] == "top_k must be -1 (disable) or at least 1, got 0."


def test_detokenize_takes_batches_and_answers_a_bad_id_with_sglangs_500(tiny: SimProc) -> None:
    # upstream's test_srt_endpoint.py::TestTokenizeDetokenize::test_detokenize_invalid_tokens: 400, then 500
    assert _post(tiny, "/detokenize", {"tokens": ["a", "b"]})[0] == 400
    status, body = _post(tiny, "/detokenize", {"tokens": [1, -1, 2]})
    assert (status, body["type"]) == (500, "InternalServerError")
    assert body["message"].startswith("Internal server error during detokenization: ")
    status, body = _post(tiny, "/detokenize", {"tokens": [HELLO_THERE, HELLO_THERE[:1]]})
    assert status == 200 and body["text"] == ["hello there", "hello"]
    assert tiny.status("/health") == 200


def test_token_ids_logprob_is_a_flat_list_of_ids_in_the_vocabulary(tiny: SimProc) -> None:
    asks = {"return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    status, body = _post(tiny, "/generate", {"text": "hi", **asks, "token_ids_logprob": [-1]})
    assert (status, body["error"]["message"]) == (400, "token_ids_logprob contains out-of-vocabulary token id -1; "
                                                       "valid range is [0, 512).")
    status, body = _post(tiny, "/generate", {"text": "hi", **asks, "token_ids_logprob": [[0]]})
    assert (status, body["error"]["message"]) == (400, "token_ids_logprob must be a flat list of integers.")
    status, body = _post(tiny, "/generate", {"text": ["hi", "hi"], **asks, "token_ids_logprob": [[0], [600]]})
    assert status == 400 and "out-of-vocabulary token id 600" in body["error"]["message"]
    assert _post(tiny, "/generate", {"text": ["hi", "hi"], **asks, "token_ids_logprob": [[0], [1]]})[0] == 200

