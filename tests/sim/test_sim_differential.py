"""The simulated engine against the real one: one corpus of requests, both answers compared.

One launch of the real sglang 0.5.23 on the CPU with the tiny random-weight model (the recipe of
:func:`cpu_engine_spec`) and, started at the same time, one of it with ``--is-embedding``; one simulated
engine for each, over the same model directory (``real_pair.py``; started once per session by ``conftest.py``'s
``servers``, which ``test_sim_fidelity.py`` shares). Every request of :data:`CORPUS` goes to both; what is
compared is the status code, the content type, the error envelope (and its message where the sim claims
the same text), and the *shape* of every JSON object and stream chunk: its keys, recursively, and the type
of every value (:func:`shape`), never the generated text. Token counts, ``/tokenize`` and ``max_model_len``
are compared by value: the sim reads the same ``tokenizer.json`` and ``config.json``.

Known differences, left out of the comparison on purpose (each names why):

- ``response_sent_to_client_ts`` in ``/generate`` stream chunks: the real engine adds it to whichever chunks
  happen to go out before the final one, which depends on timing.
- ``/v1/responses``: the real CPU install lacks ``openai_harmony``, so the real server answers 500; the sim
  answers the Responses shape of ``srt/entrypoints/openai/protocol.py``.
- Generation requests on the embedding model: the real scheduler crashes on them (``'LogitsProcessorOutput'
  object has no attribute 'embeddings'``), which would end the module's engine; the sim answers 400.
- Out-of-vocab ``input_ids``: the real scheduler crashes on them too; not in the corpus.
- ``GET /get_load``: 0.5.23 answers 404 (it serves ``/v1/loads`` only); the sim serves the legacy shape for the
  routers that still poll it (sglang-router 0.3.2). Not in the corpus; ``/v1/loads`` is.
- Constrained decoding: the values differ (xgrammar lets the random-weight model emit any JSON whitespace, the
  sim's JSON is compact; a grammar xgrammar cannot parse is described in xgrammar's words, the sim names
  Python's reason in the same frame), so only the shapes, statuses and the messages sglang writes itself are
  compared.

Run: ``pytest tests/sim/test_sim_differential.py -m real_engine`` (skipped without the real engine).
"""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import httpx
import pytest
from real_pair import Case, Pair, compare, send

pytestmark = [pytest.mark.real_engine, pytest.mark.xdist_group("real-engine")]


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def _message(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            **extra}


