"""The session pool of workers, keyed by the full worker configuration, and the statistics of the run report.

Plain Python: no pytest here. A worker whose configuration (spec, effective argv, env) matches is reused
after a fast liveness check; a dead one is replaced; when a GPU lease is needed for another configuration,
idle workers are evicted least recently used first. Each worker holds its GPU lease for its whole life and
gives it back only after its memory is released.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import SglWorkerError, WorkerError
from .launcher import LaunchOptions, ModelInstance, ProgressCallback, spawn_worker
from .specs import ModelSpec

if TYPE_CHECKING:
    from .gpus import Lease, LeaseManager


@dataclass(frozen=True)
class WorkerConfig:
    """What makes two workers interchangeable: the spec, the test's extra args and extra env."""

    spec: ModelSpec
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    #: the reason of a budget opt-out these args needed (shown in the summary and the report, not compared)
    opt_out: str = field(default="", compare=False)

    @classmethod
    def of(cls, spec: ModelSpec, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
           *, opt_out: str = "") -> WorkerConfig:
        return cls(spec, tuple(extra_args), tuple(sorted((env or {}).items())), opt_out)

    @property
    def key(self) -> str:
        """Stable across processes (used as the xdist group name): ``<spec>`` or ``<spec>-<hash>``."""
        if not self.extra_args and not self.env:
            return self.spec.name
        # Not repr(spec): its frozenset of features prints in hash-seed order, which differs per process.
        spec = self.spec
        canonical = (spec.name, spec.model, spec.memory_gb, spec.tp, sorted(spec.features), spec.worker_args,
                     sorted(spec.env.items()), spec.description, self.extra_args, self.env)
        digest = hashlib.sha1(repr(canonical).encode()).hexdigest()[:8]
        return f"{self.spec.name}-{digest}"

    @property
    def label(self) -> str:
        parts = [self.spec.name]
        if self.extra_args:
            from .launcher import mask_argv

            # The label goes to the terminal summary and the --sgl-report JSON: never an --api-key value.
            parts.append(" ".join(mask_argv(self.extra_args)))
        if self.env:
            parts.append("env " + ",".join(k for k, _ in self.env))
        if self.opt_out:
            parts.append(f"(budget opt-out: {self.opt_out})")
        return " ".join(parts)


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
    failures: int = 0
    deaths: int = 0
    failed_logs: list[str] = field(default_factory=list)
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
            "failed_logs": list(self.failed_logs),
            "kv_tokens": {"predicted": self.kv_tokens_predicted, "actual": self.kv_tokens_actual},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConfigStats:
        kv = data.get("kv_tokens") or {}
        return cls(
            label=data["label"], model=data["model"], launches=data["launches"], reuses=data["reuses"],
            startup_seconds=list(data["startup_seconds"]["samples"]),
            lease_wait_seconds=data["lease_wait_seconds"], gpu_seconds=data["gpu_seconds"],
            failures=data["failures"], deaths=data["deaths"], failed_logs=list(data["failed_logs"]),
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
        self.failed_logs += other.failed_logs
        self.kv_tokens_predicted = self.kv_tokens_predicted or other.kv_tokens_predicted
        self.kv_tokens_actual = self.kv_tokens_actual or other.kv_tokens_actual


def _gpu_of(lease: Lease | None) -> tuple[int, int] | None:
    if lease is None or not lease.gpus:
        return None
    gpu = lease.gpus[0]
    return gpu.total_mib, gpu.free_mib


def _attach_ledger(exc: SglWorkerError, config: WorkerConfig, lease: Lease | None) -> None:
    """Add the memory ledger to a startup failure whose diagnosis is about memory."""
    diagnosis = getattr(exc, "diagnosis", None)
    gpu = _gpu_of(lease)
    if gpu is None or diagnosis is None or not diagnosis.memory_related:
        return
    from .ledger import ledger_for_spec

    if isinstance(exc, WorkerError):
        exc.ledger = ledger_for_spec(config.spec, gpu[0], gpu_free_mib=gpu[1], extra_args=config.extra_args)


def _record_kv_tokens(instance: ModelInstance, config: WorkerConfig, lease: Lease | None, stats: ConfigStats) -> None:
    """The actual ``KV Cache is allocated ... #tokens: N`` against the ledger's prediction."""
    from .diagnosis import parse_kv_tokens

    actual = parse_kv_tokens(instance.log_text(max_bytes=1024 * 1024))
    if actual is not None:
        stats.kv_tokens_actual = actual
    gpu = _gpu_of(lease)
    if gpu is not None and stats.kv_tokens_predicted is None:
        from .ledger import ledger_for_spec

        ledger = ledger_for_spec(config.spec, gpu[0], gpu_free_mib=gpu[1], extra_args=config.extra_args)
        if ledger is not None:
            stats.kv_tokens_predicted = ledger.kv_tokens


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
class _Entry:
    config: WorkerConfig
    instance: ModelInstance
    lease: Lease | None
    leased_at: float
    tainted: bool = False  # a test that used it failed: keep its log
    in_use: bool = False
    poolable: bool = True  # False for a fresh, unshared worker
    last_used: float = field(default_factory=time.monotonic)


class WorkerPool:
    """Hands out workers; reuses idle ones of the same configuration when ``reuse`` is on."""

    def __init__(
        self,
        options: LaunchOptions,
        *,
        leases: LeaseManager | None = None,
        lease_timeout: float = 1800.0,
        reuse: bool = True,
        keep_logs: bool = False,
        on_progress: ProgressCallback | None = None,
        on_message: Callable[[str], None] | None = None,
        worker_env: Callable[[ModelSpec, dict[str, str]], dict[str, str]] | None = None,
        release_wait: float = 60.0,
    ) -> None:
        self.options = options
        self.leases = leases
        self.lease_timeout = lease_timeout
        self.reuse = reuse
        self.keep_logs = keep_logs
        self.on_progress = on_progress
        self.on_message = on_message or (lambda msg: None)
        self.worker_env = worker_env
        self.release_wait = release_wait
        self.stats: dict[str, ConfigStats] = {}
        self._idle: OrderedDict[int, _Entry] = OrderedDict()  # id(instance) -> entry, LRU first
        self._busy: dict[int, _Entry] = {}

    # -- public -------------------------------------------------------------------------------------------
    def stats_for(self, config: WorkerConfig) -> ConfigStats:
        stats = self.stats.get(config.key)
        if stats is None:
            stats = self.stats[config.key] = ConfigStats(config.label, config.spec.model)
        return stats

    def acquire(self, config: WorkerConfig, *, holder: str, fresh: bool = False,
                options: LaunchOptions | None = None) -> ModelInstance:
        """A healthy worker for ``config``: a pooled idle one if reuse is on, else a new one. ``options``
        replaces the pool's launch options for this worker (which is then never shared)."""
        fresh = fresh or options is not None
        stats = self.stats_for(config)
        if self.reuse and not fresh:
            for key, entry in list(self._idle.items()):
                if entry.config != config:
                    continue
                del self._idle[key]
                if entry.instance.responds():
                    entry.in_use = True
                    self._busy[key] = entry
                    stats.reuses += 1
                    return entry.instance
                stats.deaths += 1
                self.on_message(entry.instance.failure_message("died while idle in the pool; replacing it",
                                                               lines=10))
                self._retire(entry, failed=True)
        return self._launch(config, holder=holder, fresh=fresh, options=options or self.options)

    def release(self, instance: ModelInstance, *, failed: bool = False) -> None:
        """Give a worker back after a test; it stays pooled when reuse is on and it is alive."""
        entry = self._busy.pop(id(instance), None)
        if entry is None:
            return
        entry.tainted = entry.tainted or failed
        entry.in_use = False
        entry.last_used = time.monotonic()
        if self.reuse and entry.poolable and instance.is_alive() and not self._others_wait():
            self._idle[id(instance)] = entry
        else:
            if not instance.is_alive():
                self.stats_for(entry.config).deaths += 1
            self._retire(entry, failed=entry.tainted or not instance.is_alive())

    def discard(self, instance: ModelInstance, *, failed: bool = True) -> None:
        """Stop a worker now (it died, or the test asked for a fresh one)."""
        entry = self._busy.pop(id(instance), None) or self._idle.pop(id(instance), None)
        if entry is not None:
            if not instance.is_alive():
                self.stats_for(entry.config).deaths += 1
            self._retire(entry, failed=failed or entry.tainted)

    def close(self) -> None:
        """Stop every worker and give back every lease."""
        for entry in list(self._busy.values()) + list(self._idle.values()):
            with contextlib.suppress(Exception):
                self._retire(entry, failed=entry.tainted or not entry.instance.is_alive())
        self._busy.clear()
        self._idle.clear()

    def _others_wait(self) -> bool:
        """Another process waits for a GPU: do not keep an idle worker's lease (it queues behind us)."""
        if self.leases is None:
            return False
        try:
            waiting = self.leases.others_waiting()
        except OSError:
            return False
        if waiting:
            self.on_message("another process waits for a GPU lease: retiring the idle worker instead of pooling it")
        return waiting

    def live_workers(self) -> list[ModelInstance]:
        return [e.instance for e in list(self._busy.values()) + list(self._idle.values())]

    # -- internals ----------------------------------------------------------------------------------------
    def _launch(self, config: WorkerConfig, *, holder: str, fresh: bool, options: LaunchOptions) -> ModelInstance:
        stats = self.stats_for(config)
        lease, waited = self._lease_for(config, holder)
        stats.lease_wait_seconds += waited
        leased_at = time.monotonic()
        try:
            lease_env = lease.env() if lease is not None else {}
            env = dict(config.env)
            env.update(self.worker_env(config.spec, lease_env) if self.worker_env else lease_env)
            instance = spawn_worker(
                config.spec, extra_args=config.extra_args, env=env, options=options,
                on_progress=self.on_progress, gpus=lease.cuda_visible_devices if lease is not None else None,
            )
        except SglWorkerError as exc:
            stats.failures += 1
            _attach_ledger(exc, config, lease)
            log_path = getattr(exc, "log_path", None)
            if log_path:
                stats.failed_logs.append(str(log_path))
            if lease is not None:
                self._give_back(lease, [], leased_at, stats)
            raise
        except BaseException:  # the lease must never outlive a failed launch (a hook, an interrupt)
            if lease is not None:
                self._give_back(lease, [], leased_at, stats)
            raise
        # Registered at once, so that whatever happens next, close() stops it and gives the lease back.
        self._busy[id(instance)] = _Entry(config, instance, lease, leased_at, in_use=True, poolable=not fresh)
        stats.launches += 1
        if instance.startup_seconds is not None:
            stats.startup_seconds.append(instance.startup_seconds)
        with contextlib.suppress(Exception):  # bookkeeping for the report must never fail a test
            _record_kv_tokens(instance, config, lease, stats)
        return instance

    def _lease_for(self, config: WorkerConfig, holder: str) -> tuple[Lease | None, float]:
        if self.leases is None:
            return None, 0.0
        spec = config.spec
        start = time.monotonic()
        # First without waiting; evict idle workers (LRU first) while that frees a lease.
        while True:
            lease = self.leases.try_acquire(spec.tp, spec.memory_mib, holder=holder)
            if lease is not None:
                return lease, time.monotonic() - start  # time spent evicting idle workers counts too
            if not self._idle:
                break
            _, victim = self._idle.popitem(last=False)
            self.on_message(f"evicting idle {victim.instance.describe()} to free its GPU lease for {spec.name}")
            self._retire(victim, failed=victim.tainted)
        lease = self.leases.acquire(spec.tp, spec.memory_mib, holder=holder, timeout=self.lease_timeout,
                                    on_wait=self.on_message)
        return lease, time.monotonic() - start

    def _retire(self, entry: _Entry, *, failed: bool) -> None:
        instance = entry.instance
        stats = self.stats_for(entry.config)
        try:
            instance.stop()
        finally:
            if failed:
                if str(instance.log_path) not in stats.failed_logs:
                    stats.failed_logs.append(str(instance.log_path))
            elif not self.keep_logs:
                instance.remove_log()
            if entry.lease is not None:
                self._give_back(entry.lease, sorted(instance.pids_seen), entry.leased_at, stats)

    def _give_back(self, lease: Lease, pids: list[int], leased_at: float, stats: ConfigStats) -> None:
        report = lease.release(worker_pids=pids, wait_timeout=self.release_wait)
        stats.gpu_seconds += (time.monotonic() - leased_at) * max(1, len(lease.gpus))
        if report is not None and not getattr(report, "memory_back", True):
            self.on_message(str(report))


def write_report(path: Path, stats: Mapping[str, ConfigStats], extra: Mapping[str, Any]) -> None:
    """``--sgl-report PATH``: the run report as JSON (schema in the README)."""
    import json

    data = {"schema": "pytest-sglworker/report/v1", **extra,
            "workers": {key: s.as_dict() for key, s in sorted(stats.items())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    # 0644 whatever the umask: never world-writable.
    with open(path, "w", encoding="utf-8", opener=lambda p, flags: os.open(p, flags, 0o644)) as fh:
        fh.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
