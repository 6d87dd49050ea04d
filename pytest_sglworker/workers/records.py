"""What happened to the workers of a run: figures per worker configuration (:class:`ConfigStats`) and one record
per launched process (:class:`LaunchRecord`), kept together in :class:`RunRecords`.

Plain Python, no pytest. The pool, the routers and the attached workers write into one :class:`RunRecords` per
pytest process (launches ahead write from their own threads: it is guarded by a lock); the pytest-facing layer
turns them into the run report, the timeline and the trace (:mod:`pytest_sglworker.plugin.run_report`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .process import ManagedProcess

__all__ = ["ConfigStats", "LaunchRecord", "RunRecords", "TestSpan"]


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
    #: launches an interrupt (Ctrl-C, SIGTERM, SIGHUP) ended before they became ready: neither launched nor failed
    interrupted: int = 0
    #: unexpected exits of ready workers (during a test or while pooled)
    deaths: int = 0
    #: deliberate stops during a test (``worker.stop()``), not deaths
    stops: int = 0
    #: times a pooled group was set back after a test changed its run-time state (the sim's runtime faults)
    resets: int = 0
    #: times a group was not reused because that state could not be set back
    not_reset: int = 0
    #: tests that used this configuration and failed (their workers' logs are kept)
    failed_tests: int = 0
    #: logs kept because a launch failed, a worker died, or a test that used it failed
    failed_logs: list[str] = field(default_factory=list)
    #: logs of passing workers kept by ``--sgl-keep-logs``
    kept_logs: list[str] = field(default_factory=list)
    kv_tokens_predicted: int | None = None
    kv_tokens_actual: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able; the schema of one entry of ``--sgl-report`` (docs/explanation/run-report.md)."""
        import statistics  # here: the module is imported by every run, this only by one that launched

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
            "interrupted": self.interrupted,
            "deaths": self.deaths,
            "stops": self.stops,
            "resets": self.resets,
            "not_reset": self.not_reset,
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
            failures=data["failures"], interrupted=data.get("interrupted", 0), deaths=data["deaths"],
            stops=data.get("stops", 0),
            resets=data.get("resets", 0), not_reset=data.get("not_reset", 0),
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
        self.interrupted += other.interrupted
        self.deaths += other.deaths
        self.stops += other.stops
        self.resets += other.resets
        self.not_reset += other.not_reset
        self.failed_tests += other.failed_tests
        self.failed_logs += other.failed_logs
        self.kept_logs += other.kept_logs
        self.kv_tokens_predicted = self.kv_tokens_predicted or other.kv_tokens_predicted
        self.kv_tokens_actual = self.kv_tokens_actual or other.kv_tokens_actual


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
    #: ``ok``, ``startup_failed``, ``startup_timeout``, ``cancelled`` (a group member stopped because another
    #: member failed to start, or a launch ahead called off), ``died``, ``stopped`` or ``interrupted``
    outcome: str = "ok"
    #: one line: what went wrong (the diagnosis first, then what happened to which process)
    failure: str | None = None
    #: the diagnosis of the process's own log (its summary), None when the log shows nothing wrong
    diagnosis: str | None = None
    #: the process's exit status when it ended on its own (a failed start, a death); negative: a signal
    exit_code: int | None = None
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

    def failed(self, outcome: str, error: BaseException | None = None, *, failure: str | None = None,
               replace: bool = False) -> None:
        """End this record as ``outcome`` (unless it has ended already and ``replace`` is false), with what
        ``error`` says about this process: its one-line summary, its diagnosis, its exit status and its log (a
        worker error carries them; ``failure`` overrides the summary)."""
        if self.outcome != "ok" and not replace:
            return
        self.outcome = outcome
        diagnosis = getattr(error, "diagnosis", None)
        summary = getattr(error, "summary", None)
        self.failure = failure or (summary if isinstance(summary, str) else None) or (
            str(error).split("\n", 1)[0] if error is not None else None)
        if diagnosis is not None and getattr(diagnosis, "is_error", False):
            self.diagnosis = str(diagnosis.summary)
        code = getattr(diagnosis, "returncode", None)
        self.exit_code = code if isinstance(code, int) else self.exit_code
        log_path = getattr(error, "log_path", None)
        self.log_path = str(log_path) if log_path else self.log_path

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunRecords:
    """The figures and launch records of one pytest process: the pool, the routers and the attached workers write
    here. ``origin`` names the process in launch ids (the xdist worker's id, or ``main``). Guarded by a lock:
    a launch ahead registers its records from its own thread."""

    def __init__(self, origin: str = "main") -> None:
        self.origin = origin
        self.stats: dict[str, ConfigStats] = {}
        self.launches: list[LaunchRecord] = []
        self._lock = threading.Lock()

    def stats_for(self, key: str, label: str, model: str) -> ConfigStats:
        """The figures of configuration ``key`` (made on first use with ``label`` and ``model``)."""
        with self._lock:
            stats = self.stats.get(key)
            if stats is None:
                stats = self.stats[key] = ConfigStats(label, model)
            return stats

    def new_launch(self, *, kind: str = "", **fields: Any) -> LaunchRecord:
        """A new launch record with the next id of this process (``<origin>-<n>``, ``<origin>-router-<n>``)."""
        with self._lock:
            prefix = f"{self.origin}-{kind}-" if kind else f"{self.origin}-"
            record = LaunchRecord(id=f"{prefix}{len(self.launches) + 1}", xdist_worker=fields.pop(
                "xdist_worker", None if self.origin == "main" else self.origin), **fields)
            self.launches.append(record)
            return record

    def stats_dicts(self) -> dict[str, dict[str, Any]]:
        """Every configuration's figures as JSON-able dicts (what an xdist worker sends its controller)."""
        with self._lock:
            return {key: stats.as_dict() for key, stats in self.stats.items()}

    def launch_dicts(self) -> list[dict[str, Any]]:
        with self._lock:
            return [record.as_dict() for record in self.launches]

