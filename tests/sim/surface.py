"""What the simulated engine does with every route and every server flag of sglang 0.5.23 (the list read from the
real engine's own source by ``scripts/sim_surface.py``: ``tests/data/sim/server_surface.json``), and the page that
says it, ``docs/SIM_FLAGS.md``.

    python tests/sim/surface.py          # writes docs/SIM_FLAGS.md

Each route and flag has one class:

- ``simulated``: a client sees what the real engine shows (the test that holds it is named);
- ``refused``: a startup the real CPU engine refuses (or dies of), refused the same way;
- ``unobservable``: nothing a client reads over HTTP changes (kernels, memory and scheduling tuning on one GPU,
  logging destinations, ...), so the sim only accepts it (sglang's own parser: the same values are refused);
- ``not simulated``: a client could see it, the sim accepts the flag (or answers 404 on the route) and does not
  act on it; the reason says what differs.

Routes are ``simulated`` when the sim's route table serves them (checked against ``pytest_sglworker.sim.routes``),
else they need an entry in :data:`ROUTES_NOT_SIMULATED`. Flags take the first match: :data:`FLAGS` (by name),
then :data:`FLAG_FAMILIES` (by pattern); a flag matched by neither is an error of ``test_sim_surface.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "sim" / "server_surface.json"
DOC = REPO / "docs" / "SIM_FLAGS.md"

SIMULATED, REFUSED, UNOBSERVABLE, NOT_SIMULATED = "simulated", "refused", "unobservable", "not simulated"
CLASSES = (SIMULATED, REFUSED, UNOBSERVABLE, NOT_SIMULATED)

_FLAGS_TEST = "tests/sim/test_sim_server_flags.py"
_FIELDS_TEST = "tests/sim/test_sim_fields.py"
_SIM_TEST = "tests/sim/test_sim.py"
_PD_TEST = "tests/sim/test_sim_pd.py"
_OPS_TEST = "tests/sim/test_sim_ops.py"
_CHAT_TEST = "tests/sim/test_sim_chat.py"
_EFFECTS_TEST = "tests/sim/test_sim_flag_effects.py"
_GRPC_TEST = "tests/workers/test_grpc_worker.py"
#: what the sim does that no test of its own holds yet (the page says so)
_UNTESTED = "no test of its own yet"

#: flags by name: (class, what the sim does or why)
FLAGS: dict[str, tuple[str, str]] = {
    "model_path": (SIMULATED, f"the model directory's config and tokenizer ({_SIM_TEST})"),
    "tokenizer_path": (SIMULATED, f"the tokenizer the prompts are counted with ({_SIM_TEST})"),
    "served_model_name": (SIMULATED, f"the model name of /v1/models and the answers ({_SIM_TEST})"),
    "host": (SIMULATED, f"the address it binds ({_EFFECTS_TEST})"),
    "port": (SIMULATED, f"the port it binds ({_SIM_TEST})"),
    "api_key": (SIMULATED, f"401 without the key ({_SIM_TEST})"),
    "context_length": (SIMULATED, "prompt and max_tokens refusals at the context length "
                                  "(tests/sim/test_sim_openai_families.py)"),
    "allow_auto_truncate": (SIMULATED, f"a long input or max_tokens truncated, not refused ({_EFFECTS_TEST})"),
    "is_embedding": (SIMULATED, f"/encode and /v1/embeddings served, generation refused ({_SIM_TEST})"),
    "skip_tokenizer_init": (SIMULATED, f"answers without text, a text prompt refused with 400 ({_FLAGS_TEST})"),
    "incremental_streaming_output": (SIMULATED, f"each chunk's own text and ids ({_FLAGS_TEST})"),
    "disable_radix_cache": (SIMULATED, f"cached_tokens 0; input_embeds accepted ({_FLAGS_TEST})"),
    "enable_streaming_session": (SIMULATED, f"a streaming session refused without it ({_FLAGS_TEST})"),
    "skip_server_warmup": (SIMULATED, f"no warmup request before ready ({_SIM_TEST})"),
    "enable_metrics": (SIMULATED, f"/metrics served only with it ({_SIM_TEST})"),
    "enable_custom_logit_processor": (SIMULATED, f"custom_logit_processor refused without it ({_SIM_TEST})"),
    "enable_return_hidden_states": (SIMULATED, f"return_hidden_states refused without it ({_FIELDS_TEST})"),
    "return_hidden_states_mode": (SIMULATED, f"return_hidden_states refused without it ({_FIELDS_TEST})"),
    "enable_watermark": (SIMULATED, f"a watermark refused without it ({_FIELDS_TEST})"),
    "watermark_config": (NOT_SIMULATED, "watermarked outputs are not simulated (only the refusal without the flag)"),
    "enable_strict_thinking": (SIMULATED, f"max_thinking_tokens refused without it ({_FIELDS_TEST})"),
    "enable_lora": (SIMULATED, f"lora_path refused without it ({_FIELDS_TEST})"),
    "lora_paths": (SIMULATED, f"lora_path refused without adapters ({_FIELDS_TEST})"),
    "dp_size": (SIMULATED, f"routed_dp_rank's range, one load per rank in /v1/loads ({_OPS_TEST})"),
    "stream_response_default_include_usage": (SIMULATED, f"usage in the last chunk by default ({_EFFECTS_TEST})"),
    "reasoning_parser": (NOT_SIMULATED, "named in /server_info only: the sim does not split reasoning_content from "
                                          "the content (its answers are the prompt's own tokens)"),
    "tool_call_parser": (NOT_SIMULATED, "named in /server_info only: the sim does not parse tool calls from the "
                                         "content (its answers are the prompt's own tokens)"),
    "max_total_tokens": (SIMULATED, f"the KV pool size of the logs, /server_info and /v1/loads ({_SIM_TEST})"),
    "mem_fraction_static": (SIMULATED, f"the memory ledger's pool and its startup failure ({_SIM_TEST})"),
    "page_size": (SIMULATED, f"cached_tokens rounded to pages ({_SIM_TEST})"),
    "chunked_prefill_size": (SIMULATED, f"/server_info and the startup log ({_SIM_TEST})"),
    "max_running_requests": (SIMULATED, f"/server_info and /v1/loads' running and waiting ({_SIM_TEST})"),
    "max_prefill_tokens": (SIMULATED, f"/server_info and the startup log ({_EFFECTS_TEST})"),
    "grpc_mode": (SIMULATED, "sglang's gRPC server instead of HTTP: Generate under the request's constraint and "
                             f"penalties, Embed's flat answer (tests/sim/test_sim_grpc.py, {_GRPC_TEST})"),
    "smg_grpc_mode": (SIMULATED, f"the gRPC server with its HTTP sidecar ({_EFFECTS_TEST})"),
    "smg_http_sidecar_port": (SIMULATED, f"the sidecar's port ({_EFFECTS_TEST})"),
    "disaggregation_mode": (SIMULATED, f"prefill and decode servers with sglang's bootstrap handshake ({_PD_TEST})"),
    "disaggregation_bootstrap_port": (SIMULATED, f"the prefill side's bootstrap server ({_PD_TEST})"),
    "disaggregation_transfer_backend": (SIMULATED, f"named in the handshake ({_PD_TEST})"),
    "kv_events_config": (REFUSED, f"a config that is not JSON ends the startup as the real engine's ({_EFFECTS_TEST})"),
    "attention_backend": (REFUSED, f"triton with --device cpu: the scheduler dies at the first forward pass, "
                                   f"'0 active drivers' ({_FLAGS_TEST}); other values unobservable"),
    "prefill_attention_backend": (REFUSED, f"as --attention-backend ({_EFFECTS_TEST})"),
    "decode_attention_backend": (REFUSED, f"as --attention-backend ({_EFFECTS_TEST})"),
    "device": (SIMULATED, f"cpu with a Triton attention backend dies as the real engine does ({_FLAGS_TEST})"),
    "tp_size": (REFUSED, f"more GPUs than CUDA_VISIBLE_DEVICES has: 'invalid device ordinal' ({_SIM_TEST})"),
    "base_gpu_id": (REFUSED, f"as --tp-size ({_EFFECTS_TEST})"),
    "nccl_port": (SIMULATED, "in the startup log; a pinned port with --dp-size > 1 (no DP attention), which the real "
                             "engine's second rank cannot bind, is not refused, and the plugin no longer pins one "
                             f"there ({_SIM_TEST})"),
    "cuda_graph_backend_decode": (SIMULATED, f"the capture log lines and their time ({_SIM_TEST})"),
    "cuda_graph_backend_prefill": (SIMULATED, f"the capture log lines and their time ({_SIM_TEST})"),
    "cuda_graph_max_bs_decode": (SIMULATED, f"the captured batch sizes in the log ({_EFFECTS_TEST})"),
    "disable_cuda_graph": (SIMULATED, f"its deprecation warning, no capture ({_EFFECTS_TEST})"),
    "enable_hierarchical_cache": (SIMULATED, f"the host memory line of the startup log ({_EFFECTS_TEST})"),
    "enable_deterministic_inference": (NOT_SIMULATED, "the real engine honours sampling_seed only with it; the sim "
                                                      "repeats a seeded sample always, to stay reproducible"),
    "random_seed": (NOT_SIMULATED, "the real engine's unseeded samples follow it; the sim's answers do not sample"),
    "sampling_defaults": (NOT_SIMULATED, "the model's generation_config defaults change real samples; the sim's "
                                         "answers do not sample"),
    "preferred_sampling_params": (NOT_SIMULATED, "defaults the real engine samples with; the sim does not sample"),
    "enable_cache_report": (NOT_SIMULATED, "cached token counts in OpenAI usage: not simulated"),
    "return_input_ids": (NOT_SIMULATED, "input ids in OpenAI answers by default: not simulated"),
    "return_output_ids": (NOT_SIMULATED, "output ids in OpenAI answers by default: not simulated"),
    "chat_template": (NOT_SIMULATED, "the sim renders the model's own template (or its fallback) only"),
    "completion_template": (NOT_SIMULATED, "code completion templates: not simulated"),
    "hf_chat_template_name": (NOT_SIMULATED, "the sim renders the model's default template only"),
    "default_chat_template_kwargs": (NOT_SIMULATED, "template kwargs: not simulated"),
    "trust_request_chat_template": (NOT_SIMULATED, "a request's own chat template: not simulated"),
    "admin_api_key": (NOT_SIMULATED, "the admin key of the admin routes: not simulated"),
    "weight_version": (NOT_SIMULATED, "the sim reports weight_version 'default' whatever the flag"),
    "fastapi_root_path": (NOT_SIMULATED, "the sim serves at the root path only"),
    "enable_http2": (NOT_SIMULATED, "the sim serves HTTP/1.1 only"),
    "ssl_keyfile": (NOT_SIMULATED, "the sim serves plain HTTP only"),
    "ssl_certfile": (NOT_SIMULATED, "the sim serves plain HTTP only"),
    "ssl_ca_certs": (NOT_SIMULATED, "the sim serves plain HTTP only"),
    "ssl_keyfile_password": (NOT_SIMULATED, "the sim serves plain HTTP only"),
    "enable_ssl_refresh": (NOT_SIMULATED, "the sim serves plain HTTP only"),
    "max_queued_requests": (NOT_SIMULATED, "a full queue's 503: not simulated (the sim serves every request)"),
    "enable_priority_scheduling": (NOT_SIMULATED, "priority refusals and preemption: not simulated"),
    "abort_on_priority_when_disabled": (NOT_SIMULATED, "a priority request's abort: not simulated"),
    "enable_return_routed_experts": (NOT_SIMULATED, "routed experts in meta_info: the sim's model has none"),
    "enable_return_indexer_topk": (NOT_SIMULATED, "indexer top-k in meta_info: the sim's model has none"),
    "enable_return_aux_hidden_states": (NOT_SIMULATED, "auxiliary hidden states: not simulated"),
    "return_aux_hidden_state_layer_ids": (NOT_SIMULATED, "auxiliary hidden states: not simulated"),
    "sampling_mask_max_tokens": (NOT_SIMULATED, "the sampling mask's cap: the sim's mask is one token per step"),
    "stream_interval": (NOT_SIMULATED, "the real engine sends a chunk every N tokens; the sim one per token"),
    "tokenizer_worker_num": (NOT_SIMULATED, "several HTTP worker processes: the sim is one process"),
    "enable_response_store": (NOT_SIMULATED, "stored /v1/responses: not simulated"),
    "tool_server": (NOT_SIMULATED, "the Responses API's tool server: not simulated"),
    "strip_thinking_cache": (NOT_SIMULATED, "cache stripping of thinking tokens: not simulated"),
    "load_format": (NOT_SIMULATED, "dummy weights change the real answers; the sim has no weights"),
    "json_model_override_args": (NOT_SIMULATED, "the sim reads the model's config as written"),
    "revision": (NOT_SIMULATED, "the sim reads the model directory given"),
    "trust_remote_code": (NOT_SIMULATED, "the sim loads no model code"),
    "use_ray": (NOT_SIMULATED, "a Ray-placed engine: not simulated"),
}

_INTERNAL = "changes how the engine computes, not what a client reads"
#: flags by pattern, after :data:`FLAGS`: (regex, class, why)
FLAG_FAMILIES: tuple[tuple[str, str, str], ...] = (
    (r"^(speculative_|spec_|decoupled_spec_|enable_multi_layer_eagle$|uno_lora_path$)", NOT_SIMULATED,
     "speculative decoding needs a draft model; the real answers' speculative counters in meta_info are absent"),
    (r"^(lora_|max_lora|max_loaded_loras$|max_loras_per_batch$|enable_lora_|experts_shared_outer_loras$)",
     NOT_SIMULATED, "LoRA adapters are not simulated beyond the refusal without --enable-lora"),
    (r"^(disaggregation_|num_reserved_decode_tokens$|optimistic_prefill_attempts$|enable_pd_role_switch$)",
     UNOBSERVABLE, "PD tuning on either side: the answers are the same; the handshake is simulated (test_sim_pd)"),
    (r"^(encoder_|enable_adaptive_dispatch_to_encoder$|language_only$|encoder_only$|language_model_only$)",
     NOT_SIMULATED, "encoder/language disaggregation of multimodal models: not simulated"),
    (r"^(mm_|enable_multimodal$|image_processor_backend$|disable_fast_image_processor$|limit_mm_data|"
     r"enable_prefix_mm_cache$|enable_mm_global_cache$|enable_broadcast_mm_inputs_process$|trust_mm_content|"
     r"media_url_max_file_size_mb$|allowed_media_domains$|asr_)",
     NOT_SIMULATED, "multimodal and audio inputs are not simulated"),
    (r"^(log_|uvicorn_access_log|decode_log_interval$|show_time_cost$|enable_request_time_stats_logging$|"
     r"crash_dump_folder$|gc_warning_threshold_secs$|enable_trace$|trace_modules$|otlp_|debug_|"
     r"enable_layerwise_nvtx_marker$|msprobe_dump_config$|export_metrics_to_file|kv_canary)",
     UNOBSERVABLE, "logging, tracing and dumps go to the engine's own outputs, not to a client"),
    (r"^(bucket_|prompt_tokens_buckets$|generation_tokens_buckets$|extra_metric_labels$|tokenizer_metrics_|"
     r"enable_metrics_for_all_schedulers$|enable_mfu_metrics$|enable_forward_pass_metrics$|forward_pass_metrics_|"
     r"load_snapshot_publish_interval$|load_publish_endpoint$)",
     NOT_SIMULATED, "metric buckets, labels and extra metrics: the sim's /metrics has the core gauges only"),
    (r"^(cuda_graph_|disable_.*cuda_graph|enable_cudagraph_gc$|enable_profile_cuda_graph$|torch_compile_|"
     r"enable_torch_compile|triton_attention_|enable_tf32_matmul$|enable_fp32_lm_head$)",
     UNOBSERVABLE, "graph capture and compilation: " + _INTERNAL),
    (r"_backend$|_backend_|^flashinfer_|^disable_flashinfer|^enable_flashinfer|^enforce_disable_flashinfer|"
     r"^fp[48]_gemm|^bf16_gemm|^enable_aiter|^disable_aiter|^dsa_|^dsv4_|^enable_dsa|^qsa_|^enable_lean_attention$|"
     r"^enable_amd_monokernel$|^enable_nvidia_megakernel$|^enable_fused_|^enable_scattered_sconv$|^mlx_",
     UNOBSERVABLE, "kernel and backend choices: " + _INTERNAL),
    (r"^(moe_|ep_|enable_eplb$|eplb_|deepep_|fuseep_|init_expert_location$|expert_|elastic_ep_|max_ep_size$|"
     r"enable_elastic_expert_backup$|enable_waterfill$|mooncake_ib_device$|enable_paged_experts$|"
     r"paged_experts_|disable_shared_experts_fusion$|enforce_shared_experts_fusion$|shared_experts_tp_size$|"
     r"enable_shared_experts_attn_tp$|enable_w4a4_mxfp4_megamoe$|enable_megamoe_for_layernorm_sp$|"
     r"flashinfer_mxfp4_moe_precision$|kt_|disable_flashinfer_cutlass_moe)",
     UNOBSERVABLE, "mixture-of-experts placement and kernels: " + _INTERNAL),
    (r"^(pp_|attn_cp_size$|attn_dp_size$|dcp_|cp_strategy$|enable_prefill_cp$|enable_cp_|moe_dp_size$|dwdp_size$|"
     r"enable_dp_attention|enable_dp_lm_head$|enable_tp_lm_head_all_to_all$|enable_attn_tp_input_scattered$|"
     r"disable_attn_tp_gather$|enable_dense_mlp_attn_tp$|enable_layernorm_sp$|enable_kv_cache_sharding$|"
     r"boundary_reduction$|enable_quant_communications$|nnodes$|node_rank$|dist_init_addr$|dist_timeout$|"
     r"gpu_id_step$|enable_p2p_check$|disable_custom_all_reduce$|enable_mscclpp$|enable_symm_mem$|"
     r"enable_torch_symm_mem$|enable_nccl_nvls$|pre_warm_nccl$|gated_launch_port$|load_balance_method$|"
     r"enable_two_batch_overlap$|enable_single_batch_overlap$|tbo_token_distribution_threshold$|sm_group_num$|"
     r"enable_pdmux$|pdmux_config_path$|numa_node$|engine_info_bootstrap_port$|enable_cp_tp_group_sharing$|"
     r"enable_linker_mla_dedup$|enable_dsa_cache_layer_split$)",
     UNOBSERVABLE, "parallel layout and communication: " + _INTERNAL + " (the sim is one process)"),
    (r"^(hicache_|enable_hisparse$|hisparse_config$|enable_lmcache$|lmcache_config_file$|enable_flexkv$|"
     r"flexkv_config_file$|enable_unified_cache_external_linker$|unified_cache_external_linker_|"
     r"enable_session_radix_cache$|radix_eviction_policy|c128_page_size$|swa_|disable_hybrid_swa_memory$|"
     r"enable_encoder_swa_bounded_replay$|enable_decoder_swa_bounded_replay$|enable_page_major_kv_layout$|"
     r"enable_unified_memory$|disable_chunked_prefix_cache$|prefill_only_disable_kv_cache$|kv_cache_dtype$|"
     r"prefill_kv_cache_dequant_dtype$|mamba_|max_mamba_cache_size$|enable_mamba_|enable_int8_mamba_checkpoint$|"
     r"int8_mamba_ckpt_size$|enable_linear_replayssm|linear_replayssm_cache_len$)",
     UNOBSERVABLE, "KV cache layout, tiers and eviction: " + _INTERNAL + " (cached_tokens aside: the radix flag)"),
    (r"^(schedule_|scheduler_recv_interval$|num_continuous_decode_steps$|enable_mixed_chunk$|"
     r"disable_overlap_schedule$|enable_dynamic_chunking$|prefill_decode_interval|prefill_max_requests$|"
     r"retraction_policy$|disable_priority_preemption$|default_priority_value$|"
     r"priority_scheduling_preemption_threshold$|enable_prefill_delayer$|prefill_delayer_|min_free_slots_delay$|"
     r"batch_notify_size$|sleep_on_idle$|watchdog_timeout$|soft_watchdog_timeout$|gc_threshold$|"
     r"enable_dynamic_batch_tokenizer$|dynamic_batch_tokenizer_|enable_tokenizer_batch_encode$|"
     r"disable_tokenizer_batch_decode$|detokenizer_worker_num$|enable_http_worker_reuseport$|"
     r"http2_|grpc_port$|grpc_response_timeout_secs$|sidecar$|sidecar_args$|warmups$|"
     r"checkpoint_engine_wait_weights_before_ready$|enable_deepseek_v4_fp4_indexer$|rl_on_policy_target$|"
     r"rl_quant_profile$)",
     UNOBSERVABLE, "scheduling, batching and process tuning: " + _INTERNAL),
    (r"^(quantization|quantize_and_serve$|modelopt_|dtype$|load_format$|download_dir$|model_loader_extra_config$|"
     r"custom_weight_loader$|weight_loader_|startup_weight_load_mode$|remote_instance_weight_loader_|"
     r"delete_ckpt_after_loading$|decrypted_|model_checksum$|modelexpress_config$|model_impl$|"
     r"model_config_parser$|config$|cpu_offload_gb$|offload_|ple_offload_|enable_memory_saver$|"
     r"enable_weights_cpu_backup$|enable_draft_weights_cpu_backup$|weight_cache_|forward_hooks$|enable_mis$|"
     r"tokenizer_mode$|tokenizer_backend$|file_storage_path$|enable_precise_embedding_interpolation$|"
     r"dllm_|rl_|enable_return_|constrained_json_|disable_outlines_disk_cache$|grammar_backend$)",
     NOT_SIMULATED, "changes the model's numbers or outputs on the real engine (weights, dtype, quantization, "
                    "loading, grammar); the sim has no weights and its outputs are its own"),
)

#: routes of the real server the sim does not serve (it answers 404): path -> why
ROUTES_NOT_SIMULATED: dict[str | None, str] = {
    "/set_internal_state": "engine tuning at run time",
    "/classify": "classification models are not simulated",
    "/v1/classify": "classification models are not simulated",
    "/v1/rerank": "rerank models are not simulated",
    "/v1/decisions": "decision models are not simulated",
    "/v1/systemone": "not simulated",
    "/add_external_corpus": "speculative n-gram corpora are not simulated",
    "/remove_external_corpus": "speculative n-gram corpora are not simulated",
    "/list_external_corpora": "speculative n-gram corpora are not simulated",
    "/hicache/storage-backend/clear": "hierarchical cache storage is not simulated",
    "/hicache/storage-backend": "hierarchical cache storage is not simulated",
    "/get_hicache_l3_cache_layout": "hierarchical cache storage is not simulated",
    "/start_profile": "profiling is not simulated",
    "/stop_profile": "profiling is not simulated",
    "/set_trace_level": "tracing is not simulated",
    "/freeze_gc": "the engine's garbage collector is not simulated",
    "/start_expert_distribution_record": "expert statistics: the sim's model has no experts",
    "/stop_expert_distribution_record": "expert statistics: the sim's model has no experts",
    "/dump_expert_distribution_record": "expert statistics: the sim's model has no experts",
    "/update_weights_from_disk": "weight updates: the sim has no weights",
    "/init_weights_send_group_for_remote_instance": "weight transfer: the sim has no weights",
    "/send_weights_to_remote_instance": "weight transfer: the sim has no weights",
    "/get_remote_instance_transfer_engine_info": "weight transfer: the sim has no weights",
    "/remote_instance_transfer_engine_info": "weight transfer: the sim has no weights",
    "/init_weights_update_group": "weight updates: the sim has no weights",
    "/destroy_weights_update_group": "weight updates: the sim has no weights",
    "/update_weights_from_tensor": "weight updates: the sim has no weights",
    "/begin_weight_update": "weight updates: the sim has no weights",
    "/end_weight_update": "weight updates: the sim has no weights",
    "/update_weights_from_distributed": "weight updates: the sim has no weights",
    "/update_weights_from_ipc": "weight updates: the sim has no weights",
    "/update_weight_version": "weight versions: the sim reports 'default'",
    "/get_weights_by_name": "the sim has no weights",
    "/release_memory_occupation": "memory release for RL trainers is not simulated",
    "/resume_memory_occupation": "memory release for RL trainers is not simulated",
    "/weights_checker": "the sim has no weights",
    "/slow_down": "engine throttling is not simulated",
    "/pd_role_switch": "a PD role switch at run time is not simulated",
    "/load_lora_adapter": "LoRA adapters are not simulated",
    "/load_lora_adapter_from_tensors": "LoRA adapters are not simulated",
    "/unload_lora_adapter": "LoRA adapters are not simulated",
    "/configure_logging": "the engine's request logging is not simulated",
    "/parse_function_call": "the standalone function-call parser route is not simulated",
    "/separate_reasoning": "the standalone reasoning parser route is not simulated",
    "/pause_generation": "pausing the scheduler is not simulated",
    "/continue_generation": "pausing the scheduler is not simulated",
    "/v1/tokenize": "served by the sim under /tokenize only",
    "/v1/detokenize": "served by the sim under /detokenize only",
    "/v1/audio/transcriptions": "audio models are not simulated",
    "/v1/responses/{response_id}": "stored responses are not simulated",
    "/v1/responses/{response_id}/cancel": "stored responses are not simulated",
    "/api/chat": "the Ollama-compatible API is not simulated",
    "/api/generate": "the Ollama-compatible API is not simulated",
    "/api/tags": "the Ollama-compatible API is not simulated",
    "/api/show": "the Ollama-compatible API is not simulated",
    None: "the Ollama root route exists only when SGLANG_OLLAMA_ROOT_ROUTE names it: not simulated",
    "/invocations": "the SageMaker chat route is not simulated",
    "/vertex_generate": "the Vertex AI route is not simulated",
    "/dumper/{method}": "the tensor dumper is not simulated",
    "/": "the root page is not simulated",
    "/scale_elastic_ep": "elastic expert parallelism: the sim's model has no experts",
    "/is_scaling_elastic_ep": "elastic expert parallelism: the sim's model has no experts",
}


def flag_verdict(dest: str) -> tuple[str, str] | None:
    if dest in FLAGS:
        return FLAGS[dest]
    for pattern, cls, why in FLAG_FAMILIES:
        if re.search(pattern, dest):
            return cls, why
    return None


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x", path)


def route_verdict(route: dict[str, Any], served: list[Any]) -> tuple[str, str] | None:
    """``served``: the sim's :class:`~pytest_sglworker.sim.routes.common.Route` records."""
    path = route["path"]
    if path is not None:
        concrete = _concrete(path)
        for sim_route in served:
            hit = sim_route.path == concrete or (sim_route.prefix and concrete.startswith(sim_route.path))
            if hit and set(route["methods"]) & set(sim_route.methods) and sim_route.when is None:
                return SIMULATED, "served by the sim"
    if path in ROUTES_NOT_SIMULATED:
        return NOT_SIMULATED, ROUTES_NOT_SIMULATED[path]
    return None


