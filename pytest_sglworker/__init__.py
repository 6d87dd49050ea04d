"""pytest-sglworker: GPU-budgeted sglang workers as pytest fixtures.

The public API. Importing this package is cheap (it is loaded into every pytest run of an environment that
installs it): the launcher, pool, diagnosis and ledger are imported on first attribute access. Everything a user
imports comes from here; the subpackages (``plugin``, ``workers``, ``resources``, ``engine``, ``sim``) are the
layers of the implementation (https://github.com/pytest-sglworker/pytest-sglworker/blob/main/docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .engine.budget import check_argv, check_spec
from .engine.specs import (
    BUILTIN_SPECS,
    CI_WORKER_ARGS,
    ModelSpec,
    SpecRegistry,
    get_model_spec,
    get_models_with_feature,
)
from .errors import (
    BudgetViolation,
    InventoryUnavailable,
    LeaseImpossible,
    LeaseTimeout,
    PortUnavailable,
    SglWorkerError,
    SpecError,
)
from .workers.errors import LaunchError, WorkerDied, WorkerError, WorkerStartupError, WorkerStartupTimeout

if TYPE_CHECKING:
    from .engine.cpu_engine import cpu_engine_spec
    from .engine.diagnosis import Diagnosis, diagnose
    from .engine.ledger import MemoryLedger, ledger_for_spec, predict_memory
    from .plugin.timeline import render_html, trace_events
    from .workers.config import GroupShape, WorkerConfig
    from .workers.group import WorkerGroup
    from .workers.grpc_worker import GrpcHealth, GrpcWorker
    from .workers.kinds import DecodeWorker, HttpWorker, PrefillWorker, WorkerKind
    from .workers.launcher import LaunchOptions, ModelInstance, running_worker, spawn_worker
    from .workers.pool import WorkerPool
    from .workers.process import ManagedProcess
    from .workers.router import Router
    from .workers.sources.base import GroupRequest, GroupUse, WorkerSource

__version__ = "0.1.0"

_LAZY = {
    "LaunchOptions": "workers.launcher",
    "ModelInstance": "workers.launcher",
    "spawn_worker": "workers.launcher",
    "running_worker": "workers.launcher",
    "ManagedProcess": "workers.process",
    "WorkerConfig": "workers.config",
    "WorkerKind": "workers.kinds",
    "HttpWorker": "workers.kinds",
    "PrefillWorker": "workers.kinds",
    "DecodeWorker": "workers.kinds",
    "GrpcWorker": "workers.grpc_worker",
    "GrpcHealth": "workers.grpc_worker",
    "GroupShape": "workers.config",
    "WorkerGroup": "workers.group",
    "WorkerPool": "workers.pool",
    "Router": "workers.router",
    "Diagnosis": "engine.diagnosis",
    "diagnose": "engine.diagnosis",
    "MemoryLedger": "engine.ledger",
    "predict_memory": "engine.ledger",
    "ledger_for_spec": "engine.ledger",
    "cpu_engine_spec": "engine.cpu_engine",
    "render_html": "plugin.timeline",
    "trace_events": "plugin.timeline",
    "WorkerSource": "workers.sources.base",
    "GroupRequest": "workers.sources.base",
    "GroupUse": "workers.sources.base",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_sglworker' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BUILTIN_SPECS",
    "CI_WORKER_ARGS",
    "BudgetViolation",
    "DecodeWorker",
    "Diagnosis",
    "GroupRequest",
    "GroupShape",
    "GroupUse",
    "GrpcHealth",
    "GrpcWorker",
    "HttpWorker",
    "InventoryUnavailable",
    "LaunchError",
    "LaunchOptions",
    "LeaseImpossible",
    "LeaseTimeout",
    "ManagedProcess",
    "MemoryLedger",
    "ModelInstance",
    "ModelSpec",
    "PortUnavailable",
    "PrefillWorker",
    "Router",
    "SglWorkerError",
    "SpecError",
    "SpecRegistry",
    "WorkerConfig",
    "WorkerDied",
    "WorkerError",
    "WorkerGroup",
    "WorkerKind",
    "WorkerPool",
    "WorkerSource",
    "WorkerStartupError",
    "WorkerStartupTimeout",
    "check_argv",
    "check_spec",
    "cpu_engine_spec",
    "diagnose",
    "get_model_spec",
    "get_models_with_feature",
    "ledger_for_spec",
    "predict_memory",
    "render_html",
    "running_worker",
    "spawn_worker",
    "trace_events",
]
