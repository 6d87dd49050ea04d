"""The request options the real server refuses unless it was launched for them, and the other refusals sglang
0.5.23 makes of single request fields (its tokenizer manager's, its OpenAI adapters', msgspec's on
``sampling_params``), with sglang's own messages.

Part of :mod:`pytest_sglworker.sim`; stdlib only. Each check raises :class:`~.common.BadRequest`; which envelope
a client gets (400 JSON, or an error event in a ``/generate`` stream) is the route's business
(``tests/sim/test_sim_fidelity.py`` holds them to the real engine, field by field).
"""

from __future__ import annotations

from typing import Any

from ..state import Sim
from .common import BadRequest, num

#: sglang's ``SamplingParams`` fields a request may set (msgspec refuses any other key of ``sampling_params``),
#: in the order of its message.
SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)


class DecodeRefusal(BadRequest):
    """The request decoder's refusal of ``/generate``'s body (a ``sampling_params`` key it does not know, a field
    of the wrong type): 400 ``{"error": "<message>"}``, streamed or not."""


def sampling_keys(params: dict[str, Any]) -> None:
    for key in params:
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise DecodeRefusal(f"unknown field `{key}`, expected one of {expected}")


def hidden_states_type(req: dict[str, Any]) -> None:
    """``return_hidden_states`` is a flag or a list of flags (one per prompt): a mode's name is refused as the
    decoder words it (sglang 0.5.23's ``/generate``: ``"last"`` is a server mode, ``--return-hidden-states-mode``)."""
    value = req.get("return_hidden_states")
    if isinstance(value, str):
        raise DecodeRefusal(f'invalid type: string "{value}", expected a value or an array of values for BoolOrList')


def _arg(sim: Sim, name: str) -> Any:
    return sim.plan.args.get(name)


