"""Upstream's constants, enums and model table for the gateway e2e suite (``sgl-model-gateway/e2e_test/infra``), with
the same names and values; :mod:`.infra` re-exports them as the module ``infra``. Plain Python."""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = [
    "CHAT_MODELS",
    "CLOUD_RUNTIMES",
    "DEFAULT_HOST",
    "DEFAULT_MODEL",
    "DEFAULT_PATHS",
    "DEFAULT_ROUTER_TIMEOUT",
    "DEFAULT_STARTUP_TIMEOUT",
    "EMBEDDING_MODELS",
    "ENV_BACKENDS",
    "ENV_MODEL",
    "ENV_MODELS",
    "ENV_SHOW_ROUTER_LOGS",
    "ENV_SHOW_WORKER_LOGS",
    "ENV_SKIP_BACKEND_SETUP",
    "ENV_SKIP_MODEL_POOL",
    "ENV_STARTUP_TIMEOUT",
    "FUNCTION_CALLING_MODELS",
    "HEALTH_CHECK_INTERVAL",
    "LOCAL_MODES",
    "LOCAL_RUNTIMES",
    "MODEL_SPECS",
    "PARAM_BACKEND_ROUTER",
    "PARAM_MODEL",
    "PARAM_SETUP_BACKEND",
    "REASONING_MODELS",
    "THIRD_PARTY_MODELS",
    "ConnectionMode",
    "Runtime",
    "WorkerType",
    "get_model_spec",
]


class ConnectionMode(str, Enum):
    """How the gateway talks to a worker."""

    HTTP = "http"
    GRPC = "grpc"


class WorkerType(str, Enum):
    """A worker's role."""

    REGULAR = "regular"
    PREFILL = "prefill"
    DECODE = "decode"


class Runtime(str, Enum):
    """Where a model runs."""

    SGLANG = "sglang"
    VLLM = "vllm"
    OPENAI = "openai"
    XAI = "xai"
    GEMINI = "gemini"


LOCAL_MODES = frozenset({ConnectionMode.HTTP, ConnectionMode.GRPC})
LOCAL_RUNTIMES = frozenset({Runtime.SGLANG, Runtime.VLLM})
CLOUD_RUNTIMES = frozenset({Runtime.OPENAI, Runtime.XAI, Runtime.GEMINI})

PARAM_SETUP_BACKEND = "setup_backend"
PARAM_BACKEND_ROUTER = "backend_router"
PARAM_MODEL = "model"

#: the suite's default model id (``E2E_MODEL`` overrides it)
DEFAULT_MODEL = "llama-8b"

ENV_MODELS = "E2E_MODELS"
ENV_BACKENDS = "E2E_BACKENDS"
ENV_MODEL = "E2E_MODEL"
ENV_STARTUP_TIMEOUT = "E2E_STARTUP_TIMEOUT"
ENV_SKIP_MODEL_POOL = "SKIP_MODEL_POOL"
ENV_SKIP_BACKEND_SETUP = "SKIP_BACKEND_SETUP"
ENV_SHOW_ROUTER_LOGS = "SHOW_ROUTER_LOGS"
ENV_SHOW_WORKER_LOGS = "SHOW_WORKER_LOGS"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_STARTUP_TIMEOUT = 300
DEFAULT_ROUTER_TIMEOUT = 60
HEALTH_CHECK_INTERVAL = 5


def _spec(model: str, memory_gb: int, tp: int, *features: str) -> dict[str, Any]:
    return {"model": model, "memory_gb": memory_gb, "tp": tp, "features": list(features)}


#: The suite's model ids and what each names (upstream's ``infra/model_specs.py`` table). The drop-in serves an id
#: with a registered spec: the spec the id itself resolves to (``SGLWORKER_COMPAT_MODELS``, ``map_model``, a spec
#: of that name), else the one that serves the Hugging Face model named here.
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "llama-8b": _spec("meta-llama/Llama-3.1-8B-Instruct", 16, 1, "chat", "streaming", "function_calling"),
    "llama-1b": _spec("meta-llama/Llama-3.2-1B-Instruct", 4, 1, "chat", "streaming", "tool_choice"),
    "qwen-7b": _spec("Qwen/Qwen2.5-7B-Instruct", 14, 1, "chat", "streaming", "function_calling", "pythonic_tools"),
    "qwen-14b": _spec("Qwen/Qwen2.5-14B-Instruct", 28, 2, "chat", "streaming", "function_calling", "pythonic_tools"),
    "deepseek-7b": _spec("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 14, 1, "chat", "streaming", "reasoning"),
    "qwen-30b": _spec("Qwen/Qwen3-30B-A3B", 60, 4, "chat", "streaming", "thinking", "reasoning"),
    "mistral-7b": _spec("mistralai/Mistral-7B-Instruct-v0.3", 14, 1, "chat", "streaming", "function_calling"),
    "embedding": _spec("intfloat/e5-mistral-7b-instruct", 14, 1, "embedding"),
    "gpt-oss": _spec("openai/gpt-oss-20b", 40, 2, "chat", "streaming", "reasoning", "harmony"),
}

#: The cloud backends (``setup_backend`` parameters that need no local worker) and the API key each needs.
THIRD_PARTY_MODELS: dict[str, dict[str, str]] = {
    "openai": {"description": "OpenAI API", "model": "gpt-5-nano", "api_key_env": "OPENAI_API_KEY",
               "worker_url": "https://api.openai.com"},
    "xai": {"description": "xAI API", "model": "grok-4-fast", "api_key_env": "XAI_API_KEY",
            "worker_url": "https://api.x.ai"},
}


def get_model_spec(model_id: str) -> dict[str, Any]:
    """Upstream's entry for ``model_id``; ``KeyError`` naming the known ids otherwise."""
    if model_id not in MODEL_SPECS:
        raise KeyError(f"Unknown model: {model_id}. Available: {list(MODEL_SPECS)}")
    return MODEL_SPECS[model_id]


def _with(feature: str) -> list[str]:
    return [model_id for model_id, spec in MODEL_SPECS.items() if feature in spec["features"]]


CHAT_MODELS = _with("chat")
EMBEDDING_MODELS = _with("embedding")
REASONING_MODELS = _with("reasoning")
FUNCTION_CALLING_MODELS = _with("function_calling")

#: upstream's ``DEFAULT_*_MODEL_PATH`` constants: the model id each names (read as the path its spec loads)
DEFAULT_PATHS = {
    "DEFAULT_MODEL_PATH": "llama-8b",
    "DEFAULT_SMALL_MODEL_PATH": "llama-1b",
    "DEFAULT_REASONING_MODEL_PATH": "deepseek-7b",
    "DEFAULT_ENABLE_THINKING_MODEL_PATH": "qwen-30b",
    "DEFAULT_QWEN_FUNCTION_CALLING_MODEL_PATH": "qwen-7b",
    "DEFAULT_MISTRAL_FUNCTION_CALLING_MODEL_PATH": "mistral-7b",
    "DEFAULT_GPT_OSS_MODEL_PATH": "gpt-oss",
    "DEFAULT_EMBEDDING_MODEL_PATH": "embedding",
}
