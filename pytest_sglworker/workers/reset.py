"""What a test can change in a running worker, and how the pool sets it back before the worker serves the next
test: a pooled worker comes back to each test as it was handed out, or is not reused.

Each kind of run-time state is one :class:`RuntimeState` in :data:`RUNTIME_STATES`: whether it applies to a
worker, how to read it (the pool reads it on the main thread when the worker is first handed out, and again when
the test gives it back) and how to put the first reading back. Today that is the simulated engine's request
faults, switched at run time through its control endpoint; a real engine's equivalents (a LoRA adapter loaded at
run time, weights updated from disk) would be further records here.

A state that cannot be read back or set back makes the pool retire the worker instead of reusing it, and the
summary says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .health import http_request

if TYPE_CHECKING:
    from .launcher import ModelInstance

__all__ = ["RUNTIME_STATES", "ResetFailed", "RuntimeState", "SimFaults", "Snapshot", "restore", "snapshot"]


class ResetFailed(Exception):
    """A worker's run-time state could not be read or set back (the worker is then not reused): a frozen or
    wedged worker answers nothing (``unanswered``)."""

    def __init__(self, message: str, *, unanswered: bool = False) -> None:
        super().__init__(message)
        self.unanswered = unanswered


class RuntimeState(Protocol):
    """One kind of state a test can change in a running worker."""

    #: what the summary calls it ("runtime faults")
    name: str

    def applies(self, worker: ModelInstance) -> bool: ...

    def read(self, worker: ModelInstance) -> Any:
        """The state now (comparable with ``==``); :class:`ResetFailed` when it cannot be read."""
        ...

    def write(self, worker: ModelInstance, state: Any) -> None:
        """Put ``state`` (an earlier :meth:`read`) back; :class:`ResetFailed` when it cannot."""
        ...


class SimFaults:
    """The simulated engine's request faults (``POST /_sim/faults`` during a test): read from and written back
    through its control endpoint (on a gRPC worker: its HTTP sidecar)."""

    name = "runtime faults"

    def applies(self, worker: ModelInstance) -> bool:
        return worker.simulated and self._port(worker) is not None

    @staticmethod
    def _port(worker: ModelInstance) -> int | None:
        if worker.url.startswith("http"):
            return worker.port
        return worker.ports.get("sidecar")

    def _call(self, worker: ModelInstance, method: str, body: bytes = b"") -> dict[str, Any]:
        from ..sim import CONTROL_PATH

        port = self._port(worker)
        assert port is not None
        try:
            resp = http_request(worker.host, port, CONTROL_PATH, deadline=time.monotonic() + worker.answer_timeout(),
                                method=method, body=body, headers={"Content-Type": "application/json"},
                                abort=lambda: not worker.is_alive())
            answer = json.loads(resp.body) if resp.status == 200 else None
        except (OSError, ValueError) as exc:
            raise ResetFailed(f"{method} {CONTROL_PATH}: {exc or type(exc).__name__}",
                              unanswered=isinstance(exc, OSError)) from exc
        if not isinstance(answer, dict) or not isinstance(answer.get("faults"), dict):
            raise ResetFailed(f"{method} {CONTROL_PATH} answered HTTP {resp.status}: {resp.body[:200]!r}")
        return answer

    def read(self, worker: ModelInstance) -> dict[str, Any]:
        return dict(self._call(worker, "GET")["faults"])

    def write(self, worker: ModelInstance, state: dict[str, Any]) -> None:
        self._call(worker, "POST", json.dumps({"reset": True, **state}).encode())


#: every kind of run-time state the pool sets back (a new one is one more record here)
RUNTIME_STATES: tuple[RuntimeState, ...] = (SimFaults(),)


@dataclass(frozen=True)
class Snapshot:
    """A worker's run-time states as it was handed out: ``(state kind, reading)`` for each that applies."""

    readings: tuple[tuple[RuntimeState, Any], ...]


def snapshot(worker: ModelInstance) -> Snapshot:
    """Read every state that applies to ``worker`` (:class:`ResetFailed` when one cannot be read)."""
    return Snapshot(tuple((kind, kind.read(worker)) for kind in RUNTIME_STATES if kind.applies(worker)))


def restore(worker: ModelInstance, before: Snapshot) -> list[str]:
    """Set back each state of ``worker`` that changed since ``before``; returns the names of those set back.
    :class:`ResetFailed` when one cannot be read or written."""
    changed = []
    for kind, reading in before.readings:
        if kind.read(worker) != reading:
            kind.write(worker, reading)
            if kind.read(worker) != reading:
                raise ResetFailed(f"{kind.name} still differ after they were set back")
            changed.append(kind.name)
    return changed