def render(surface: dict[str, Any], served: list[Any]) -> str:
    routes = [(r, route_verdict(r, served)) for r in surface["routes"]]
    flags = [(f, flag_verdict(f)) for f in surface["flags"]]
    untested = sum(1 for _, v in flags if v and _UNTESTED in v[1])

    def counts(items: list[tuple[Any, tuple[str, str] | None]]) -> str:
        tally = {c: sum(1 for _, v in items if v and v[0] == c) for c in CLASSES}
        missing = sum(1 for _, v in items if v is None)
        return ", ".join(f"{n} {c}" for c, n in tally.items()) + f", {missing} unclassified"

    lines = [
        "# The simulated engine, flag by flag and route by route",
        "",
        "<!-- Generated by tests/sim/surface.py from tests/data/sim/server_surface.json: do not edit. -->",
        "",
        f"Every route of sglang {surface['sglang']}'s HTTP server and every flag of its `ServerArgs`, read from the "
        "real engine's own source by `scripts/sim_surface.py`, and what the simulated engine does with it: "
        "**simulated** (a client sees what the real engine shows; the test that holds it is named), **refused** (a "
        "startup the real CPU engine refuses or dies of, the same way), **unobservable** (nothing a client reads "
        "changes; the sim accepts the flag through sglang's own parser, which refuses the same values), **not "
        "simulated** (a client could see it; the sim ignores the flag or answers 404 on the route, for the reason "
        "given). Request fields are `docs/SIM_FIDELITY.md`'s. The real engine's answers to the server flags and "
        "routes the sim simulates are recorded in `tests/data/sim/server_flags_real.json`.",
        "",
        f"Routes: {len(routes)}: {counts(routes)}. Flags: {len(flags)}: {counts(flags)}; "
        + (f"{untested} of the simulated or refused ones have no test of their own yet." if untested else
           "each simulated or refused one names the test that holds it."),
        "",
        "## Routes",
        "",
        "| route | methods | class | why |",
        "|---|---|---|---|",
    ]
    for route, verdict in routes:
        cls, why = verdict or ("unclassified", "")
        shown = f"`{route['path']}`" if route["path"] else f"(`{route.get('env')}`)"
        lines.append(f"| {shown} | {', '.join(route['methods'])} | {cls} | {why} |")
    lines += ["", "## Flags", "", "| flag | class | why |", "|---|---|---|"]
    for dest, verdict in flags:
        cls, why = verdict or ("unclassified", "")
        lines.append(f"| `--{dest.replace('_', '-')}` | {cls} | {why} |")
    lines.append("")
    return "\n".join(lines)


def sim_routes() -> list[Any]:
    sys.path.insert(0, str(REPO))
    from pytest_sglworker.sim.routes import ROUTES

    return list(ROUTES)


if __name__ == "__main__":
    DOC.write_text(render(json.loads(DATA.read_text(encoding="utf-8")), sim_routes()), encoding="utf-8")
    print(f"wrote {DOC}")