GREEDY = {"temperature": 0, "ignore_eos": True}
CORPUS: list[Case] = [
    # health and info
    Case("health", "GET", "/health"),
    Case("health_generate", "GET", "/health_generate"),
    Case("ping", "GET", "/ping"),
    Case("model_info", "GET", "/model_info", values=("is_generation", "model_type", "architectures")),
    Case("get_model_info", "GET", "/get_model_info"),
    Case("models", "GET", "/v1/models", values=("data.0.max_model_len",)),
    Case("model_card_missing", "GET", "/v1/models/other", message=True),
    Case("metrics_off", "GET", "/metrics"),
    Case("no_such_path", "GET", "/no/such/path"),
    Case("wrong_method", "GET", "/generate"),
    Case("flush_cache_get", "GET", "/flush_cache"),
    # /generate
    Case("generate_text", "POST", "/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 3,
                                                                                            **GREEDY}},
         values=("meta_info.prompt_tokens", "meta_info.completion_tokens", "meta_info.finish_reason")),
    Case("generate_ids", "POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2,
                                                                                             **GREEDY}},
         values=("meta_info.prompt_tokens",)),
    Case("generate_batch", "POST", "/generate", {"text": ["a b", "c"], "sampling_params": {"max_new_tokens": 2,
                                                                                             **GREEDY}}),
    Case("generate_stream", "POST", "/generate", {"text": "hello world", "stream": True,
                                                   "sampling_params": {"max_new_tokens": 3, **GREEDY}}),
    Case("generate_logprobs", "POST", "/generate", {"text": "hello world", "return_logprob": True,
                                                     "sampling_params": {"max_new_tokens": 2, **GREEDY}}),
    Case("generate_top_logprobs", "POST", "/generate", {
        "text": "hello world", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
        "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2, **GREEDY}}),
    Case("generate_logprobs_batch_ids", "POST", "/generate", {
        "input_ids": [[1, 5, 9, 20, 30]], "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 3, **GREEDY}}),
    Case("generate_logprobs_stream", "POST", "/generate", {
        "text": "hello", "return_logprob": True, "top_logprobs_num": 1, "stream": True,
        "sampling_params": {"max_new_tokens": 2, **GREEDY}}),
    Case("generate_no_input", "POST", "/generate", {"sampling_params": {}}, message=True),
    Case("generate_bad_json", "POST", "/generate", raw=b"{bad", headers={"content-type": "application/json"}),
    Case("generate_negative_temperature", "POST", "/generate", {"text": "x", "sampling_params": {"temperature": -1}},
         message=True),
    Case("generate_negative_max_new_tokens", "POST", "/generate",
         {"text": "x", "sampling_params": {"max_new_tokens": -1}}, message=True),
    Case("generate_too_long", "POST", "/generate", {"text": "x " * 600, "sampling_params": {"max_new_tokens": 2}},
         message=True),
    Case("generate_too_long_total", "POST", "/generate", {"text": "x " * 100, "sampling_params": {
        "max_new_tokens": 500}}, message=True),
    Case("generate_logit_bias_vocab", "POST", "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 1, "logit_bias": {"9999": 1.0}}}, message=True),
    # OpenAI completions
    Case("completions", "POST", "/v1/completions", {"model": "m", "prompt": "hello world", "max_tokens": 3,
                                                     **GREEDY},
         values=("usage", "choices.0.finish_reason")),
    Case("completions_logprobs_echo", "POST", "/v1/completions", {
        "model": "m", "prompt": "hello world", "max_tokens": 2, "logprobs": 2, "echo": True, **GREEDY},
         values=("usage",)),
    Case("completions_stream", "POST", "/v1/completions", {
        "model": "m", "prompt": "hello", "max_tokens": 2, "stream": True, "logprobs": 1,
        "stream_options": {"include_usage": True}, **GREEDY}),
    Case("completions_ids", "POST", "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
                                                         "logprobs": 0, **GREEDY}, values=("usage",)),
    Case("completions_negative_temperature", "POST", "/v1/completions",
         {"model": "m", "prompt": "hello", "max_tokens": 2, "temperature": -1}, message=True),
    Case("completions_logit_bias_vocab", "POST", "/v1/completions",
         {"model": "m", "prompt": "hello", "max_tokens": 2, "logit_bias": {"9999": 1}}, message=True),
    Case("completions_too_long", "POST", "/v1/completions", {"model": "m", "prompt": "x " * 600, "max_tokens": 2},
         message=True),
    Case("completions_missing_prompt", "POST", "/v1/completions", {"model": "m"}),
    # OpenAI chat
    Case("chat", "POST", "/v1/chat/completions", _chat("hi", max_tokens=3, ignore_eos=True),
         values=("usage", "choices.0.finish_reason")),
    Case("chat_logprobs", "POST", "/v1/chat/completions",
         _chat("hi", max_tokens=2, logprobs=True, top_logprobs=2, ignore_eos=True), values=("usage",)),
    Case("chat_stream", "POST", "/v1/chat/completions",
         _chat("hi", max_tokens=2, stream=True, stream_options={"include_usage": True}, logprobs=True,
               ignore_eos=True)),
    Case("chat_stream_plain", "POST", "/v1/chat/completions", _chat("hi", max_tokens=2, stream=True,
                                                                     ignore_eos=True)),
    Case("chat_n2", "POST", "/v1/chat/completions", _chat("hi", max_tokens=1, n=2, ignore_eos=True),
         values=("usage",)),
    Case("chat_empty_messages", "POST", "/v1/chat/completions", {"model": "m", "messages": [], "max_tokens": 2},
         message=True),
    Case("chat_negative_temperature", "POST", "/v1/chat/completions", {**_chat("hi"), "temperature": -1},
         message=True),
    Case("chat_logit_bias_vocab", "POST", "/v1/chat/completions", _chat("hi", logit_bias={"100000": 2}),
         message=True),
    Case("chat_too_long", "POST", "/v1/chat/completions", _chat("x " * 600), message=True),
    Case("chat_wrong_content_type", "POST", "/v1/chat/completions", raw=b'{"messages": [{"role":"user","content":'
         b'"hi"}]}', headers={"content-type": "text/plain"}),
    # constrained decoding
    Case("generate_regex", "POST", "/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "regex": r"(yes|no) [a-c]{2}\d"}}, values=("meta_info.finish_reason",)),
    Case("generate_regex_bad", "POST", "/generate", {"text": "hi", "sampling_params": {"regex": "(ab"}}),
    Case("generate_regex_bad_stream", "POST", "/generate", {"text": "hi", "stream": True,
                                                             "sampling_params": {"regex": "(ab"}}),
    # (cut at 3 tokens: the random-weight model fills the real engine's JSON with whitespace until its limit)
    Case("generate_schema", "POST", "/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "json_schema": json.dumps({
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]})}}),
    Case("generate_schema_bad_json", "POST", "/generate", {"text": "hi", "sampling_params": {"json_schema": "{bad"}},
         message=True),
    Case("generate_schema_unsupported", "POST", "/generate", {"text": "hi", "sampling_params": {
        "json_schema": json.dumps({"type": "integer", "multipleOf": 3})}}, message=True),
    Case("generate_two_grammars", "POST", "/generate", {"text": "hi", "sampling_params": {
        "regex": "a", "json_schema": "{}"}}, message=True),
    Case("chat_json_object", "POST", "/v1/chat/completions",
         _chat("hi", max_tokens=30, response_format={"type": "json_object"})),
    Case("chat_json_schema", "POST", "/v1/chat/completions", _chat("hi", max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}})),
    Case("chat_json_schema_without_schema", "POST", "/v1/chat/completions", _chat("hi", response_format={
        "type": "json_schema", "json_schema": {"name": "x"}}), message=True),
    Case("chat_response_format_bad_type", "POST", "/v1/chat/completions", _chat("hi", response_format={"type": "xml"})),
    Case("chat_regex", "POST", "/v1/chat/completions", _chat("hi", max_tokens=10, regex="[0-9]{3}-[a-z]{2}")),
    # a grammar of three words: both engines write one, then EOS (upstream's test_openai_server_ebnf.py's)
    Case("chat_ebnf", "POST", "/v1/chat/completions",
         _chat("hi", max_tokens=32, ebnf='root ::= "Hello" | "Hi" | "Hey"'),
         values=("choices.0.finish_reason", "choices.0.matched_stop")),
    Case("chat_regex_bad", "POST", "/v1/chat/completions", _chat("hi", regex="(ab")),
    Case("chat_regex_bad_stream", "POST", "/v1/chat/completions", _chat("hi", regex="(ab", stream=True)),
    Case("chat_regex_and_response_format", "POST", "/v1/chat/completions",
         _chat("hi", regex="a", response_format={"type": "json_object"}), message=True),
    Case("completions_regex", "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 10,
                                                          "temperature": 0, "regex": "[0-9]{3}"}),
    # continue_final_message
    Case("chat_continue_final", "POST", "/v1/chat/completions", {**_chat("hi", max_tokens=3, ignore_eos=True),
         "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}],
         "continue_final_message": True}, values=("usage",)),
    Case("chat_last_assistant_not_continued", "POST", "/v1/chat/completions", {
        **_chat("hi", max_tokens=3, ignore_eos=True),
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]},
         values=("usage",)),
    Case("chat_continue_final_last_user", "POST", "/v1/chat/completions",
         _chat("hi", max_tokens=3, ignore_eos=True, continue_final_message=True), values=("usage",)),
    Case("chat_continue_final_only_assistant", "POST", "/v1/chat/completions", {
        **_chat("hi"), "messages": [{"role": "assistant", "content": "Once upon"}], "continue_final_message": True},
         message=True),
    # the Anthropic Messages API
    Case("messages", "POST", "/v1/messages", _message(), values=("type", "role", "model", "usage.input_tokens")),
    Case("messages_system_blocks", "POST", "/v1/messages", _message(system=[
        {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]), values=("usage.input_tokens",)),
    Case("messages_content_blocks", "POST", "/v1/messages", _message(messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]),
         values=("usage.input_tokens",)),
    Case("messages_stream", "POST", "/v1/messages", _message(stream=True)),
    Case("messages_bad_max_tokens", "POST", "/v1/messages", _message(max_tokens=-1), message=True,
         values=("error.type",)),
    Case("messages_missing_fields", "POST", "/v1/messages", {"messages": [{"role": "user", "content": "hi"}]},
         message=True, values=("error.type",)),
    Case("messages_bad_role", "POST", "/v1/messages", _message(messages=[{"role": "bot", "content": "hi"}]),
         message=True, values=("error.type",)),
    Case("messages_empty", "POST", "/v1/messages", _message(messages=[]), message=True, values=("error.type",)),
    Case("messages_not_json", "POST", "/v1/messages", raw=b"not json", message=True, values=("error.type",)),
    Case("messages_bad_json", "POST", "/v1/messages", raw=b"{not json", headers={"content-type": "application/json"},
         message=True, values=("error.type",)),
    Case("messages_wrong_content_type", "POST", "/v1/messages", raw=json.dumps(_message()).encode(),
         headers={"content-type": "text/plain"}, message=True, values=("error.type",)),
    Case("messages_too_long", "POST", "/v1/messages", _message(messages=[{"role": "user", "content": "x " * 600}]),
         message=True, values=("error.type",)),
    Case("count_tokens", "POST", "/v1/messages/count_tokens", {"model": "m", "messages": [
        {"role": "user", "content": "hi"}]}, values=("input_tokens",)),
    Case("count_tokens_system", "POST", "/v1/messages/count_tokens", {"model": "m", "system": "Be brief.",
                                                                      "messages": [{"role": "user", "content": "hi"}]},
         values=("input_tokens",)),
    # load (after the generations above: both engines have decoded by now)
    Case("v1_loads", "GET", "/v1/loads",
         values=("loads.0.num_running_reqs", "loads.0.max_total_num_tokens", "loads.0.max_running_requests",
                 "num_accelerators", "accelerator")),
    Case("v1_loads_core", "GET", "/v1/loads?include=core"),
    Case("v1_loads_rank_out_of_range", "GET", "/v1/loads?dp_rank=3", values=("loads",)),
    Case("v1_loads_bad_section", "GET", "/v1/loads?include=bogus"),
    # tokens, score, embeddings on a generation model
    Case("tokenize", "POST", "/tokenize", {"prompt": "hello world"}, values=("tokens", "count", "max_model_len")),
    Case("detokenize", "POST", "/detokenize", {"tokens": [5, 6, 7]}, values=("text",)),
    Case("score", "POST", "/v1/score", {"query": "hello", "items": ["a", "b"], "label_token_ids": [5, 6]},
         values=("usage",)),
    Case("embeddings_on_generation_model", "POST", "/v1/embeddings", {"model": "m", "input": "hi"}, message=True),
    Case("encode_on_generation_model", "POST", "/encode", {"text": "hi"}, message=True),
    # the embedding model
    Case("emb_model_info", "GET", "/model_info", values=("is_generation",), embedding=True),
    Case("emb_embeddings", "POST", "/v1/embeddings", {"model": "m", "input": "hi there"}, values=("usage",),
         embedding=True),
    Case("emb_embeddings_batch", "POST", "/v1/embeddings", {"model": "m", "input": ["a", "b c"]}, values=("usage",),
         embedding=True),
    Case("emb_embeddings_ids", "POST", "/v1/embeddings", {"model": "m", "input": [1, 2, 3]}, embedding=True),
    Case("emb_embeddings_base64", "POST", "/v1/embeddings", {"model": "m", "input": "hi", "encoding_format": "base64"},
         embedding=True),
    Case("emb_embeddings_dimensions", "POST", "/v1/embeddings", {"model": "m", "input": "hi", "dimensions": 8},
         message=True, embedding=True),
    Case("emb_embeddings_empty", "POST", "/v1/embeddings", {"model": "m", "input": ""}, message=True,
         embedding=True),
    Case("emb_embeddings_missing", "POST", "/v1/embeddings", {"model": "m"}, embedding=True),
    Case("emb_encode", "POST", "/encode", {"text": "hi there"}, values=("meta_info.prompt_tokens",),
         embedding=True),
    Case("emb_encode_batch", "POST", "/encode", {"text": ["a", "b"]}, embedding=True),
    Case("emb_health_generate", "GET", "/health_generate", embedding=True),
]


