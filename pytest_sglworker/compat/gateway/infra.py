"""The names a gateway e2e test file imports from upstream's ``infra`` package, served by the plugin.

sglang's gateway suite (``sgl-model-gateway/e2e_test/``) puts its own folder on ``sys.path`` and its test files say
``from infra import ConnectionMode, Gateway, ModelPool``. Under :mod:`pytest_sglworker.compat.gateway` that name is
this module: the plugin registers it as ``sys.modules["infra"]`` when it is loaded, before any test file is
imported, so the import resolves here whether the suite's own ``infra/`` folder was removed or is still there
(it is shadowed, never imported). See :func:`pytest_sglworker.compat.gateway.claim_infra`.

What is here: upstream's constants and enums (the same values), its model table (``MODEL_SPECS``: the suite's
model ids and the Hugging Face model each names, which the drop-in maps to registered specs), and the runtime
classes (:class:`~.gateway.Gateway`, :class:`~.pool.ModelPool`, :class:`~.runtime.ModelInstance`,
:class:`~.gateway.WorkerInfo`, :class:`~.runtime.WorkerIdentity`) and helpers (``kill_process_tree``,
``wait_for_health``, ``wait_for_workers_ready``). Upstream's GPU allocator, GPU monitor, port picker and eval
harness are not offered: the plugin leases GPUs and ports itself; asking for one of them is an ``ImportError``
that says so and what to use instead.

"""

from __future__ import annotations

from typing import Any

from ..dropins import kill_process_tree
from .constants import *  # noqa: F403  (upstream's constants, enums and model table, every one)
from .constants import DEFAULT_PATHS
from .constants import __all__ as _constants
from .gateway import Gateway, WorkerInfo, wait_for_health, wait_for_workers_ready
from .pool import ModelPool
from .runtime import ModelInstance, WorkerIdentity, model_path_of

__all__ = [*_constants, "Gateway", "ModelInstance", "ModelPool", "WorkerIdentity", "WorkerInfo", "kill_process_tree",
           "wait_for_health", "wait_for_workers_ready"]

#: upstream names the drop-in does not offer, and what to use instead
NOT_OFFERED = {
    "GPUAllocator": "the plugin leases GPUs itself (file-locked leases shared across xdist workers)",
    "GPUInfo": "the plugin leases GPUs itself",
    "GPUSlot": "the plugin leases GPUs itself",
    "nvml_context": "the plugin leases GPUs itself",
    "get_physical_device_indices": "the plugin leases GPUs itself",
    "get_gpu_memory_usage": "the plugin leases GPUs itself",
    "wait_for_gpu_memory_to_clear": "the plugin waits for a GPU's memory before it hands the lease on",
    "get_open_port": "a port from bind(0) races other processes; the plugin reserves port blocks for workers and "
                     "routers (Gateway() takes its ports from one)",
    "terminate_process": "end workers through the pool, routers with Gateway.shutdown()",
    "detect_ib_device": "prefill/decode workers on this plugin need no InfiniBand device",
    "run_eval": "upstream's eval harness (MMLU and friends) is not part of the drop-in",
}


def __getattr__(name: str) -> Any:
    """Upstream's ``DEFAULT_*_MODEL_PATH``: the path the spec serving that model id loads (read when asked for,
    in the session that runs); a name the drop-in does not offer: an ``ImportError`` saying what to use."""
    if name in DEFAULT_PATHS:
        return model_path_of(DEFAULT_PATHS[name])
    if name in NOT_OFFERED:
        raise ImportError(f"infra.{name} is upstream's own and pytest_sglworker.compat.gateway does not offer it: "
                          f"{NOT_OFFERED[name]}", name=name)
    raise AttributeError(f"module 'infra' (pytest_sglworker.compat.gateway.infra) has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(DEFAULT_PATHS))
