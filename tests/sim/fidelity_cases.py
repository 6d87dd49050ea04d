"""The simulated engine's fidelity table: every field of sglang 0.5.23's request models, the values it is probed
with and, where the two engines differ in what a client sees, why (see ``fidelity.py``).

A probe is merged into its model's base request (``fidelity.BASE``: greedy, 3 tokens, no EOS); a SamplingParams
row's probe goes into ``/generate``'s ``sampling_params``.
"""

from __future__ import annotations

import json
from typing import Any

from fidelity import F, row

# ------------------------------------------------------------------------------------------------ reasons

WEIGHTS = ("needs real weights: what the random-weight model writes decides it (the generated tokens, so whether "
           "and where a stop string, stop token or EOS ends the text, and the counts that follow)")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CHAT_TWO_TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                  {"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you"}]
WATERMARK = {"enabled": True}
#: the token of " there" in the tiny model's tokenizer (the prompts say "hello there"; the sim echoes them)
THERE = 273
IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
         "RU5ErkJggg==")


def _openai_common() -> list[F]:
    """Fields chat completions and completions share (same names, same meaning)."""
    return [
        row("bootstrap_host", {"bootstrap_host": "127.0.0.1"}),
        row("bootstrap_port", {"bootstrap_port": 8998}),
        row("bootstrap_room", {"bootstrap_room": 12345}),
        row("routed_dp_rank", {"routed_dp_rank": 0}, {"routed_dp_rank": 3}),
        row("disagg_prefill_dp_rank", {"disagg_prefill_dp_rank": 0}),
        row("model", {"model": "another-name"}),
        row("frequency_penalty", {"frequency_penalty": 0.5}, {"frequency_penalty": 3.0}),
        row("logit_bias", {"logit_bias": {"5": 1.0}}, {"logit_bias": {"100000": 1.0}}),
        row("max_tokens", {"max_tokens": 1}, {"max_tokens": 0}, {"max_tokens": 600}, {"max_tokens": -1}),
        row("n", {"n": 2}, {"n": 0}),
        row("presence_penalty", {"presence_penalty": 0.5}, {"presence_penalty": -3.0}),
        row("seed", {"seed": 42}),
        row("stop", {"stop": ["zzzz"]}, {"stop": " there", "max_tokens": 8}, known=WEIGHTS),
        row("stream", {"stream": True}, stream=False),
        row("stream_options", {"stream": True, "stream_options": {"include_usage": True}},
            {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            {"stream_options": {"include_usage": True}}, stream=False),
        row("temperature", {"temperature": 0.7}, {"temperature": -1}),
        row("top_p", {"top_p": 0.9}, {"top_p": 0}),
        row("user", {"user": "someone"}),
        row("return_hidden_states", {"return_hidden_states": True}),
        row("return_routed_experts", {"return_routed_experts": True}),
        row("routed_experts_start_len", {"routed_experts_start_len": 1}),
        row("return_cached_tokens_details", {"return_cached_tokens_details": True}),
        row("return_spec_tokens_details", {"return_spec_tokens_details": True}),
        row("return_token_ids", {"return_token_ids": True}),
        row("top_k", {"top_k": 5}, {"top_k": 0}),
        row("min_p", {"min_p": 0.1}, {"min_p": 2}),
        row("min_tokens", {"min_tokens": 2, "ignore_eos": False}),
        row("regex", {"regex": "[0-9]{3}"}),
        row("ebnf", {"ebnf": 'root ::= "yes" | "no"'}),
        row("repetition_penalty", {"repetition_penalty": 1.2}, {"repetition_penalty": 0}),
        row("stop_token_ids", {"stop_token_ids": [7]},
            {"stop_token_ids": [THERE], "ignore_eos": False, "max_tokens": 8}, known=WEIGHTS),
        row("stop_regex", {"stop_regex": "zz+"}, {"stop_regex": "th[a-z]+", "max_tokens": 8}, known=WEIGHTS),
        row("no_stop_trim", {"no_stop_trim": True}),
        row("ignore_eos", {"ignore_eos": False}, {"ignore_eos": False, "max_tokens": 40}, known=WEIGHTS),
        row("skip_special_tokens", {"skip_special_tokens": False}),
        row("lora_path", {"lora_path": "some-adapter"}),
        row("session_id", {"session_id": "no-such-session"}),
        row("session_params", {"session_params": {"id": "no-such-session"}}),
        row("custom_logit_processor", {"custom_logit_processor": "{}"}),
        row("custom_params", {"custom_params": {"k": 1}}),
        row("watermark", {"watermark": WATERMARK}),
        row("images_config", {"images_config": {"max_pixels": 1000}}),
        row("mm_processor_kwargs", {"mm_processor_kwargs": {"k": 1}}),
        row("data_parallel_rank", {"data_parallel_rank": 0}),
        row("rid", {"rid": "my-request-id"}),
        row("extra_key", {"extra_key": "tenant-a"}),
        row("cache_salt", {"cache_salt": "salt"}),
        row("priority", {"priority": 1}),
        row("response_format", {"response_format": {"type": "text"}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}),
    ]


CHAT: list[F] = [
    *_openai_common(),
    row("messages", {"messages": CHAT_TWO_TURNS},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "x"}]}]},
        {"messages": []}),
    row("logprobs", {"logprobs": True}),
    row("top_logprobs", {"logprobs": True, "top_logprobs": 3}, {"logprobs": True, "top_logprobs": 30}),
    row("max_completion_tokens", {"max_tokens": None, "max_completion_tokens": 2}),
    row("tools", {"tools": [TOOL]}),
    row("tool_choice", {"tools": [TOOL], "tool_choice": "none"}, {"tool_choice": "required"},
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}),
    row("parallel_tool_calls", {"tools": [TOOL], "parallel_tool_calls": False}),
    row("return_prompt_token_ids", {"return_prompt_token_ids": True}),
    row("return_meta_info", {"return_meta_info": True}),
    row("return_input_ids_in_sglext", {"return_input_ids_in_sglext": True}),
    row("return_output_ids_in_sglext", {"return_output_ids_in_sglext": True}),
    row("return_sampling_mask", {"return_sampling_mask": True}),
    row("sampling_logprobs_mode", {"logprobs": True, "sampling_logprobs_mode": "selected"}),
    row("return_flat_raw_output_top_logprobs", {"logprobs": True, "top_logprobs": 2,
                                                "return_flat_raw_output_top_logprobs": True}),
    row("return_flat_raw_top_logprobs_b64", {"return_flat_raw_top_logprobs_b64": False}),
    row("reasoning_effort", {"reasoning_effort": "low"}),
    row("thinking", {"thinking": {"type": "enabled"}}),
    row("task", {"task": "query"}),
    row("continue_final_message", {"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "The answer is"}],
                                   "continue_final_message": True}),
    row("separate_reasoning", {"separate_reasoning": False}),
    row("stream_reasoning", {"stream_reasoning": False}),
    row("chat_template_kwargs", {"chat_template_kwargs": {"enable_thinking": False}}),
    row("max_dynamic_patch", {"max_dynamic_patch": 4}),
    row("min_dynamic_patch", {"min_dynamic_patch": 1}),
    row("use_audio_in_video", {"use_audio_in_video": True}),
    row("video_config", {"video_config": {"fps": 1}}),
    row("input_ids", {"input_ids": [1, 5, 9, 20]}),
]

