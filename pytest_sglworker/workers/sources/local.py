"""Launched workers, pooled: :class:`PoolSource` (the worker-source protocol over a
:class:`~pytest_sglworker.workers.pool.WorkerPool`) and :class:`LocalSource`, whose GPUs are file-locked leases of
this machine's inventory (NVML, or a declared ``sim:N`` inventory).

Plain Python, no pytest. The pool is made on first use: a run that never asks for a launched worker never reads
the GPU inventory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...engine.specs import ModelSpec
from ..config import KindChooser, WorkerConfig, default_kind
from ..errors import WorkerDied
from ..launcher import LaunchOptions, ProgressCallback
from ..pool import WorkerPool
from ..records import RunRecords
from .base import GroupRequest, GroupUse, Refusal

if TYPE_CHECKING:
    from ...resources.warm_records import Party
    from ..group import WorkerGroup
    from ..pool_parts import AheadKit
    from ..pool_warm import HandOver
    from ..warm import Warm

__all__ = ["LocalSource", "PoolHooks", "PoolSettings", "PoolSource"]


@dataclass(frozen=True)
class PoolSettings:
    """How a pool source launches and leases: the session's settings, resolved on the main thread."""

    launch: LaunchOptions
    lock_dir: Path
    lease_timeout: float = 1800.0
    reuse: bool = True
    log_policy: str = "failed"
    tail_lines: int = 40
    #: ``--sgl-gpus`` (local leases): indices, UUIDs, or a declared ``sim:N`` inventory; None: every NVML GPU
    gpus: str | None = None
    #: the environment the NVML inventory reads (``CUDA_VISIBLE_DEVICES``), snapshotted on the main thread
    environ: Mapping[str, str] = field(default_factory=dict)
    #: ``--sgl-cluster`` (a Ray cluster's spec)
    cluster: Any = None
    #: ``--sgl-keep-warm``: the TTL (seconds) of the groups kept warm at the session's end; None: none is kept
    keep_warm: float | None = None
    #: adopt the warm groups earlier sessions left (local leases only)
    adopt_warm: bool = True
    #: the session log directory (``session-<N>``) a warm group's keeper holds; None for an explicit --sgl-log-dir
    session_log_dir: Path | None = None
    #: who this session is, for warm records and messages
    holder: str = ""
    #: an xdist worker's controller's session when it started a Ray host ahead for the worker (``ray_hosts``)
    ray_ahead: str | None = None
    #: the run an xdist worker is part of (its controller: pid, start time, run id) when groups launched ahead are
    #: handed over within the run (:mod:`..pool_warm`); None: they are not
    run: Party | None = None


@dataclass(frozen=True)
class PoolHooks:
    """What a pool source tells the session, and asks of it: plain callables, no pytest objects."""

    on_message: Callable[[str], None] | None = None
    on_progress: ProgressCallback | None = None
    on_progress_end: Callable[[], None] | None = None
    #: ``(spec, lease_env) -> env``: the worker's environment from its lease (a plugin hook may change it)
    worker_env: Callable[[ModelSpec, dict[str, str]], dict[str, str]] | None = None
    choose_kind: KindChooser = default_kind
    #: a test's own launch holds its lease: the session may start the next configurations alongside it
    on_leased: Callable[[WorkerConfig], None] | None = None
    #: the main thread waits for launch threads: the session writes what they queued for the terminal
    on_tick: Callable[[], None] | None = None
    #: the configurations no later test of this process takes (the xdist controller's word), asked while the main
    #: thread waits for a launch: their idle workers are stopped
    finished: Callable[[], Collection[str]] | None = None
    #: ``(config)``: the main thread waits for ``config``'s launch: the session starts the launches ahead the xdist
    #: controller told it of since its last test
    follow: Callable[[WorkerConfig], None] | None = None
    xdist_worker: str | None = None
    #: the controller's word on groups handed over within the run (with ``PoolSettings.run``)
    handover: HandOver | None = None
    #: ``()``: whether a plugin hook may change a worker's env (``worker_env`` is then called on the main thread
    #: only: no launch ahead from another thread); None: it may (asked on the main thread)
    env_hooked: Callable[[], bool] | None = None


