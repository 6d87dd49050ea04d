"""pytest-sglworker: GPU-budgeted sglang workers as pytest fixtures.

The public API. Importing this package is cheap (it is loaded into every pytest run of an environment that
installs it): the launcher, pool, diagnosis and ledger are imported on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .budget import check_argv, check_spec
from .errors import (
    BudgetViolation,
    InventoryUnavailable,
    LaunchError,
    LeaseImpossible,
    LeaseTimeout,
    PortUnavailable,
    SglWorkerError,
    SpecError,
    WorkerDied,
    WorkerError,
    WorkerStartupError,
    WorkerStartupTimeout,
)
from .specs import (
    BUILTIN_SPECS,
    CI_WORKER_ARGS,
    ModelSpec,
    SpecRegistry,
    get_model_spec,
    get_models_with_feature,
)

if TYPE_CHECKING:
    from .diagnosis import Diagnosis, diagnose
    from .grpc_worker import GrpcHealth, GrpcWorker
    from .kinds import DecodeWorker, GroupShape, HttpWorker, PrefillWorker, WorkerConfig, WorkerKind
    from .launcher import LaunchOptions, ManagedProcess, ModelInstance, running_worker, spawn_worker
    from .ledger import MemoryLedger, predict_memory
    from .pool import WorkerGroup, WorkerPool
    from .router import Router

__version__ = "0.1.0"

_LAZY = {
    "LaunchOptions": "launcher",
    "ModelInstance": "launcher",
    "spawn_worker": "launcher",
    "running_worker": "launcher",
    "ManagedProcess": "launcher",
    "WorkerConfig": "kinds",
    "WorkerKind": "kinds",
    "HttpWorker": "kinds",
    "PrefillWorker": "kinds",
    "DecodeWorker": "kinds",
    "GrpcWorker": "grpc_worker",
    "GrpcHealth": "grpc_worker",
    "GroupShape": "kinds",
    "WorkerGroup": "pool",
    "WorkerPool": "pool",
    "Router": "router",
    "Diagnosis": "diagnosis",
    "diagnose": "diagnosis",
    "MemoryLedger": "ledger",
    "predict_memory": "ledger",
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