COMPLETION: list[F] = [
    *_openai_common(),
    row("prompt", {"prompt": ["a b", "c d e"]}, {"prompt": [1, 5, 9]}, {"prompt": [[1, 5], [9, 20, 30]]},
        {"prompt": None}),
    row("best_of", {"best_of": 2}),
    row("echo", {"echo": True}, {"echo": True, "logprobs": 1}),
    row("logprobs", {"logprobs": 2}, {"logprobs": 0}),
    row("suffix", {"suffix": "the end"}),
    row("json_schema", {"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}),
    row("custom_labels", {"custom_labels": {"team": "a"}}),
]

EMBEDDING: list[F] = [
    row("input", {"input": ["a b", "c"]}, {"input": [1, 5, 9]}, {"input": [[1, 5], [9]]}, {"input": ""}),
    row("model", {"model": "another-name"}),
    row("encoding_format", {"encoding_format": "base64"}),
    row("dimensions", {"dimensions": 8}),
    row("user", {"user": "someone"}),
    row("rid", {"rid": "my-embedding-id"}),
    row("priority", {"priority": 1}),
    row("lora_path", {"lora_path": "some-adapter"}),
    row("embed_override_token_id", {"embed_override_token_id": 5}),
    row("embed_overrides", {"embed_overrides": [[[0.0] * 64]]}),
]

GENERATE: list[F] = [
    row("rid", {"rid": "my-request-id"}),
    row("session_id", {"session_id": "no-such-session"}),
    row("text", {"text": ["a b", "c d e"]}, {"text": None}),
    row("input_ids", {"text": None, "input_ids": [1, 5, 9]}, {"text": None, "input_ids": [[1, 5], [9, 20]]}),
    row("input_embeds", {"text": None, "input_embeds": [[0.0] * 64, [0.1] * 64]}),
    row("image_data", {"image_data": IMAGE}),
    row("video_data", {"video_data": "no-such-video.mp4"}),
    row("audio_data", {"audio_data": "no-such-audio.wav"}),
    row("mm_hashes", {"mm_hashes": ["abc"]}),
    row("mm_content_hashes", {"mm_content_hashes": ["abc"]}),
    row("use_audio_in_video", {"use_audio_in_video": True}),
    row("video_config", {"video_config": {"fps": 1}}),
    # (not streamed: in a batch whose prompts finish apart, which chunks carry the real engine's e2e_latency
    # depends on its timing; every SamplingParams row streams the sampling params)
    row("sampling_params", {"sampling_params": {"max_new_tokens": 2, "ignore_eos": True}},
        {"text": ["a b", "c"], "sampling_params": [{"max_new_tokens": 1, "ignore_eos": True},
                                                   {"max_new_tokens": 2, "ignore_eos": True}]}, stream=False),
    row("watermark", {"watermark": WATERMARK}),
    row("return_logprob", {"return_logprob": True}),
    row("logprob_start_len", {"return_logprob": True, "logprob_start_len": 0},
        {"return_logprob": True, "logprob_start_len": 1}),
    row("top_logprobs_num", {"return_logprob": True, "top_logprobs_num": 2}),
    row("token_ids_logprob", {"return_logprob": True, "token_ids_logprob": [5, 6]},
        {"return_logprob": True, "token_ids_logprob": [-1]}, {"return_logprob": True, "token_ids_logprob": [[0]]},
        {"text": ["a", "b"], "return_logprob": True, "token_ids_logprob": [[0], [2_000_000_000]]}),
    row("return_sampling_mask", {"return_sampling_mask": True}),
    row("sampling_logprobs_mode", {"return_logprob": True, "sampling_logprobs_mode": "selected"}),
    row("return_text_in_logprobs", {"return_logprob": True, "top_logprobs_num": 1, "return_text_in_logprobs": True}),
    row("return_flat_raw_top_logprobs", {"return_logprob": True, "top_logprobs_num": 2,
                                         "return_flat_raw_top_logprobs": True}),
    row("return_flat_raw_output_top_logprobs", {"return_logprob": True, "top_logprobs_num": 2,
                                                "return_flat_raw_output_top_logprobs": True}),
    row("return_flat_raw_top_logprobs_b64", {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
                                             "return_flat_raw_top_logprobs": True,
                                             "return_flat_raw_top_logprobs_b64": True},
        {"return_flat_raw_top_logprobs_b64": True}),
    row("stream", {"stream": True}, stream=False),
    row("log_metrics", {"log_metrics": False}),
    row("return_hidden_states", {"return_hidden_states": True}),
    row("return_routed_experts", {"return_routed_experts": True}),
    row("routed_experts_start_len", {"routed_experts_start_len": 1}),
    row("return_indexer_topk", {"return_indexer_topk": True}),
    row("modalities", {"modalities": ["image"]}),
    row("session_params", {"session_params": {"id": "no-such-session"}}),
    row("lora_path", {"lora_path": "some-adapter"}),
    row("lora_id", {"lora_id": "some-adapter-id"}),
    row("custom_logit_processor", {"custom_logit_processor": "{}"}),
    row("positional_embed_overrides", {"positional_embed_overrides": {}}, sent=False,
        known="not sent: the real scheduler crashes on a JSON value ('dict' object has no attribute 'reconstruct': "
              "it takes an in-process tensor container, not a request body field), which ends the engine; the sim "
              "ignores it"),
    row("bootstrap_host", {"bootstrap_host": "127.0.0.1"}),
    row("bootstrap_port", {"bootstrap_port": 8998}),
    row("bootstrap_room", {"bootstrap_room": 12345}),
    row("bootstrap_pair_key", {"bootstrap_pair_key": "pair"}),
    row("decode_tp_size", {"decode_tp_size": 1}),
    row("routed_dp_rank", {"routed_dp_rank": 0}, {"routed_dp_rank": 3}),
    row("data_parallel_rank", {"data_parallel_rank": 0}),
    row("disagg_prefill_dp_rank", {"disagg_prefill_dp_rank": 0}),
    row("routing_key", {"routing_key": "key"}),
    row("conversation_id", {"conversation_id": "conv"}),
    row("http_worker_ipc", {"http_worker_ipc": "ipc:///tmp/no-such-worker"}),
    row("background", {"background": True}),
    row("require_reasoning", {"require_reasoning": True}),
    row("max_thinking_tokens", {"max_thinking_tokens": 2}),
    row("priority", {"priority": 1}),
    row("extra_key", {"extra_key": "tenant-a"}),
    row("no_logs", {"no_logs": True}),
    row("custom_labels", {"custom_labels": {"team": "a"}}),
    row("return_bytes", {"return_bytes": True}),
    row("return_entropy", {"return_entropy": True}),
    row("return_prompt_token_ids", {"return_prompt_token_ids": True}),
    row("external_trace_header", {"external_trace_header": {"traceparent": "00-0-0-01"}}),
    row("received_time", {"received_time": 1.0}),
    row("need_wait_for_mm_inputs", {"need_wait_for_mm_inputs": False}),
    row("num_items_assigned", {"num_items_assigned": {}}, {"num_items_assigned": {"1": [1]}}),
    row("encoder_urls", {"encoder_urls": []}),
    row("max_dynamic_patch", {"max_dynamic_patch": 4}),
    row("min_dynamic_patch", {"min_dynamic_patch": 1}),
    row("image_max_dynamic_patch", {"image_max_dynamic_patch": 4}),
    row("video_max_dynamic_patch", {"video_max_dynamic_patch": 4}),
    row("images_config", {"images_config": {"max_pixels": 1000}}),
    row("mm_processor_kwargs", {"mm_processor_kwargs": {"k": 1}}),
    row("multi_item_delimiter_indices", {"multi_item_delimiter_indices": [1]}),
    row("token_indices_to_pool", {"token_indices_to_pool": [1]}),
    row("cache_salt", {"cache_salt": "salt"}),
    row("kv_hints", {"kv_hints": {}}),
]

SAMPLING: list[F] = [
    row("max_new_tokens", {"max_new_tokens": 1}, {"max_new_tokens": 0}, {"max_new_tokens": -1},
        {"max_new_tokens": 600}),
    row("stop", {"stop": ["zzzz"]}, {"stop": " there", "max_new_tokens": 8}, known=WEIGHTS),
    row("stop_token_ids", {"stop_token_ids": [7]}, {"stop_token_ids": [THERE], "ignore_eos": False,
                                                    "max_new_tokens": 8}, known=WEIGHTS),
    row("stop_regex", {"stop_regex": "zz+"}, {"stop_regex": "th[a-z]+", "max_new_tokens": 8}, known=WEIGHTS),
    row("temperature", {"temperature": 0.7}, {"temperature": -1}),
    row("top_p", {"top_p": 0.9}, {"top_p": 0}),
    row("top_k", {"top_k": 5}, {"top_k": 0}),
    row("min_p", {"min_p": 0.1}, {"min_p": 2}),
    row("frequency_penalty", {"frequency_penalty": 0.5}, {"frequency_penalty": 3.0}),
    row("presence_penalty", {"presence_penalty": 0.5}, {"presence_penalty": -3.0}),
    row("repetition_penalty", {"repetition_penalty": 1.2}, {"repetition_penalty": 0}),
    row("min_new_tokens", {"min_new_tokens": 2, "ignore_eos": False}, {"min_new_tokens": 5}),
    row("n", {"n": 2}),
    row("beam_width", {"beam_width": 2}),
    row("json_schema", {"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}),
    row("regex", {"regex": "[0-9]{3}"}),
    row("ebnf", {"ebnf": 'root ::= "yes" | "no"'}),
    row("structural_tag", {"structural_tag": json.dumps({
        "type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
        "triggers": ["<f>"]})}),
    row("ignore_eos", {"ignore_eos": False}, {"ignore_eos": False, "max_new_tokens": 40}, known=WEIGHTS),
    row("skip_special_tokens", {"skip_special_tokens": False}),
    row("spaces_between_special_tokens", {"spaces_between_special_tokens": False}),
    row("no_stop_trim", {"no_stop_trim": True}),
    row("stream_interval", {"stream_interval": 2}),
    row("logit_bias", {"logit_bias": {"5": 1.0}}, {"logit_bias": {"9999": 1.0}}),
    row("sampling_seed", {"sampling_seed": 42}),
    row("custom_params", {"custom_params": {"k": 1}}),
    row("watermark", {"watermark": WATERMARK}),
    row("stop_strs", {"stop_strs": ["zz"]}),
    row("stop_regex_strs", {"stop_regex_strs": ["zz"]}),
    row("stop_str_max_len", {"stop_str_max_len": 4}),
    row("stop_regex_max_len", {"stop_regex_max_len": 4}),
    row("is_normalized", {"is_normalized": True}),
    row("ebnf_full_assistant", {"ebnf_full_assistant": True}),
]

TABLE: dict[str, list[F]] = {
    "ChatCompletionRequest": CHAT,
    "CompletionRequest": COMPLETION,
    "EmbeddingRequest": EMBEDDING,
    "GenerateReqInput": GENERATE,
    "SamplingParams": SAMPLING,
}


def rows() -> dict[tuple[str, str], F]:
    """Every row by (model, field)."""
    out: dict[tuple[str, str], Any] = {}
    for model, fields in TABLE.items():
        for f in fields:
            out[(model, f.name)] = f
    return out
