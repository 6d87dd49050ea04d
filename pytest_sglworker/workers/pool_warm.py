"""The pool's warm side (:class:`PoolWarm`, a part of :class:`~.pool.WorkerPool`): adopting a warm group before a
launch, the keeper a group that may leave the session is launched with, keeping groups warm at the session's end, and,
under xdist, handing a group launched ahead over within the run.

**Within a run** (issue 43). The xdist controller plans every startup of the run, whatever xdist worker runs its
tests: a configuration one xdist worker (the giver) launched ahead may have its tests sent to another one (the
taker) that is idle. Under xdist with the controller's scheduler, every group launched ahead has a keeper; when the
controller says its tests went elsewhere, the giver hands it (once ready, between its tests or while it waits for a
launch) to that keeper as a warm record that names the run (:meth:`~.warm.Warm.publish`), and answers the taker. The
taker, before it would launch the configuration, waits for that answer and adopts the group through the proofs warm
adoption has (pid, start time, owner tag, argv, environment, readiness); "no" (the launch failed, the group was let
go) and it launches its own. A group launched ahead whose tests stay with the giver is not handed over: it is used
there as before. The words travel through a :class:`HandOver` the session gives (files of the run's private
directory); no answer is waited for longer than the lease timeout, nor after the controller says the giver is gone.
Nothing outlives the run: the taker retires an adopted group as any other; a group nobody adopted is ended by the
controller at the end of the run, or by its keeper once the run's controller is gone. On the main thread, but for
the plain case of a hand-over (one ready group of the configuration, idle here), which an xdist worker's follower
thread also does while a test runs (:meth:`PoolWarm.hand_over_ready`): before, the taker waited for the giver's test
to end (with real models' tests, tens of seconds) while the group stood ready.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .config import WorkerConfig
from .pool_parts import Ahead, Entry, Prepared
from .pool_retire import Retiring
from .warm import KeepRequest, Warm

if TYPE_CHECKING:
    from ..resources.gpus import Lease, LeaseManager
    from ..resources.warm import BorrowedLease
    from ..resources.warm_keeper import KeeperHandle
    from .records import ConfigStats

__all__ = ["HandOver", "PoolWarm"]


class HandOver(Protocol):
    """The xdist controller's word about groups handed over within the run, and the giver's answers."""

    def to_hand_over(self) -> Collection[str]:
        """On the giver: the configurations whose group launched ahead here goes to another xdist worker."""

    def answer(self, key: str, published: bool) -> None:
        """On the giver: whether its group of ``key`` was handed over (False: the taker launches its own)."""

    def expects(self, key: str) -> bool:
        """On the taker: whether a group of ``key`` is being handed to it (wait for the giver's answer)."""

    def awaited(self, key: str) -> bool | None:
        """On the taker: the giver's answer about ``key`` (None: none yet, or no group of ``key`` comes)."""


class PoolWarm:
    """What :class:`~.pool.WorkerPool` does with warm groups; it holds the attributes named here."""

    warm: Warm | None
    reuse: bool
    leases: LeaseManager | None
    lease_timeout: float
    handover: HandOver | None
    on_message: Callable[[str], None]
    _lock: threading.RLock
    _idle: OrderedDict[str, Entry]
    _ahead: dict[WorkerConfig, Ahead]
    #: configurations whose group this process handed over within the run (not launched ahead again here)
    _handed: set[WorkerConfig]
    #: configurations whose hand-over this process answered
    _answered: set[str]
    #: one hand-over at a time (the main thread's :meth:`hand_over_ahead`, the follower's :meth:`hand_over_ready`)
    _handing: threading.Lock
    #: configurations whose hand-over the follower thread could not make: it leaves them to the main thread
    _left_to_main: set[str]
    _gate: threading.RLock
    _at_work: int
    _stopping: bool
    _retiring: list[Retiring]

    if TYPE_CHECKING:
        def stats_for(self, config: WorkerConfig) -> ConfigStats: ...
        def _prepare(self, config: WorkerConfig, environ: Mapping[str, str]) -> Prepared: ...
        def _member_envs(self, config: WorkerConfig, prepared: Prepared,
                         lease: Lease | BorrowedLease | None) -> list[dict[str, str]]: ...
        def _while_waiting(self, config: WorkerConfig, looked: float) -> float: ...
        def _count_gpu_seconds(self, lease: Any, leased_at: float, stats: ConfigStats) -> None: ...
        def _retire(self, entry: Entry, *, failed: bool, hand_over: tuple[Any, str] | None = None,
                    say: Callable[[str], None] | None = None) -> Any: ...

    def _keep_warm(self, still: Callable[[], bool] | None = None) -> None:
        assert self.warm is not None
        with self._lock:
            idle = [e for e in self._idle.values() if e.poolable]
        requests = [_keep_request(e) for e in idle]
        kept = self.warm.keep(requests, still=still)
        for entry in idle:
            if entry.group.id not in kept:
                continue
            with self._lock:
                self._idle.pop(entry.group.id, None)
                stats = self.stats_for(entry.config)
                stats.gpu_seconds += (time.monotonic() - entry.leased_at) * max(1, len(entry.lease.gpus)
                                                                                if entry.lease else 1)

    def _adopt(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str]) -> Entry | None:
        """A warm group of ``config`` an earlier session left (``--sgl-keep-warm``), or another xdist worker of the
        run handed over, adopted, as an entry not yet registered; None when there is none this session may have (see
        :mod:`.warm`). On the main thread."""
        if self.warm is None:
            return None
        prepared = self._prepare(config, environ)
        adopted = self.warm.adopt(config, prepared.plans, holder=holder, environ=environ,
                                  member_envs=lambda lease: self._member_envs(config, prepared, lease))
        if adopted is None:
            return None
        # one launched ahead in this run has yet to serve its first test (its launch, not a reuse)
        return Entry(adopted.group, adopted.lease, time.monotonic(), adopted.records,
                     launched_ahead=adopted.lease.record.run is not None)

    def _keeper(self, *, fresh: bool, environ: Mapping[str, str], ahead: bool = False) -> KeeperHandle | None:
        """A keeper for a new pooled group when this session keeps groups warm (``--sgl-keep-warm``), or for a
        group launched ahead when groups are handed over within the run: started before the group's members, whose
        owner tags then name its session (see :mod:`.warm`). On the main thread."""
        if fresh or not self.reuse or self.warm is None or self.leases is None:
            return None
        if self.warm.settings.ttl is None and not (ahead and self.warm.settings.run is not None):
            return None
        from ..resources.warm_keeper import KeeperHandle

        try:
            return KeeperHandle.start(self.warm.settings.lock_dir, environ)
        except OSError as exc:
            self.on_message(f"cannot start a warm keeper ({exc}): this group is not kept warm")
            return None

    @staticmethod
    def _keeper_workers(keeper: KeeperHandle | None) -> tuple[str, ...]:
        return () if keeper is None else (f"{keeper.session_id}:",)

    # -- within the run ------------------------------------------------------------------------------------------
    def hand_over_ahead(self) -> None:
        """The giver's part, on the main thread (between tests, and while it waits for a launch): each configuration
        the controller sent to another xdist worker whose group was launched ahead here goes to its keeper, once ready,
        as a record of the run, and the taker is told; one that cannot be handed over is retired, and the taker told
        "no" (it launches its own)."""
        if self.handover is None or self.warm is None or self.warm.settings.run is None:
            return
        with self._handing:  # the follower thread's, under way, ends first
            for key in [k for k in self.handover.to_hand_over() if k not in self._answered]:
                with self._lock:
                    if self._starting(key):
                        continue  # still starting: handed over once ready
                    self._forget_ahead(key)  # done: its group is idle, or it failed (the taker launches its own)
                    entries = [self._idle.pop(gid) for gid, e in list(self._idle.items())
                               if e.config.key == key and e.launched_ahead]
                handed = False
                for entry in entries:
                    if not handed and entry.group.is_alive() and self.warm.publish(_keep_request(entry)):
                        handed = True
                        with self._lock:
                            self._handed.add(entry.config)
                            self._count_gpu_seconds(entry.lease, entry.leased_at, self.stats_for(entry.config))
                    else:
                        self._retire(entry, failed=entry.tainted)
                with self._lock:
                    self._answered.add(key)
                self.handover.answer(key, handed)

    def hand_over_ready(self, keys: Collection[str]) -> None:
        """:meth:`hand_over_ahead` from another thread (an xdist worker's follower of the controller's word, while a
        test runs), of ``keys`` (the word's ``hand``, as that thread read it): a configuration sent to another xdist
        worker whose one group launched ahead here is ready and idle goes to the run now, not once the test has ended.
        Anything else (still starting, dead, several groups, a hand-over that fails, the main thread at work on the
        entries) is left to the main thread, which retires what it cannot hand over and answers "no". Works from what
        the pool holds; what it has to say waits for the main thread (:meth:`~.pool_retire.PoolRetire._flush_retired`).
        """
        if self.handover is None or self.warm is None or self.warm.settings.run is None:
            return
        if not self._handing.acquire(blocking=False):
            return  # the main thread hands over now
        try:
            for key in keys:
                with self._gate:
                    if self._stopping or self._at_work:
                        return
                    with self._lock:
                        entry = self._ready_to_hand(key)
                        if entry is None:
                            continue
                        del self._idle[entry.group.id]
                        self._forget_ahead(key)  # done: its group is the idle one
                        self._handed.add(entry.config)  # not launched ahead again here meanwhile
                said = Retiring(f"hand-over of {entry.config.label}")
                handed = self.warm.publish(_keep_request(entry), say=said.messages.append)
                with self._lock:
                    if handed:
                        self._count_gpu_seconds(entry.lease, entry.leased_at, self.stats_for(entry.config))
                        self._answered.add(key)
                    else:  # the main thread tries once more, or retires it and answers "no"; this thread, not again
                        self._handed.discard(entry.config)
                        self._idle[entry.group.id] = entry
                        self._left_to_main.add(key)
                    if said.messages:
                        self._retiring.append(said)
                if handed:
                    self.handover.answer(key, True)
        finally:
            self._handing.release()

    def _ready_to_hand(self, key: str) -> Entry | None:
        """Under the lock: the one idle, live group launched ahead of ``key`` when nothing of it still starts and its
        hand-over is not answered yet (None: the main thread's case)."""
        if key in self._answered or key in self._left_to_main or self._starting(key):
            return None
        entries = [e for e in self._idle.values() if e.config.key == key and e.launched_ahead]
        ready = len(entries) == 1 and not entries[0].tainted and entries[0].group.is_alive()
        return entries[0] if ready else None

    def _forget_ahead(self, key: str) -> None:
        """Under the lock: the launches ahead of ``key`` are done (their group, if any, is an idle entry)."""
        for config in [c for c in self._ahead if c.key == key]:
            del self._ahead[config]

    def _starting(self, key: str) -> bool:
        """Under the lock: a launch ahead of ``key`` is still starting here."""
        return any(c.key == key and a.thread is not None and a.thread.is_alive() for c, a in self._ahead.items())

    def finish_hand_overs(self) -> None:
        """The giver's part at its session's end (the controller let its xdist worker go while a group it launched
        ahead, promised to another, still starts): that launch is waited for, at most the lease timeout (what the
        taker waits for an answer), and handed over once ready, not cancelled with the others: the taker would launch
        it again, its whole startup later."""
        if self.handover is None or self.warm is None or self.warm.settings.run is None:
            return
        promised = set(self.handover.to_hand_over()) - self._answered
        with self._lock:
            threads = [a.thread for c, a in self._ahead.items() if c.key in promised and a.thread is not None]
        deadline = time.monotonic() + self.lease_timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.hand_over_ahead()

    def _await_hand_over(self, config: WorkerConfig) -> None:
        """The taker's part, before it would launch ``config``: while a group of it is being handed to this process,
        wait for the giver's answer (the group is then adopted like a warm one), at most the lease timeout."""
        if self.handover is None or not self.handover.expects(config.key):
            return
        deadline = time.monotonic() + self.lease_timeout
        looked = time.monotonic()
        while self.handover.awaited(config.key) is None and self.handover.expects(config.key) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            looked = self._while_waiting(config, looked)


def _keep_request(entry: Entry) -> KeepRequest:
    """What the warm side needs to keep or hand over ``entry``'s group."""
    return KeepRequest(entry.group, entry.lease, entry.records, entry.envs, entry.environ, entry.tainted, entry.keeper)
