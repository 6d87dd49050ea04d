"""The session pool: running workers and worker groups, keyed by their full configuration.

Plain Python: no pytest here. Everything the pool holds is a :class:`WorkerGroup` (a single worker is a
group of one): its members start together (one member's failure stops the others at once), share one GPU
lease (all GPUs at once, split among the members in order: two groups never each hold half of what the other
needs), and are reused together by later tests of the same configuration after a health check of every member
(a dead or frozen member replaces the whole group). Idle groups are evicted least recently used first; a lease
is given back only after its memory is released.

Why one module of this size: the pool's promises (one lease per group, parallel member starts with one failure
stopping the rest, reuse after health, eviction, launch ahead) all act on the same entries under one lock;
launching one process is in :mod:`launcher`, leases in :mod:`gpus`, the entries and small records in
:mod:`pool_parts`, a member's memory ledger in :mod:`member_ledger`, keeping groups warm between sessions in
:mod:`warm`, the pool's warm side (and groups handed over within a run) in :mod:`pool_warm`, its launches ahead
(from the main thread and from an xdist worker's follower of the controller) in :mod:`pool_ahead`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from ..engine.redaction import mask_argv
from ..engine.specs import ModelSpec
from ..errors import LeaseImpossible, SglWorkerError
from ..resources.processes import hostname, signal_name
from ..resources.retention import keeps
from .config import KindChooser, MemberPlan, WorkerConfig, default_kind
from .errors import LaunchCancelled, WorkerDied
from .group import WorkerGroup
from .launcher import LaunchOptions, ModelInstance, ProgressCallback, spawn_worker
from .member_ledger import attach_ledger, record_kv_tokens
from .pool_ahead import PoolAhead
from .pool_parts import (
    CALLED_OFF,
    Ahead,
    Entry,
    LeaseTimes,
    Prepared,
    failed_outcome,
    member_envs,
    nodeid_of,
    record_group_failure,
)
from .pool_retire import PoolRetire, Retiring
from .pool_warm import HandOver, PoolWarm
from .process import inherited_environ, prepare_http
from .records import ConfigStats, LaunchRecord, RunRecords
from .reset import ResetFailed, restore, snapshot
from .warm import Warm, not_kept_reason

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..resources.gpus import Lease, LeaseManager
    from ..resources.warm import BorrowedLease
    from ..resources.warm_keeper import KeeperHandle

__all__ = ["WorkerGroup", "WorkerPool"]

_ids = itertools.count(1)
#: how often the main thread, waiting for a launch (its own or one ahead), lets go idle groups no test needs
YIELD_EVERY_S = 0.5
#: how often a single member's startup shows its progress (and yields idle groups), on the main thread
PROGRESS_EVERY_S = 1.0
#: how often the main thread, waiting for a single member's startup, follows the xdist controller's word
TICK_S = 0.1


class WorkerPool(PoolAhead, PoolWarm, PoolRetire):
    """Hands out worker groups; reuses idle ones of the same configuration when ``reuse`` is on."""

    def __init__(
        self,
        options: LaunchOptions,
        *,
        leases: LeaseManager | None = None,
        lease_timeout: float = 1800.0,
        reuse: bool = True,
        log_policy: str = "failed",
        on_progress: ProgressCallback | None = None,
        on_progress_end: Callable[[], None] | None = None,
        on_message: Callable[[str], None] | None = None,
        worker_env: Callable[[ModelSpec, dict[str, str]], dict[str, str]] | None = None,
        choose_kind: KindChooser | None = None,
        release_wait: float = 60.0,
        xdist_worker: str | None = None,
        on_leased: Callable[[WorkerConfig], None] | None = None,
        records: RunRecords | None = None,
        on_tick: Callable[[], None] | None = None,
        finished: Callable[[], Collection[str]] | None = None,
        follow: Callable[[WorkerConfig], None] | None = None,
        warm: Warm | None = None,
        handover: HandOver | None = None,
        retire_in_background: bool = True,
    ) -> None:
        self.options = options
        #: called with the configuration once a test's own launch holds its lease, before its startup: the
        #: session starts the next configurations ahead on the GPUs left free, alongside this startup
        self.on_leased = on_leased
        self.leases = leases
        self.lease_timeout = lease_timeout
        self.reuse = reuse
        self.log_policy = log_policy
        self.on_progress = on_progress
        self.on_progress_end = on_progress_end
        self.on_message = on_message or (lambda msg: None)
        #: called on the main thread while it waits for launch threads (about every 0.1 s): the session writes
        #: what those threads queued for the terminal
        self.on_tick = on_tick or (lambda: None)
        self.finished = finished
        #: called on the main thread while it waits for a configuration's launch (about every 0.1 s): the session
        #: starts the launches ahead the xdist controller told it of meanwhile (not only between tests)
        self.follow = follow
        self.worker_env = worker_env
        self.choose_kind = choose_kind or default_kind
        self.release_wait = release_wait
        self.xdist_worker = xdist_worker
        #: the run's figures and launch records (shared with the routers and attached workers of the session)
        self.records = records or RunRecords(xdist_worker or "main")
        self._idle: OrderedDict[str, Entry] = OrderedDict()  # group id -> entry, LRU first
        self._busy: dict[str, Entry] = {}
        self._ahead: dict[WorkerConfig, Ahead] = {}
        #: a retired group's lease kept, as it is, for the configuration of this process's next test (a lease
        #: manager that can pass one on: Ray's placement groups); taken or given back by the next lease asked for
        self._spare: tuple[WorkerConfig, Any] | None = None
        #: the last failed launch of each configuration, with its error: the test that meets that error is put
        #: on its records (:meth:`_blame`)
        self._failed: dict[WorkerConfig, tuple[BaseException, list[LaunchRecord]]] = {}
        #: warm groups of earlier sessions: adopted before a launch; this session's kept warm at close
        #: (``--sgl-keep-warm``; see :mod:`.warm`)
        self.warm = warm
        #: the xdist controller's word on groups handed over within the run (see :mod:`.pool_warm`)
        self.handover = handover
        self._handed: set[WorkerConfig] = set()
        #: a healthy group no later test needs is retired on a thread of its own (see :mod:`.pool_retire`)
        self.retire_in_background = retire_in_background
        self._retiring: list[Retiring] = []
        self._answered: set[str] = set()
        self._handing = threading.Lock()  # one hand-over at a time: the main thread's, or the follower thread's
        self._left_to_main: set[str] = set()  # hand-overs the follower thread could not make: the main thread's now
        self.not_kept: dict[str, str] = {}  # --sgl-keep-warm: why each configuration's last group was not kept
        self._closing: str | None = None  # "keep" or "stop" once close() has begun
        #: guards the entries (idle, busy, ahead) and the figures: a launch ahead registers its group and counts
        #: its launch from its own thread
        self._lock = threading.RLock()
        #: held by a launch ahead from its check that none of its configuration is there to its registration, and by
        #: the main thread while it says it is at work on the entries: a launch ahead from another thread (the xdist
        #: worker's follower) never doubles a launch (taken before ``_lock``, never while holding it)
        self._gate = threading.RLock()  # the main thread may come back to it (a launch ahead inside its wait)
        #: how many of the main thread's acquire, release and discard are under way: a group it works on may be in
        #: none of the entries for a moment (being checked, set back, retired), and its own launch comes first
        self._at_work = 0
        self._stopping = False  # close() has begun: no launch ahead starts
        #: configurations whose last test of this process has run (:meth:`finish`): no launch ahead of them (under
        #: ``_gate``), until a test acquires one again
        self._finished: set[str] = set()

    # -- public -------------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, ConfigStats]:
        return self.records.stats

    @property
    def launches(self) -> list[LaunchRecord]:
        return self.records.launches

    def stats_for(self, config: WorkerConfig) -> ConfigStats:
        return self.records.stats_for(config.key, config.label, config.spec.model)

    def acquire(self, config: WorkerConfig, *, holder: str, fresh: bool = False,
                options: LaunchOptions | None = None, environ: Mapping[str, str] | None = None) -> WorkerGroup:
        """Healthy workers for ``config``: a pooled idle group if reuse is on and every member answers its
        health check, else a new one. ``options`` replaces the pool's launch options for this group (which
        is then never shared). ``environ``: the environment a new group inherits (default: this process's,
        read now). Called on the main thread."""
        fresh = fresh or options is not None
        asked = time.time()
        self._flush_retired()
        with self._gate:
            self._finished.discard(config.key)  # a test takes it again (a test run again after a crash elsewhere)
        with self._at_work_on():  # a launch ahead another thread has begun is registered: it is joined below
            try:
                return self._acquire(config, holder=holder, fresh=fresh, options=options, environ=environ)
            except SglWorkerError as exc:
                self._blame(config, exc, nodeid_of(holder), asked)
                raise

    def _acquire(self, config: WorkerConfig, *, holder: str, fresh: bool, options: LaunchOptions | None,
                 environ: Mapping[str, str] | None) -> WorkerGroup:
        stats = self.stats_for(config)
        if not fresh:
            self._join_ahead(config)
        if self.reuse and not fresh:
            with self._lock:
                candidates = [key for key, entry in self._idle.items() if entry.config == config]
            for key in candidates:
                with self._lock:
                    entry = self._idle.pop(key, None)
                if entry is None:
                    continue
                bad = next((m for m in entry.group if not m.responds()), None)
                if bad is None:
                    with self._lock:
                        self._busy[key] = entry
                        if entry.launched_ahead:
                            entry.launched_ahead = False  # its first test: a launch, not a reuse
                        else:
                            stats.reuses += 1
                    self._read_states(entry)
                    return entry.group
                why = "died while idle in the pool" if not bad.is_alive() else (
                    "does not answer its health check (frozen or wedged)")
                # a dead member is counted as a death when its group is retired; a frozen one did not die
                what = "it" if len(entry.group) == 1 else "its group"
                self.on_message(bad.failure_message(f"{why}; replacing {what}", lines=10))
                self._retire(entry, failed=True)
        environ = inherited_environ() if environ is None else environ
        if self.reuse and not fresh:
            self._await_hand_over(config)
            adopted = self._adopt(config, holder=holder, environ=environ)
            if adopted is not None:
                with self._lock:
                    self._busy[adopted.group.id] = adopted
                    # a running worker serves the test: a reuse, of an earlier session's (one launched ahead in this
                    # run serves its first test: its launch counted)
                    stats.reuses += not adopted.launched_ahead
                    adopted.launched_ahead = False
                self._read_states(adopted)
                return adopted.group
        group = self._launch(config, holder=holder, fresh=fresh, options=options or self.options, environ=environ)
        with self._lock:
            entry = self._busy.get(group.id)
        if entry is not None and entry.poolable and self.reuse:
            self._read_states(entry)
        return group

    def release(self, group: WorkerGroup, *, failed: bool = False, needed_next: bool = False) -> None:
        """Give a group back after a test; it stays pooled when reuse is on, every member is alive and no other process
        waits for a GPU, unless ``needed_next`` (this process's next test needs it: it would launch it again)."""
        self._flush_retired()
        with self._at_work_on():
            self._release(group, failed=failed, needed_next=needed_next)

    def _release(self, group: WorkerGroup, *, failed: bool, needed_next: bool) -> None:
        with self._lock:
            entry = self._busy.pop(group.id, None)
        if entry is None:
            return
        entry.tainted = entry.tainted or failed
        entry.last_used = time.monotonic()
        if self.reuse and entry.poolable and group.is_alive() and (needed_next or not self._others_wait()) \
                and self._set_back(entry):
            with self._lock:
                self._idle[group.id] = entry
        else:  # here: a fresh group goes with its test (a test that asks for one expects it gone after)
            self._retire(entry, failed=entry.tainted)

    def _read_states(self, entry: Entry) -> None:
        """Read each member's run-time state the first time the group is handed out (main thread)."""
        if entry.states is not None:
            return
        try:
            entry.states = [snapshot(member) for member in entry.group]
        except ResetFailed as exc:
            entry.poolable = False  # what it was cannot be told: it serves this test only
            self.on_message(f"sglworker: {entry.config.label}: its run-time state cannot be read ({exc}); its "
                            "workers serve this test only")

    def _set_back(self, entry: Entry) -> bool:
        """Set back what the test changed in the members (runtime faults, ...); False when that fails (the group is
        then retired, not reused). Counted in the configuration's figures."""
        if not entry.states:
            return True
        stats = self.stats_for(entry.config)
        changed: list[str] = []
        for member, before in zip(entry.group, entry.states, strict=True):
            try:
                changed += restore(member, before)
            except ResetFailed as exc:
                with self._lock:
                    stats.not_reset += 1
                what = "it" if len(entry.group) == 1 else "its group"
                why = ("does not answer (frozen or wedged)" if exc.unanswered
                       else "is not reused: what the test changed in it could not be set back")
                self.on_message(member.failure_message(f"{why} ({exc}); retiring {what}", lines=10))
                return False
        if changed:
            with self._lock:
                stats.resets += 1
        return True

    def finish(self, key: str) -> None:
        """No later test of this process takes configuration ``key`` (its last test here has run; called before its
        group is let go): no launch ahead of it starts from now on, until a test acquires it again. Under xdist, the
        controller's word still names it until the controller has heard that the test ran, and this process's
        follower of that word, reading it meanwhile, launched the group just let go again, for no test (issue 43)."""
        with self._gate:
            self._finished.add(key)

    def discard(self, group: WorkerGroup, *, failed: bool = True, then: WorkerConfig | None = None) -> None:
        """Stop a group now (a member died, the test asked for fresh workers, or no later test needs it). ``then``:
        the configuration of this process's next test; a lease manager that can pass a lease on as it is (Ray's)
        keeps this group's lease for it when it asks for the same GPUs (its next lease, whatever it is for, takes
        it or gives it back)."""
        self._flush_retired()
        with self._at_work_on():
            self._discard(group, failed=failed, then=then)

    def _discard(self, group: WorkerGroup, *, failed: bool, then: WorkerConfig | None) -> None:
        with self._lock:
            entry = self._busy.pop(group.id, None) or self._idle.pop(group.id, None)
        if entry is None:
            return
        # a configuration with a group pooled, or launched ahead, needs no lease
        wanted = self._wanted(then) if then is not None and not self._has_group(then) \
            and getattr(self.leases, "hand_over", None) else None
        if wanted is None:
            self._retire_soon(entry, failed=failed or entry.tainted)
            return
        handed = self._retire(entry, failed=failed or entry.tainted,
                              hand_over=(wanted, entry.lease.holder if entry.lease else ""))
        if handed is not None and then is not None:
            self._put_spare(then, handed)

    def _has_group(self, config: WorkerConfig) -> bool:
        """Whether a group of ``config`` is pooled (idle or busy), being launched ahead, or handed over in the run."""
        with self._lock:
            return config in self._ahead or config in self._handed or any(
                e.config == config for e in [*self._idle.values(), *self._busy.values()])

    def _put_spare(self, config: WorkerConfig, lease: Any) -> None:
        with self._lock:
            before, self._spare = self._spare, (config, lease)
        if before is not None:
            before[1].release(wait_timeout=self.release_wait)

    def _take_spare(self, config: WorkerConfig | None, *, others: bool = True) -> Any:
        """The spare lease when it was kept for ``config``; one kept for another is given back (``others``; left
        for its own launch otherwise). ``config`` None: give back any."""
        with self._lock:
            spare = self._spare
            if spare is None or (spare[0] != config and not others):
                return None
            self._spare = None
        if spare[0] == config:
            return spare[1]
        spare[1].release(wait_timeout=self.release_wait)
        return None

    def _blame(self, config: WorkerConfig, exc: BaseException, nodeid: str, asked: float) -> None:
        """The test that met a failed launch of ``config`` (its own, or one launched ahead for it) goes on that
        launch's records, as an error of its setup; the run report gives it the outcome pytest gave it."""
        with self._lock:
            failed = self._failed.get(config)
            if failed is None or failed[0] is not exc:
                return
            del self._failed[config]
            for record in failed[1]:
                record.served(nodeid, asked, time.time(), "error")
            self.stats_for(config).failed_tests += 1

    def served(self, group: WorkerGroup, nodeid: str, t_start: float | None, t_end: float | None,
               outcome: str) -> None:
        """Record that a test used ``group`` (for the run report's launch records)."""
        with self._lock:
            entry = self._busy.get(group.id) or self._idle.get(group.id)
            if entry is not None:
                for record in entry.records:
                    record.served(nodeid, t_start, t_end, outcome)
                if outcome in ("failed", "error", "interrupted"):
                    self.stats_for(entry.config).failed_tests += 1

    def close(self, *, keep_warm: bool = False, still_keep: Callable[[], bool] | None = None,
              hand_over: bool = True) -> None:
        """Stop every worker (those launched ahead too, used or not) and give back every lease. ``keep_warm``
        (``--sgl-keep-warm``): the idle groups that still answer their readiness check are first handed to the
        keepers that keep them warm (see :mod:`.warm`), while ``still_keep()`` says so. ``hand_over`` (not after an
        interrupt): a group launched ahead that the xdist controller promised to another xdist worker is handed over
        once ready (:meth:`finish_hand_overs`) before the rest is stopped."""
        with self._gate:
            self._stopping = True  # a launch ahead from another thread starts nothing from now on
        self._join_retiring()  # their records finished before the run's report, their leases given back
        if hand_over:
            with contextlib.suppress(Exception):  # an optimisation: the taker launches its own
                self.finish_hand_overs()
        with self._lock:
            aheads = list(self._ahead.values())
            self._ahead.clear()
        for ahead in aheads:
            ahead.cancel.set()
        for ahead in aheads:
            if ahead.thread is not None:
                ahead.thread.join(120)
        self._take_spare(None)
        self._closing = "keep" if keep_warm else "stop"
        if keep_warm and self.warm is not None:
            with contextlib.suppress(Exception):  # keeping warm is an optimisation: the workers are stopped instead
                self._keep_warm(still_keep)
        with self._lock:
            entries = list(self._busy.values()) + list(self._idle.values())
            self._busy.clear()
            self._idle.clear()
        for entry in entries:
            with contextlib.suppress(Exception):
                self._retire(entry, failed=entry.tainted)

    # -- launching ahead ----------------------------------------------------------------------------------
    def _join_ahead(self, config: WorkerConfig, *, raise_error: bool = True) -> None:
        """Wait for a launch ahead of ``config`` to finish; raise what it met, as if launched now (unless
        ``raise_error`` is false: a launch ahead called off for another test; the test that needs ``config``
        then launches it itself and meets its failure then)."""
        with self._lock:
            ahead = self._ahead.pop(config, None)
        if ahead is None or ahead.thread is None:
            return
        looked = time.monotonic() - YIELD_EVERY_S
        while ahead.thread.is_alive():
            ahead.thread.join(0.1)
            looked = self._while_waiting(config, looked)  # as while it waits for a launch of its own
        if raise_error and ahead.error is not None and not isinstance(ahead.error, LaunchCancelled):
            raise ahead.error

    def yield_idle(self, *, keep: WorkerConfig | None = None) -> None:
        """When another process waits for a GPU, retire the idle groups with no known use (not ``keep``, the next
        test's configuration, nor one launched ahead), which would hold their GPUs while this process runs others."""
        with self._lock:
            spare = [key for key, e in self._idle.items() if e.config != keep and not e.launched_ahead]
        if spare and self._others_wait():
            with self._lock:
                entries = [self._idle.pop(key) for key in spare if key in self._idle]
            for entry in entries:
                self._retire_soon(entry, failed=entry.tainted)

    def _while_waiting(self, config: WorkerConfig, looked: float) -> float:
        """Each 0.1 s the main thread waits for ``config``'s launch: the terminal's queue; every :data:`YIELD_EVERY_S`
        since ``looked``, idle groups no test needs go (their GPUs serve elsewhere); once, the HTTP client's setup
        (:func:`.process.prepare_http`), which the test would pay. Returns when it last looked."""
        self.on_tick()
        self._flush_retired()
        prepare_http()
        if self.follow is not None:
            self.follow(config)
        if time.monotonic() - looked < YIELD_EVERY_S:
            return looked
        self.yield_idle(keep=config)
        self._retire_finished()
        self.hand_over_ahead()
        return time.monotonic()

    def _retire_finished(self) -> None:
        """While the main thread waits for a launch: the idle groups of the configurations ``finished`` names."""
        if self.finished is not None:
            keys = self.finished()
            if keys:
                self.retire_idle(keys)

    def retire_idle(self, keys: Collection[str]) -> None:
        """Retire the idle groups of the configurations ``keys`` (the xdist controller says no later test needs
        them: their GPUs go to a launch ahead); a group launched ahead that no test used yet stays."""
        with self._lock:
            entries = [self._idle.pop(k) for k, e in list(self._idle.items())
                       if e.config.key in keys and not e.launched_ahead]
        for entry in entries:
            self._retire_soon(entry, failed=entry.tainted)

    def groups(self) -> list[WorkerGroup]:
        with self._lock:
            return [e.group for e in list(self._busy.values()) + list(self._idle.values())]

    def _others_wait(self) -> bool:
        """Another process waits for a GPU: do not keep an idle group's lease (it queues behind us)."""
        if self.leases is None:
            return False
        try:
            waiting = self.leases.others_waiting()
        except OSError:
            return False
        if waiting:
            self.on_message("another process waits for a GPU lease: retiring the idle worker instead of pooling it")
        return waiting

    # -- launching ----------------------------------------------------------------------------------------
    def _prepare(self, config: WorkerConfig, environ: Mapping[str, str]) -> Prepared:
        """The members' plans (their kinds: a plugin's hook may choose them) and the environment they inherit:
        worked out on the main thread, before any launch thread starts."""
        plans = config.members(self.choose_kind)
        return Prepared(plans, [plan.gpus(config.spec) for plan in plans], dict(environ))

    def _member_envs(self, config: WorkerConfig, prepared: Prepared,
                     lease: Lease | BorrowedLease | None) -> list[dict[str, str]]:
        """Each member's env from its share of the lease (a plugin's hook may change it): on the main thread."""
        return member_envs(config, prepared, lease, self.worker_env)

    def _launch(self, config: WorkerConfig, *, holder: str, fresh: bool, options: LaunchOptions,
                environ: Mapping[str, str] | None = None, lease: Lease | None = None,
                prepared: Prepared | None = None, envs: list[dict[str, str]] | None = None, quiet: bool = False,
                cancel: threading.Event | None = None, keeper: KeeperHandle | None = None,
                lease_times: LeaseTimes | None = None) -> WorkerGroup:
        """Lease (unless given), start and register a group. On the main thread, or, with ``lease``,
        ``prepared`` and ``envs`` all made on the main thread (and ``keeper``, when one is wanted), on a
        launch-ahead thread, ``lease_times`` saying when the main thread took ``lease``. A group that may be
        kept warm has a keeper, whose session its members' tags name."""
        if lease is None and keeper is None:
            keeper = self._keeper(fresh=fresh,
                                  environ=inherited_environ() if environ is None else environ)
        try:
            return self._launch_with(config, holder=holder, fresh=fresh, options=options, environ=environ,
                                     lease=lease, prepared=prepared, envs=envs, quiet=quiet, cancel=cancel,
                                     keeper=keeper, lease_times=lease_times)
        except BaseException:
            if keeper is not None:
                keeper.close()  # it ends whatever its session id still tags, then exits
            raise

    def _launch_with(self, config: WorkerConfig, *, holder: str, fresh: bool, options: LaunchOptions,
                     environ: Mapping[str, str] | None, lease: Lease | None, prepared: Prepared | None,
                     envs: list[dict[str, str]] | None, quiet: bool, cancel: threading.Event | None,
                     keeper: KeeperHandle | None, lease_times: LeaseTimes | None) -> WorkerGroup:
        stats = self.stats_for(config)
        if keeper is not None:
            options = dataclasses.replace(options, owner_session=keeper.session_id)
        if prepared is None:
            prepared = self._prepare(config, inherited_environ() if environ is None else environ)
        plans, counts = prepared.plans, prepared.counts
        group_id = f"{self.xdist_worker or 'main'}-{os.getpid()}-{next(_ids)}"
        requested = time.time()
        if lease is None:
            lease, waited = self._lease_for(config, counts, holder, self._keeper_workers(keeper))
            with self._lock:
                stats.lease_wait_seconds += waited
            if self.on_leased is not None and not quiet:
                try:
                    self.on_leased(config)
                except BaseException:  # an interrupt: the lease must not outlive it
                    if lease is not None:
                        self._give_back(lease, [], time.monotonic(), stats)
                    raise
        if lease_times is None:  # leased here (a launch ahead's lease was taken on the main thread, earlier)
            lease_times = LeaseTimes.taken_now(requested, lease)
        leased_at = lease_times.leased_monotonic
        records = [self._record(config, plan, group_id if len(plans) > 1 else None, lease_times.requested,
                                lease_times.leased) for plan in plans]
        if lease is not None:  # each member's share, in order (a failed start has run on them too)
            start = 0
            for record, count in zip(records, counts, strict=True):
                share, start = lease.gpus[start:start + count], start + count
                record.gpus, record.gpu_names = [g.index for g in share], [g.name for g in share]
        for record in records:
            record.t_started = time.time()  # refined by each member's own start time once it runs
        try:
            if envs is None:
                envs = self._member_envs(config, prepared, lease)
            try:
                members = self._start_members(config, plans, envs, options, records, quiet=quiet, cancel=cancel,
                                              lease=lease, environ=prepared.environ)
            finally:
                if self.on_progress_end is not None and not quiet:
                    self.on_progress_end()  # the status line goes before pytest writes the outcome
        except LaunchCancelled:  # a launch ahead called off: neither a failure nor a launch
            self._finish_records(records, outcome="cancelled", failure=CALLED_OFF)
            if lease is not None:
                self._give_back(lease, [], leased_at, stats)
            self._stamp_released(records)
            raise
        except SglWorkerError as exc:
            for record in records:  # a group's members have each ended already (record_group_failure)
                record.failed(failed_outcome(exc), exc)
            logs = list(dict.fromkeys(r.log_path for r in records if r.log_path))
            with self._lock:
                stats.failures += 1
                self._failed[config] = (exc, records)
                if keeps(self.log_policy, failed=True):
                    stats.failed_logs.extend(log for log in logs if log not in stats.failed_logs)
            if not keeps(self.log_policy, failed=True):
                for log in logs:
                    with contextlib.suppress(OSError):
                        os.unlink(log)
            if lease is not None:
                self._give_back(lease, [], leased_at, stats)
            self._stamp_released(records)
            raise
        except BaseException as exc:  # the lease must never outlive a failed launch (a hook, an interrupt)
            self._finish_records(records, outcome="interrupted")
            stats.interrupted += isinstance(exc, KeyboardInterrupt)  # main thread only (SIGTERM too): no lock
            if lease is not None:
                self._give_back(lease, [], leased_at, stats)
            self._stamp_released(records)
            raise
        group = WorkerGroup(config, members, group_id)
        # Registered at once, so that whatever happens next, close() stops it and gives the lease back.
        ready = [m.startup_seconds for m in members if m.startup_seconds is not None]
        with self._lock:
            self._busy[group_id] = Entry(group, lease, leased_at, records, poolable=not fresh, envs=envs,
                                          environ=prepared.environ, keeper=keeper)
            stats.launches += 1
            # a wait for a port block is a wait for the launch's resources, as the GPU lease's is
            stats.lease_wait_seconds += sum(m.port_block.waited for m in members if m.port_block is not None)
            if ready:
                stats.startup_seconds.append(max(ready))  # a group is ready when its slowest member is
            with contextlib.suppress(Exception):  # bookkeeping for the report must never fail a test
                record_kv_tokens(members, config, plans, lease, stats)
        return group

    def _start_members(self, config: WorkerConfig, plans: Sequence[MemberPlan], envs: Sequence[dict[str, str]],
                       options: LaunchOptions, records: Sequence[LaunchRecord], *, environ: Mapping[str, str],
                       quiet: bool = False, cancel: threading.Event | None = None,
                       lease: Lease | None = None) -> list[ModelInstance]:
        """Start every member; a group is ready after its slowest member, not the sum of their startups. The
        first member that fails stops the others at once and is the error raised. A lease that places its
        members itself (``spawner``: a Ray placement group's bundles) starts member ``i`` in its part ``i``. While a
        test's own launch starts (on the main thread), idle groups go to a process that comes to wait for a GPU."""
        shown = [-PROGRESS_EVERY_S]

        def while_starting(target: Any, elapsed: float) -> None:  # a single member's wait, on the main thread
            prepare_http()  # once: the test would pay it
            if self.follow is not None:
                self.follow(config)  # every tick: a launch ahead told meanwhile starts now
            if elapsed - shown[0] < PROGRESS_EVERY_S:
                return
            shown[0] = elapsed
            if self.on_progress is not None:
                self.on_progress(target, elapsed)
            self.yield_idle(keep=config)

        def spawn(i: int, cancel: threading.Event | None) -> ModelInstance:
            plan, env = plans[i], envs[i]
            placed = getattr(lease, "spawner", None)
            launch = placed(i) if placed is not None else spawn_worker
            progress = None if quiet else while_starting if len(plans) == 1 else self.on_progress
            interval = TICK_S if progress is while_starting and self.follow is not None else PROGRESS_EVERY_S
            try:
                return launch(config.spec, extra_args=plan.extra_args, env=env, options=options,
                              on_progress=progress,
                              progress_interval=interval,
                              gpus=env.get("CUDA_VISIBLE_DEVICES"), kind=plan.kind, index=plan.index,
                              cancel=cancel, environ=environ)
            except SglWorkerError as exc:  # a memory failure gets the ledger of this member's own args
                with contextlib.suppress(Exception):
                    attach_ledger(exc, config, plans, i, lease)
                raise

        outer = cancel
        if len(plans) == 1:
            instance = spawn(0, outer)
            self._take(records[0], instance)
            return [instance]
        cancel = threading.Event()
        results: list[ModelInstance | BaseException | None] = [None] * len(plans)
        failed_at: list[tuple[float, int]] = []

        def run(i: int) -> None:
            try:
                results[i] = spawn(i, cancel)
            except BaseException as exc:  # handed to the main thread
                results[i] = exc
                if not isinstance(exc, LaunchCancelled):
                    failed_at.append((time.monotonic(), i))
                cancel.set()

        threads = [threading.Thread(target=run, args=(i,), name=f"sglworker-start-{i}", daemon=True)
                   for i in range(len(plans))]
        for thread in threads:
            thread.start()
        looked = time.monotonic() - YIELD_EVERY_S  # at once, then every YIELD_EVERY_S
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.1)
                    if not quiet:
                        looked = self._while_waiting(config, looked)
                    if outer is not None and outer.is_set():
                        cancel.set()  # a launch ahead called off at the session's end: every member stops
        except BaseException:  # Ctrl-C: the members stop, then the interrupt goes on
            cancel.set()
            for thread in threads:
                thread.join(60)
            self._stop_started(results, records)
            raise
        for i, result in enumerate(results):
            if isinstance(result, ModelInstance):
                self._take(records[i], result)
            elif isinstance(result, LaunchCancelled) and not failed_at:
                records[i].failed("cancelled", failure=CALLED_OFF)
        if failed_at:
            self._stop_started(results, records)
            first = results[min(failed_at)[1]]
            assert isinstance(first, BaseException)
            record_group_failure(records, plans, results, min(failed_at)[1])
            raise first
        return [r for r in results if isinstance(r, ModelInstance)]

    def _stop_started(self, results: Sequence[ModelInstance | BaseException | None],
                      records: Sequence[LaunchRecord]) -> None:
        for i, result in enumerate(results):
            if isinstance(result, ModelInstance):
                with contextlib.suppress(Exception):
                    result.stop()
                self._take(records[i], result)

    def _record(self, config: WorkerConfig, plan: MemberPlan, group_id: str | None, requested: float,
                leased: float | None) -> LaunchRecord:
        return self.records.new_launch(
            config=config.key, label=config.label, model=config.spec.model, role=plan.role, group=group_id,
            xdist_worker=self.xdist_worker, node=hostname(), t_lease_requested=requested, t_leased=leased)

    @staticmethod
    def _take(record: LaunchRecord, instance: ModelInstance) -> None:
        record.take_times(instance)
        record.port, record.pid, record.log_path = instance.port, instance.pid, str(instance.log_path)
        record.node = getattr(instance, "ray_node", "") or record.node  # a Ray actor's node, not this machine
        record.argv = " ".join(mask_argv(instance.argv))
        # the GPUs the process was given (a Ray actor's own), else its share of the lease
        record.gpus = [int(g) for g in (instance.gpus or "").split(",") if g.strip().isdigit()] or record.gpus

    @staticmethod
    def _finish_records(records: Sequence[LaunchRecord], *, outcome: str, failure: str | None = None) -> None:
        for record in records:
            if record.outcome == "ok":
                record.outcome = outcome
                record.failure = failure

    @staticmethod
    def _stamp_released(records: Sequence[LaunchRecord]) -> None:
        now = time.time()
        for record in records:
            record.t_released = record.t_released or now

    def _wanted(self, config: WorkerConfig, counts: Sequence[int] | None = None) -> Any:
        """What a lease of ``config`` asks for: its GPU count, or each member's count for a lease manager that
        places members itself (``per_member``: Ray's placement groups, one bundle per member). ``counts``: the
        members' counts worked out already (else the kind hook is asked: main thread)."""
        if counts is None:
            counts = [plan.gpus(config.spec) for plan in config.members(self.choose_kind)]
        return list(counts) if getattr(self.leases, "per_member", False) else sum(counts)

    def _lease_for(self, config: WorkerConfig, counts: Sequence[int], holder: str,
                   workers: Sequence[str] = ()) -> tuple[Lease | None, float]:
        if self.leases is None:
            return None, 0.0
        spare = self._take_spare(config)
        if spare is not None:
            spare.holder = holder
            return spare, 0.0
        gpus = sum(counts)
        wanted: Any = list(counts) if getattr(self.leases, "per_member", False) else gpus
        memory = config.spec.memory_mib
        start = time.monotonic()
        joined = False
        # First without waiting; evict idle groups (LRU first) while that frees a lease; launches ahead of
        # other configurations give way (called off: the test that needs its GPUs now comes first).
        while True:
            lease = self.leases.try_acquire(wanted, memory, holder=holder, **self._workers_kw(workers))
            if lease is not None:
                return lease, time.monotonic() - start  # time spent evicting idle workers counts too
            if not joined and self._retiring_now():  # the GPUs of a group retired off this thread may be wanted
                self._join_retiring()
                joined = True  # once: a retirement past the join's deadline is waited for as any holder
                continue
            with self._lock:
                aheads = [a for a in self._ahead.values() if a.config != config]
            if not self._idle and aheads:
                for ahead in aheads:
                    ahead.cancel.set()
                for ahead in aheads:
                    self._join_ahead(ahead.config, raise_error=False)  # its failure is not this test's
                continue
            with self._lock:
                if not self._idle:
                    break
                # least recently used first; a group launched ahead last (a coming test needs it: evicted first, a
                # box run stopped one ready for its next configuration and launched it again after another)
                victim = self._idle.pop(min(self._idle, key=lambda k: self._idle[k].launched_ahead))
            self.on_message(f"evicting idle {', '.join(m.describe() for m in victim.group)} to free its GPU "
                            f"lease for {config.label}")
            handed = self._retire(victim, failed=victim.tainted, hand_over=(wanted, holder))
            if handed is not None:  # its lease, taken over as it is (a Ray placement group is not made again)
                return handed, time.monotonic() - start
        self._check_not_self_blocked(config, gpus)
        lease = self.leases.acquire(wanted, memory, holder=holder, timeout=self.lease_timeout,
                                    on_wait=self.on_message, **self._workers_kw(workers))
        return lease, time.monotonic() - start

    @staticmethod
    def _workers_kw(workers: Sequence[str]) -> dict[str, Any]:
        """``workers=`` for a lease manager of this machine's file leases (a keeper's session, for the holder
        records); nothing for another (a Ray cluster's placement groups keep no holder records)."""
        return {"workers": tuple(workers)} if workers else {}

    def _check_not_self_blocked(self, config: WorkerConfig, gpus: int) -> None:
        """Fail at once when the GPUs that are missing are held by workers this process itself uses right now
        (two workers in one test on a 1-GPU inventory): waiting would last until the lease timeout."""
        assert self.leases is not None
        total = len(self.leases.inventory.static_gpus())
        with self._lock:
            mine = [e for e in self._busy.values() if e.lease is not None]
        held = sum(len(e.lease.gpus) for e in mine if e.lease is not None)
        if mine and total - held < gpus:
            users = "; ".join(f"{e.config.label} on GPU(s) {','.join(str(g.index) for g in e.lease.gpus)}"
                              for e in mine if e.lease is not None)
            raise LeaseImpossible(
                f"{config.label} needs {gpus} GPU(s), but this process's own workers in use hold {held} of the "
                f"{total} GPU(s) of {self.leases.inventory.describe()} ({users}): the lease could only come "
                "after this test, so waiting would last until --sgl-lease-timeout; use fewer workers at once "
                "or more GPUs")

    # -- retiring -----------------------------------------------------------------------------------------
    def _retire(self, entry: Entry, *, failed: bool, hand_over: tuple[Any, str] | None = None,
                say: Callable[[str], None] | None = None) -> Any:
        """Stop ``entry``'s group and give its lease back. ``hand_over`` (what the next lease asks for, its
        holder): a lease manager that can pass a lease on as it is (``hand_over``: Ray's placement groups) does so
        when it fits, and the lease it returns is this method's result (None: the lease was given back). ``say``:
        where its messages go (default ``on_message``; a retirement off the main thread queues them)."""
        say = say or self.on_message
        group = entry.group
        stats = self.stats_for(entry.config)
        dead = [m for m in group if not m.is_alive() and not m.stopped]
        stopped = [m for m in group if m.stopped]
        with self._lock:
            stats.deaths += len(dead)
            stats.stops += len(stopped)
        if self.warm is not None and self.warm.settings.ttl is not None:
            with self._lock:
                self.not_kept[entry.config.label] = not_kept_reason(bool(dead), bool(stopped), entry.poolable,
                                                                    self._closing)
        failed = failed or bool(dead)
        try:
            for member in group:
                member.stop()
                for warning in member.warnings:
                    say(warning)
                member.warnings.clear()
        finally:
            pids: list[int] = []
            for member, record in zip(group, entry.records, strict=False):
                pids += sorted(member.pids_seen)
                if member in dead:  # the diagnosis of its log, with its exit status
                    record.failed("died", failure=f"exited with {signal_name(member.returncode)}", replace=True)
                    record.exit_code = member.returncode
                    with contextlib.suppress(Exception):  # bookkeeping for the report must never fail a test
                        record.failed("died", member.failure(WorkerDied, record.failure or "died"), replace=True)
                elif member in stopped and record.outcome == "ok":
                    record.outcome = "stopped"
                self._take(record, member)
                path = str(member.log_path)
                kept = stats.failed_logs if failed else stats.kept_logs
                if not keeps(self.log_policy, failed=failed):
                    member.remove_log()
                else:
                    with self._lock:
                        if path not in kept:
                            kept.append(path)
            handed = None
            if entry.lease is not None:
                take = getattr(self.leases, "hand_over", None)
                if take is not None and hand_over is not None:
                    handed = take(entry.lease, hand_over[0], holder=hand_over[1])
                if handed is None:
                    self._give_back(entry.lease, pids, entry.leased_at, stats, say)
                else:
                    self._count_gpu_seconds(entry.lease, entry.leased_at, stats)
            self._stamp_released(entry.records)
            if entry.keeper is not None:
                entry.keeper.close()  # nothing of its session is left: it exits
        return handed

    def _count_gpu_seconds(self, lease: Any, leased_at: float, stats: ConfigStats) -> None:
        with self._lock:
            stats.gpu_seconds += (time.monotonic() - leased_at) * max(1, len(lease.gpus))

    def _give_back(self, lease: Lease | BorrowedLease, pids: list[int], leased_at: float, stats: ConfigStats,
                   say: Callable[[str], None] | None = None) -> None:
        report = lease.release(worker_pids=pids, wait_timeout=self.release_wait)
        self._count_gpu_seconds(lease, leased_at, stats)
        if report is not None and not getattr(report, "memory_back", True):
            (say or self.on_message)(str(report))
