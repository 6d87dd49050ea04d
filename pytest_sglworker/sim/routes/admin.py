"""The simulated engine's admin endpoints: health and readiness, model and server info, the cache flush, the
metrics, and the sim's own fault control endpoint (``/_sim/faults``).

Part of :mod:`pytest_sglworker.sim`; stdlib only. The health endpoints answer 503 until the warmup is over and
while the server drains; the health faults (``slow_health``, ``health_fail*``) apply to all of them. The control
endpoint is exempt from the API key and from the faults themselves (:mod:`pytest_sglworker.sim.server`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..core import CONTROL_PATH
from ..faults import FaultError, known_faults
from ..state import VERSION, Sim
from .common import Request, Route

#: ``/model_info``'s ``embedding`` object (sglang 0.5.23 on the tiny Llama, without and with --is-embedding).
_EMBEDDING_OFF = {
    "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
    "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
    "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
    "enabled": False, "matryoshka_dimensions": [],
}
_EMBEDDING_ON = {
    **_EMBEDDING_OFF, "family": "explicit_decoder_embedding", "task": "embed", "execution": "decoder_pooling",
    "attention": "causal", "normalize": True, "postprocessor": "model_defined", "requires_embedding_flag": True,
    "bcg_eligibility": "standard", "enabled": True,
}
#: ``/server_info`` fields of sglang 0.5.23 that are not flags of its parser.
_SERVER_INFO_FIELDS: dict[str, Any] = {
    "_radix_eviction_policy_explicitly_set": False, "_speculative_draft_quantization_explicitly_set": False,
    "_swa_full_tokens_ratio_explicitly_set": False, "aux_hidden_state_capture": None,
    "custom_sigquit_handler": None, "enable_cp_tp_group_sharing": False, "grpc_worker_threads": 4,
    "kv_events": None, "speculative_boundary_reduction": "rs+rsv", "stat_loggers": None,
    "uses_mamba_radix_cache": False, "watermark_context_window": 4, "watermark_default_enabled": False,
    "watermark_enforce_all": False, "watermark_key": "<redacted>", "watermark_key_b": "<redacted>",
    "watermark_max_probability": 1.0, "watermark_mixing_probability": 0.5,
}
_NOT_IN_SERVER_INFO = ("config",)


def health(ctx: Request) -> None:
    sim = ctx.sim
    faults = sim.state.snapshot()
    if faults.slow_health:
        time.sleep(faults.slow_health)
    if sim.shutting_down:
        sim.log.info("Health check request received during shutdown. Returning 503.")
    ok = sim.ready and not sim.shutting_down and not sim.state.health_failing()
    ctx.send(200 if ok else 503, b"", None)


def ready(ctx: Request) -> None:
    # The health faults (slow_health, health_fail*) apply to every health endpoint, /ready included.
    sim = ctx.sim
    faults = sim.state.snapshot()
    if faults.slow_health:
        time.sleep(faults.slow_health)
    ok = sim.ready and not sim.shutting_down and not sim.state.health_failing()
    ctx.send(200 if ok else 503, b"", None)


def ping(ctx: Request) -> None:
    ctx.send(200, b"", None)


def _deprecated(sim: Sim, old: str, new: str) -> None:
    sim.log.warning(
        f"Endpoint '{old}' is deprecated and will be removed in a future version. Please use '{new}' instead."
    )


def model_info(ctx: Request) -> None:
    sim = ctx.sim
    if ctx.path.startswith("/get_"):
        _deprecated(sim, "/get_model_info", "/model_info")
    plan = sim.plan
    ctx.json(200, {
        "model_path": plan.args["model_path"],
        "served_model_name": plan.served_model_name,
        "tokenizer_path": plan.args["tokenizer_path"],
        "is_generation": not plan.is_embedding,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": plan.args.get("reasoning_parser"),
        "tool_call_parser": plan.args.get("tool_call_parser"),
        "disaggregation_mode": plan.mode,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": plan.model.model_type or plan.facts.model_type,
        "architectures": [plan.model.architecture or plan.facts.architecture],
        "embedding": {**(_EMBEDDING_ON if plan.is_embedding else _EMBEDDING_OFF), "bcg": {
            "prefill_backend": plan.prefill_backend, "enabled": plan.prefill_backend != "disabled",
            "capture_token_budget": plan.prefill_buckets[-1] if plan.prefill_buckets else 0,
            "capture_batch_sizes": list(plan.prefill_buckets)},
            "cache": {"kv_cache_disabled": False,
                      "radix_cache_disabled": bool(plan.args.get("disable_radix_cache")),
                      "chunked_prefill_disabled": plan.chunked_prefill_size <= 0}},
    })


def server_info(sim: Sim) -> dict[str, Any]:
    """``/server_info``'s body: the resolved flags, sglang's other fields, the memory and startup figures."""
    plan = sim.plan
    args = {k: v for k, v in plan.args.items() if k not in _NOT_IN_SERVER_INFO}
    info = {**args, **_SERVER_INFO_FIELDS}
    mem = {"weight": round(plan.weights, 3), "kvcache": round(plan.max_total_tokens * plan.kv_bytes_per_token
                                                              / 2**30, 3),
           "startup_available": round(plan.avail_before, 3), "token_capacity": plan.max_total_tokens,
           "token_capacity_swa": None,
           "graph": {"prefill": 0.0, "decode": 0.0, "target_verify": 0.0, "draft_prefill": 0.0,
                     "draft_decode": 0.0, "draft_extend": 0.0}}
    internal = {**{k: v for k, v in info.items() if k not in ("custom_sigquit_handler", "kv_events")},
                "startup_time": dict(sim.startup_timings), "decode_cuda_graph_bs": [],
                "decode_cuda_graph_memory_gb": 0.0,
                "effective_max_running_requests_per_dp": plan.max_running_requests, "last_gen_throughput": 0.0,
                "memory_usage": mem, "world_size": plan.args["tp_size"]}
    info.update(
        internal_states=[internal],
        max_total_num_tokens=plan.max_total_tokens,
        max_req_input_len=plan.max_req_input_len,
        startup_time=dict(sim.startup_timings),
        launch_command=" ".join(plan.args.get("_argv") or []),
        hicache_object_layout={"enabled": False, "backend": None, "page_size": plan.page_size,
                               "hicache_object_layout": {"pools": []},
                               "reason": "Hierarchical cache is disabled"},
        status="ready" if sim.ready else "starting",
        version=VERSION,
        frontend="python",
    )
    info.pop("_argv", None)
    internal.pop("_argv", None)
    return info


def server_info_route(ctx: Request) -> None:
    sim = ctx.sim
    if ctx.path.startswith("/get_"):
        _deprecated(sim, "/get_server_info", "/server_info")
    ctx.json(200, server_info(sim))


def flush_cache(ctx: Request) -> None:
    sim = ctx.sim
    sim.flush_cache()
    ctx.send(200, b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                  b"waiting requests, the operation will not be performed.)\n", None)


def metrics(ctx: Request) -> None:
    sim = ctx.sim
    ctx.send(200, sim.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")


def control(ctx: Request) -> None:
    sim = ctx.sim
    if ctx.command == "POST":
        try:
            sim.state.update(json.loads(ctx.body or b"{}"))
        except ValueError as exc:  # FaultError is a ValueError, and so is bad JSON
            message = str(exc) if isinstance(exc, FaultError) else f"POST {CONTROL_PATH}: invalid JSON: {exc}"
            ctx.json(400, {"error": message, "known": known_faults()})
            return
        sim.log.info(f"(sim) request faults set: {json.dumps(sim.state.snapshot().as_dict())}")
    ctx.json(200, {"worker": sim.worker_id, **sim.state.describe(), "served": sim.inference_served,
                   "known": known_faults()})


def _metrics_enabled(sim: Sim) -> bool:
    return bool(sim.plan.args["enable_metrics"])


#: The fault control endpoint (on the gRPC sidecar too).
CONTROL = Route(("GET", "POST"), CONTROL_PATH, control)
#: ``/metrics``, served with ``--enable-metrics`` only (on the gRPC sidecar too).
METRICS = Route(("GET",), "/metrics", metrics, when=_metrics_enabled)

ROUTES: tuple[Route, ...] = (
    Route(("GET",), "/health", health),
    Route(("GET",), "/health_generate", health),
    Route(("GET",), "/ready", ready),
    Route(("GET",), "/ping", ping),
    Route(("GET",), "/model_info", model_info),
    Route(("GET",), "/get_model_info", model_info),
    Route(("GET",), "/server_info", server_info_route),
    Route(("GET",), "/get_server_info", server_info_route),
    Route(("GET", "POST"), "/flush_cache", flush_cache),
    METRICS,
    CONTROL,
)
