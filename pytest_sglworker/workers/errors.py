"""The errors of a worker: it could not be launched, it exited or hung during startup, it died later. Each
holds what happened as fields (the worker, the event, the diagnosis of its log, the memory ledger, the argv, the
log path and its tail) and builds its text in ``__str__``. Plain Python, no pytest."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SglWorkerError

if TYPE_CHECKING:
    from ..engine.diagnosis import Diagnosis
    from ..engine.ledger import MemoryLedger

__all__ = ["LaunchCancelled", "LaunchError", "WorkerDied", "WorkerError", "WorkerStartupError",
           "WorkerStartupTimeout"]


class WorkerError(SglWorkerError):
    """A worker failed. The fields say what happened; ``str(err)`` renders them: the worker and the event,
    the diagnosis of its log, the memory ledger (for memory failures), the argv, the log path and its tail.
    :attr:`summary` is the one line for a short test summary."""

    def __init__(
        self,
        message: str = "",
        *,
        worker: str = "",
        event: str = "",
        diagnosis: Diagnosis | None = None,
        ledger: MemoryLedger | None = None,
        extra: str = "",
        argv: str = "",
        log_path: str | None = None,
        tail: str | None = None,
        tail_lines: int = 0,
    ) -> None:
        super().__init__(message or f"{worker} {event}".strip())
        self.worker = worker
        self.event = event
        self.diagnosis = diagnosis
        self.ledger = ledger
        self.extra = extra
        self.argv = argv
        self.log_path = log_path
        self.tail = tail
        self.tail_lines = tail_lines

    @property
    def summary(self) -> str:
        """One line for a short test summary: the diagnosis first, then what happened to which worker."""
        head = f"{self.worker} {self.event}".strip() if self.worker else str(self.args[0]).split("\n", 1)[0]
        if self.diagnosis is not None and self.diagnosis.is_error:
            return f"{self.diagnosis.summary} ({head})"
        return head

    def __str__(self) -> str:
        if not self.worker:
            return str(self.args[0]) if self.args else ""
        parts = [f"{self.worker} {self.event}"]
        if self.diagnosis is not None:
            try:
                rendered = self.diagnosis.render()
            except Exception as exc:  # a diagnosis must never hide the log
                rendered = f"diagnosis unavailable: {exc!r}"
            if rendered:
                parts.append(rendered)
        if self.extra:
            parts.append(self.extra)
        if self.ledger is not None:
            parts.append(f"memory ledger (predicted for this GPU):\n{self.ledger.render()}")
        if self.argv:
            parts.append(f"argv: {self.argv}")
        if self.log_path:
            parts.append(f"log: {self.log_path}")
        if self.tail is not None:
            parts.append(f"last {self.tail_lines} lines:")
            parts.append("\n".join("    " + line for line in self.tail.splitlines()) or "    <empty log>")
        return "\n".join(parts)


class WorkerStartupError(WorkerError):
    """The worker process exited before it became healthy."""


class WorkerStartupTimeout(WorkerError):
    """The worker did not become healthy before the startup deadline."""


class WorkerDied(WorkerError):
    """A worker that had been healthy exited (during a test, or while pooled)."""


class LaunchError(WorkerError):
    """The worker could not be started at all (missing launcher, unwritable log dir, ...)."""


class LaunchCancelled(LaunchError):
    """A launch was abandoned because another member of its worker group failed."""