class PoolSource:
    """Launched workers in a pool, reused between tests of one configuration; subclasses say where the GPU leases
    come from (:meth:`make_leases`) and may add to each worker's environment (:meth:`lease_env`)."""

    #: the source's name, for messages
    name = "pool"

    def __init__(self, settings: PoolSettings, records: RunRecords, hooks: PoolHooks | None = None) -> None:
        self.settings = settings
        self.records = records
        self.hooks = hooks or PoolHooks()
        self._leases: Any = None
        self._pool: WorkerPool | None = None
        #: the session clears it when the run was interrupted: an interrupt keeps nothing warm, hands nothing over
        self.keep_warm_ok = True

    # -- what subclasses say ------------------------------------------------------------------------------
    def make_leases(self) -> Any:
        """The lease manager (the surface of :class:`~pytest_sglworker.resources.gpus.LeaseManager`)."""
        raise NotImplementedError

    def lease_env(self) -> dict[str, str]:
        """What every worker's environment gets from where its GPUs come from (before its lease's own)."""
        return {}

    def describe(self) -> str:
        raise NotImplementedError

    def make_warm(self, leases: Any) -> Warm | None:
        """The pool's warm groups (adopted, kept warm): only where leases are this machine's file locks."""
        return None

    # -- the pool -----------------------------------------------------------------------------------------
    @property
    def leases(self) -> Any:
        """The lease manager, made once; raises the inventory's errors (see :meth:`WorkerSource.refusal`)."""
        if self._leases is None:
            self._leases = self.make_leases()
        return self._leases

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            leases = self.leases
            hooks = self.hooks
            self._pool = WorkerPool(
                self.settings.launch, leases=leases, lease_timeout=self.settings.lease_timeout,
                reuse=self.settings.reuse, log_policy=self.settings.log_policy, on_progress=hooks.on_progress,
                on_progress_end=hooks.on_progress_end, on_message=hooks.on_message, worker_env=self._worker_env,
                choose_kind=hooks.choose_kind, xdist_worker=hooks.xdist_worker, on_leased=hooks.on_leased,
                records=self.records, on_tick=hooks.on_tick, finished=hooks.finished, follow=hooks.follow,
                warm=self.make_warm(leases),
                handover=hooks.handover if self.settings.run is not None else None)
        return self._pool

    @property
    def pool_if_started(self) -> WorkerPool | None:
        return self._pool

    def _worker_env(self, spec: ModelSpec, lease_env: dict[str, str]) -> dict[str, str]:
        env = {**self.lease_env(), **lease_env}
        return self.hooks.worker_env(spec, env) if self.hooks.worker_env is not None else env

    # -- the protocol -------------------------------------------------------------------------------------
    def refusal(self, config: WorkerConfig, *, opt_out: bool) -> Refusal | None:
        gpus = config.gpus_needed(self.hooks.choose_kind)
        why = self.leases.can_ever_fit(gpus, config.spec.memory_mib)
        if not why:
            return None
        if config.group is not None:
            why = f"the group {config.group.describe()} leases {gpus} GPU(s) at once: {why}"
        elif gpus != config.spec.tp:
            why = f"the worker leases {gpus} GPU(s) at once (tp x data-parallel replicas): {why}"
        return Refusal("skip", f"{config.spec.name}: {why}")

    def acquire(self, request: GroupRequest) -> WorkerGroup:
        return self.pool.acquire(request.config, holder=request.holder, fresh=request.fresh or request.launch,
                                 options=request.options, environ=request.environ)

    def give_back(self, group: WorkerGroup, use: GroupUse) -> WorkerDied | None:
        """Record the test on the group's launch records, then pool the group again, or retire it (unshared,
        no later test needs it, or a member died). A member that died during a passing test is the error."""
        pool = self.pool
        pool.served(group, use.nodeid, use.t_start, use.t_end, use.outcome)
        if use.last_use:
            pool.finish(group.config.key)  # before its group goes: a stale word must not launch it again
        dead = [m for m in group if not m.is_alive() and not m.stopped]
        if dead or not group.is_alive():
            pool.discard(group, failed=use.failed or bool(dead))
            if dead and not use.failed and use.check_deaths:
                return dead[0].death(use.signals, lines=self.settings.tail_lines)
        elif use.last_use and self.settings.keep_warm is None:
            # no later test needs this configuration (kept for --sgl-keep-warm); its lease may serve the next test's
            pool.discard(group, failed=use.failed, then=use.next_config)
        else:  # a fresh group is retired there too
            pool.release(group, failed=use.failed, needed_next=use.next_config == group.config)
        pool.yield_idle(keep=use.next_config)
        return None

    def launch_ahead(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str],
                     wait_retiring: bool = True) -> bool:
        if self._pool is None or not self.settings.reuse:
            return False  # nothing launched yet: the first test's own launch comes first
        return self._pool.launch_ahead(config, holder=holder, environ=environ, wait_retiring=wait_retiring)

    def ahead_kit(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str]) -> AheadKit | None:
        hooked = self.hooks.env_hooked
        if self._pool is None or not self.settings.reuse or hooked is None or hooked():
            return None
        base = self.lease_env()
        return self._pool.ahead_kit(config, holder=holder, environ=environ,
                                    worker_env=lambda spec, lease_env: {**base, **lease_env})

    def launch_kit(self, kit: Any) -> bool:
        pool = self._pool
        return pool is not None and pool.launch_ahead_kit(kit)

    def retire_idle(self, keys: Collection[str]) -> None:
        if self._pool is not None:
            self._pool.retire_idle(keys)

    def hand_over_ahead(self) -> None:
        if self._pool is not None:
            self._pool.hand_over_ahead()

    def hand_over_ready(self, keys: Collection[str]) -> None:
        pool = self._pool
        if pool is not None:
            pool.hand_over_ready(keys)

    def gpu_count(self) -> int | None:
        return len(self.leases.inventory.static_gpus())

    def warm_events(self) -> dict[str, list[dict[str, Any]]]:
        """What happened to warm groups in this session (adopted, kept warm, refused, and the configurations not kept
        with why), for the summary and report."""
        warm = self._pool.warm if self._pool is not None else None
        if warm is None or self._pool is None:
            return {}
        events = {k: list(v) for k, v in warm.events.items()}
        if warm.settings.ttl is not None:  # --sgl-keep-warm: each configuration none of whose groups is kept, and why
            kept = {e.get("label") for e in events.get("kept", [])}
            events["not_kept"] = [{"label": label, "why": why} for label, why in self._pool.not_kept.items()
                                  if label not in kept]
        return events

    def close(self) -> None:
        try:
            if self._pool is not None:
                self._pool.close(keep_warm=self.settings.keep_warm is not None and self.keep_warm_ok,
                                 still_keep=lambda: self.keep_warm_ok, hand_over=self.keep_warm_ok)
        finally:
            if self._leases is not None:
                self._leases.inventory.close()  # NVML shutdown, the Ray connection; a declared inventory: nothing


