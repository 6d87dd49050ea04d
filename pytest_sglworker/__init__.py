"""pytest-sglworker: GPU-budgeted sglang workers as pytest fixtures.

The public API. Importing this package is cheap (it is loaded into every pytest run of an environment that
installs it): the launcher, pool, diagnosis and ledger are imported on first attribute access.
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
    from .engine.diagnosis import Diagnosis, diagnose
    from .engine.ledger import MemoryLedger, predict_memory
    from .workers.config import GroupShape, WorkerConfig
    from .workers.grpc_worker import GrpcHealth, GrpcWorker
    from .workers.kinds import DecodeWorker, HttpWorker, PrefillWorker, WorkerKind
    from .workers.launcher import LaunchOptions, ModelInstance, running_worker, spawn_worker
    from .workers.pool import WorkerGroup, WorkerPool
    from .workers.process import ManagedProcess
    from .workers.router import Router

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
    "WorkerGroup": "workers.pool",
    "WorkerPool": "workers.pool",
    "Router": "workers.router",
    "Diagnosis": "engine.diagnosis",
    "diagnose": "engine.diagnosis",
    "MemoryLedger": "engine.ledger",
    "predict_memory": "engine.ledger",
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
    "GroupShape",
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
    "WorkerStartupError",
    "WorkerStartupTimeout",
    "check_argv",
    "check_spec",
    "diagnose",
    "get_model_spec",
    "get_models_with_feature",
    "predict_memory",
    "running_worker",
    "spawn_worker",
]