def _lora_names(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def server_features(sim: Sim, req: dict[str, Any], sampling: dict[str, Any] | None = None) -> None:
    """The tokenizer manager's refusals of what the server was not launched for: a LoRA adapter without
    ``--enable-lora``, hidden states, a custom logit processor, a watermark, strict thinking, ``input_embeds`` with
    the radix cache on, a data-parallel rank out of range, a sampling-logprobs mode without the sampling mask."""
    names = _lora_names(req.get("lora_path"))
    if names and not _arg(sim, "enable_lora") and not _arg(sim, "lora_paths"):
        raise BadRequest(f"LoRA adapter '{names[0]}' was requested, but LoRA is not enabled. Please launch the server "
                         "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                         "endpoint.")
    rank = req.get("routed_dp_rank")
    ranks = max(int(_arg(sim, "dp_size") or 1), 1)
    if num(rank) and not 0 <= rank < ranks:
        raise BadRequest(f"routed_dp_rank={rank} out of range [0, {ranks})")
    if req.get("input_embeds") is not None and not _arg(sim, "disable_radix_cache"):
        raise BadRequest("input_embeds is provided while disable_radix_cache is False. Please add "
                         "`--disable-radix-cache` when you launch the server if you want to use input_embeds as "
                         "inputs.")
    hidden = req.get("return_hidden_states")
    if hidden and hidden is not False and not _arg(sim, "enable_return_hidden_states") \
            and _arg(sim, "return_hidden_states_mode") not in ("last", "full"):
        raise BadRequest("The server is not configured to return hidden states. Please set "
                         "`--return-hidden-states-mode last`, `--return-hidden-states-mode full`, or the legacy "
                         "`--enable-return-hidden-states` flag.")
    if req.get("custom_logit_processor") and not _arg(sim, "enable_custom_logit_processor"):
        raise BadRequest("The server is not configured to enable custom logit processor. Please set "
                         "`--enable-custom-logit-processor` to enable this feature.")
    if req.get("sampling_logprobs_mode") is not None and not req.get("return_sampling_mask"):
        raise BadRequest("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    watermark = req.get("watermark") or (sampling or {}).get("watermark")
    if watermark and not _arg(sim, "enable_watermark"):
        raise BadRequest("request watermarking requires the server to enable --enable-watermark")
    if req.get("max_thinking_tokens") is not None and not _arg(sim, "enable_strict_thinking"):
        raise BadRequest("max_thinking_tokens requires the server to be launched with --enable-strict-thinking")


def token_ids_logprob(req: dict[str, Any], vocab_size: int, *, batch: bool) -> None:
    """The tokenizer manager's check of ``token_ids_logprob``, per request of a batch: a flat list of ids in the
    vocabulary."""
    asked = req.get("token_ids_logprob")
    if not asked:
        return
    rows = asked if batch and isinstance(asked, list) and all(isinstance(r, list) for r in asked) else [asked]
    for row in rows:
        if not isinstance(row, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise BadRequest("token_ids_logprob must be a flat list of integers.")
        for token in row:
            if not 0 <= token < vocab_size:
                raise BadRequest(f"token_ids_logprob contains out-of-vocabulary token id {token}; valid range is "
                                 f"[0, {vocab_size}).")


def flat_logprobs(req: dict[str, Any]) -> None:
    """``GenerateReqInput``'s own checks of the flat raw top-logprob options, and pydantic's of
    ``num_items_assigned`` (keyed by a modality enum of ints, which no JSON object key can be)."""
    assigned = req.get("num_items_assigned")
    if isinstance(assigned, dict) and assigned:
        key = next(iter(assigned))
        raise BadRequest(f"1 validation error:\n  {{'type': 'enum', 'loc': ('body', 'num_items_assigned', {key!r}, "
                         f"'[key]'), 'msg': 'Input should be 1, 2 or 3', 'input': {key!r}, 'ctx': {{'expected': "
                         "'1, 2 or 3'}}\n\n    POST /generate", validation=True)
    if req.get("return_flat_raw_output_top_logprobs") and req.get("stream"):
        raise BadRequest("return_flat_raw_output_top_logprobs is only set on the finished response and does not "
                         "support stream=True.")
    if req.get("return_flat_raw_top_logprobs_b64") and not (req.get("return_flat_raw_top_logprobs")
                                                            or req.get("return_flat_raw_output_top_logprobs")):
        raise BadRequest("return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs or "
                         "return_flat_raw_output_top_logprobs.")


def chat_options(req: dict[str, Any]) -> None:
    """The chat adapter's refusals: ids or meta info with streaming, the sampling mask and flat raw top logprobs
    without ``return_meta_info``, ``tool_choice`` naming no tool."""
    if req.get("stream"):
        for name, what in (("return_prompt_token_ids", "return_prompt_token_ids is not supported with streaming. "),
                           ("return_token_ids", "return_token_ids is not supported with streaming on "
                                                "/v1/chat/completions. "),
                           ("return_meta_info", "return_meta_info is not supported with streaming. ")):
            if req.get(name):
                raise BadRequest(f"{what}Please set stream=false when using {name}=true.", kind="BadRequest")
    for name in ("return_sampling_mask", "return_flat_raw_output_top_logprobs"):
        if req.get(name) and not req.get("return_meta_info"):
            raise BadRequest(f"{name} requires return_meta_info=true.")
    choice, tools = req.get("tool_choice"), req.get("tools") or []
    if isinstance(choice, str) and choice.lower() == "required" and not tools:
        raise BadRequest("Tools cannot be empty if tool choice is set to required.")
    if isinstance(choice, dict):
        if not tools:
            raise BadRequest("Tools cannot be empty if tool choice is set to a specific tool.")
        wanted = (choice.get("function") or {}).get("name")
        if not any(isinstance(t, dict) and (t.get("function") or {}).get("name") == wanted for t in tools):
            raise BadRequest(f"Tool '{wanted}' not found in tools list.")


def embedding_options(req: dict[str, Any]) -> None:
    """The embedding adapter's pairing of ``embed_overrides`` and ``embed_override_token_id``."""
    if req.get("embed_overrides") is not None and req.get("embed_override_token_id") is None:
        raise BadRequest("embed_override_token_id is required when embed_overrides is provided", kind="BadRequest")
    if req.get("embed_override_token_id") is not None and req.get("embed_overrides") is None:
        raise BadRequest("embed_override_token_id requires embed_overrides to be provided", kind="BadRequest")