class LocalSource(PoolSource):
    """Workers launched on this machine; GPUs leased with file locks in the lock directory, from the NVML
    inventory (``--sgl-gpus`` selects GPUs) or a declared one (``--sgl-gpus sim:N``)."""

    name = "local"

    def make_leases(self) -> Any:
        from ...resources.gpus import LeaseManager, load_inventory, parse_gpus_option

        selection = parse_gpus_option(self.settings.gpus or "")
        inventory = load_inventory(selection, self.settings.environ or os.environ)
        return LeaseManager(self.settings.lock_dir, inventory, namespace=selection.namespace,
                            on_message=self.hooks.on_message)

    def lease_env(self) -> dict[str, str]:
        """For declared GPUs (``--sgl-gpus sim:NxGiB``): the card size and the free memory the ledger predicts
        with, for the simulated engine, so that its KV pool and log lines are those of that card (the run
        report's predicted and actual KV figures then agree). A real engine ignores them."""
        from ...resources.gpus import DeclaredInventory
        from ...sim import ENV_GPU_FREE, ENV_GPU_MEM

        inventory = getattr(self.leases, "inventory", None)
        if not isinstance(inventory, DeclaredInventory):
            return {}
        return {ENV_GPU_MEM: f"{inventory.total_mib / 1024:g}", ENV_GPU_FREE: str(inventory.total_mib)}

    def make_warm(self, leases: Any) -> Warm | None:
        from ..warm import Warm, WarmSettings

        s = self.settings
        if not s.adopt_warm and s.keep_warm is None and s.run is None:
            return None
        log_dir = s.launch.log_dir or s.lock_dir
        return Warm(WarmSettings(lock_dir=s.lock_dir, log_dir=log_dir, options=s.launch, ttl=s.keep_warm,
                                 session_log_dir=s.session_log_dir, log_policy=s.log_policy, holder=s.holder,
                                 run=s.run),
                    leases, self.records, on_message=self.hooks.on_message or (lambda text: None),
                    xdist_worker=self.hooks.xdist_worker)

    def describe(self) -> str:
        gpus = self.settings.gpus or "every NVML GPU"
        return f"this machine ({gpus}), file-locked leases in {self.settings.lock_dir}"

