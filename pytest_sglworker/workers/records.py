"""The run report: what happened to each worker configuration, and one record per launched process.

Plain Python, no pytest. The pool fills :class:`ConfigStats` and :class:`LaunchRecord` s; under xdist each
worker sends its own as plain dicts (``as_dict``) and the controller merges them (:func:`merge_stats`,
:func:`merge_launches`). :func:`write_json` writes the JSON of ``--sgl-report`` (schema in the README);
the timeline and the trace are drawn from the same launch records.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .process import ManagedProcess

__all__ = ["SCHEMA", "ConfigStats", "LaunchRecord", "merge_launches", "merge_stats", "write_json"]

SCHEMA = "pytest-sglworker/report/v1"


@dataclass
class ConfigStats:
    """What happened to one worker configuration during the run."""

    label: str
    model: str
    launches: int = 0
    reuses: int = 0
    startup_seconds: list[float] = field(default_factory=list)
    lease_wait_seconds: float = 0.0
    gpu_seconds: float = 0.0
    #: launches that failed to become ready
    failures: int = 0
    #: unexpected exits of ready workers (during a test or while pooled)
    deaths: int = 0
    #: deliberate stops during a test (``worker.stop()``, a router's remove), not deaths
    stops: int = 0
    #: tests that used this configuration and failed (their workers' logs are kept)
    failed_tests: int = 0
    #: logs kept because a launch failed, a worker died, or a test that used it failed
    failed_logs: list[str] = field(default_factory=list)
    #: logs of passing workers kept by ``--sgl-keep-logs``
    kept_logs: list[str] = field(default_factory=list)
    kv_tokens_predicted: int | None = None
    kv_tokens_actual: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able; the schema of one entry of ``--sgl-report`` (see the README)."""
        times = self.startup_seconds
        return {
            "label": self.label,
            "model": self.model,
            "launches": self.launches,
            "reuses": self.reuses,
            "startup_seconds": {
                "min": round(min(times), 3) if times else None,
                "median": round(statistics.median(times), 3) if times else None,
                "max": round(max(times), 3) if times else None,
                "samples": [round(t, 3) for t in times],
            },
            "lease_wait_seconds": round(self.lease_wait_seconds, 3),
            "gpu_seconds": round(self.gpu_seconds, 3),
            "failures": self.failures,
            "deaths": self.deaths,
            "stops": self.stops,
            "failed_tests": self.failed_tests,
            "failed_logs": list(self.failed_logs),
            "kept_logs": list(self.kept_logs),
            "kv_tokens": {"predicted": self.kv_tokens_predicted, "actual": self.kv_tokens_actual},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConfigStats:
        kv = data.get("kv_tokens") or {}
        return cls(
            label=data["label"], model=data["model"], launches=data["launches"], reuses=data["reuses"],
            startup_seconds=list(data["startup_seconds"]["samples"]),
            lease_wait_seconds=data["lease_wait_seconds"], gpu_seconds=data["gpu_seconds"],
            failures=data["failures"], deaths=data["deaths"], stops=data.get("stops", 0),
            failed_tests=data.get("failed_tests", 0),
            failed_logs=list(data["failed_logs"]), kept_logs=list(data.get("kept_logs", ())),
            kv_tokens_predicted=kv.get("predicted"), kv_tokens_actual=kv.get("actual"),
        )

    def merge(self, other: ConfigStats) -> None:
        """Add another process's figures for the same configuration (xdist workers)."""
        self.launches += other.launches
        self.reuses += other.reuses
        self.startup_seconds += other.startup_seconds
        self.lease_wait_seconds += other.lease_wait_seconds
        self.gpu_seconds += other.gpu_seconds
        self.failures += other.failures
        self.deaths += other.deaths
        self.stops += other.stops
        self.failed_tests += other.failed_tests
        self.failed_logs += other.failed_logs
        self.kept_logs += other.kept_logs
        self.kv_tokens_predicted = self.kv_tokens_predicted or other.kv_tokens_predicted
        self.kv_tokens_actual = self.kv_tokens_actual or other.kv_tokens_actual


def merge_stats(sources: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, ConfigStats]:
    """Merge the ``as_dict`` figures of several processes, by configuration key."""
    merged: dict[str, ConfigStats] = {}
    for source in sources:
        for key, data in source.items():
            stats = ConfigStats.from_dict(data)
            if key in merged:
                merged[key].merge(stats)
            else:
                merged[key] = stats
    return merged


@dataclass
class TestSpan:
    nodeid: str
    t_start: float | None
    t_end: float | None
    outcome: str


@dataclass
class LaunchRecord:
    """One launched process (a worker, a group member or a router): when each phase began, where it ran,
    what it served and how it ended. Times are epoch seconds (``time.time()``), None where a phase did not
    happen."""

    id: str
    config: str
    label: str
    model: str
    role: str = "worker"
    group: str | None = None
    xdist_worker: str | None = None
    node: str = ""
    gpus: list[int] = field(default_factory=list)
    gpu_names: list[str] = field(default_factory=list)
    port: int | None = None
    pid: int | None = None
    argv: str = ""
    log_path: str | None = None
    t_lease_requested: float | None = None
    t_leased: float | None = None
    t_started: float | None = None
    t_ready: float | None = None
    t_stop_requested: float | None = None
    t_stopped: float | None = None
    t_released: float | None = None
    outcome: str = "ok"
    failure: str | None = None
    tests: list[TestSpan] = field(default_factory=list)

    def take_times(self, instance: ManagedProcess) -> None:
        """Copy the process's own times (started, ready, stop requested, stopped)."""
        times = instance.times
        self.t_started = times.get("started", self.t_started)
        self.t_ready = times.get("ready", self.t_ready)
        self.t_stop_requested = times.get("stop_requested", self.t_stop_requested)
        self.t_stopped = times.get("stopped", self.t_stopped)

    def served(self, nodeid: str, t_start: float | None, t_end: float | None, outcome: str) -> None:
        if not any(t.nodeid == nodeid for t in self.tests):
            self.tests.append(TestSpan(nodeid, t_start, t_end, outcome))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def merge_launches(sources: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """All processes' launch records, ordered by start."""
    launches = [dict(r) for source in sources for r in source]
    return sorted(launches, key=lambda r: (r.get("t_lease_requested") or r.get("t_started") or 0.0, r["id"]))


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    """``--sgl-report PATH``: the run report as JSON (schema in the README), written atomically (a failed
    write leaves the previous file, never a partial one), mode 0644."""
    from ..resources.state import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