# ------------------------------------------------------------------------------------------------ tests


def test_the_corpus_answers_alike(servers: dict[str, Pair]) -> None:
    failures = []
    for case in CORPUS:
        pair = servers["embedding" if case.embedding else "generation"]
        real, sim = send(pair.real.url, case), send(pair.sim.url, case)
        failures += [f"{case.name}: {p}" for p in compare(case, real, sim)]
    assert not failures, "the sim answers differently from the real engine:\n" + "\n".join(failures)


def test_server_info_has_the_real_keys(servers: dict[str, Pair]) -> None:
    pair = servers["generation"]
    real = httpx.get(pair.real.url + "/server_info", timeout=30, trust_env=False).json()
    sim = httpx.get(pair.sim.url + "/server_info", timeout=30, trust_env=False).json()
    assert sorted(set(real) - set(sim)) == [] and sorted(set(sim) - set(real)) == []
    assert sorted(set(real["internal_states"][0]) ^ set(sim["internal_states"][0])) == []
    # (not chunked_prefill_size: on the CPU the real engine sizes it for the host's memory, the sim for the
    # declared card)
    for key in ("max_total_num_tokens", "max_req_input_len", "disaggregation_mode", "mem_fraction_static",
                "page_size", "tp_size"):
        assert real[key] == sim[key], key
    assert isinstance(sim["startup_time"], dict) and set(sim["startup_time"]) == set(real["startup_time"])


def test_the_uvicorn_answers_to_the_routers_http2_probe(servers: dict[str, Pair]) -> None:
    def probe(url: str) -> bytes:
        host, port = url.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return data

    def statuses(data: bytes) -> list[str]:
        return [m.decode() for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]

    pair = servers["generation"]
    real, sim = probe(pair.real.url), probe(pair.sim.url)
    assert statuses(real) == statuses(sim) == ["404", "400"]
    assert b"Invalid HTTP request received." in real and b"Invalid HTTP request received." in sim
