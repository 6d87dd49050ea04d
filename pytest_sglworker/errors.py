"""Exception types of pytest-sglworker. Plain Python: no pytest here."""

from __future__ import annotations


class SglWorkerError(Exception):
    """Base class of every error this package raises on purpose."""


class SpecError(SglWorkerError, ValueError):
    """A model spec is malformed, unknown, or registered twice."""


class BudgetViolation(SglWorkerError, ValueError):
    """A spec or a test's extra args break the mandatory memory budget (CI_WORKER_ARGS)."""


class WorkerError(SglWorkerError):
    """A worker failed. ``str(err)`` carries the diagnosis, the log path and the log tail."""

    def __init__(self, message: str, *, log_path: str | None = None, diagnosis: object | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path
        self.diagnosis = diagnosis


class WorkerStartupError(WorkerError):
    """The worker process exited before it became healthy."""


class WorkerStartupTimeout(WorkerError):
    """The worker did not become healthy before the startup deadline."""


class WorkerDied(WorkerError):
    """A worker that had been healthy exited (during a test, or while pooled)."""


class LaunchError(WorkerError):
    """The worker could not be started at all (missing launcher, unwritable log dir, ...)."""


class InventoryUnavailable(SglWorkerError):
    """No GPU inventory could be read (NVML missing or failing) and none was declared."""


class LeaseImpossible(SglWorkerError, ValueError):
    """A lease that can never be granted here (tp larger than the GPUs visible, memory larger than any GPU)."""


class LeaseTimeout(SglWorkerError):
    """No GPU lease became free before the lease timeout. The message names the holders."""


class PortUnavailable(SglWorkerError):
    """No free port block could be reserved in the configured range."""
