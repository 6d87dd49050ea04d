"""The pool's launches ahead (:class:`PoolAhead`, a part of :class:`~.pool.WorkerPool`): a group started in a thread of
its own for a test to come, on GPUs free this moment, from the main thread (:meth:`PoolAhead.launch_ahead`) or, with
what the main thread worked out (:meth:`PoolAhead.ahead_kit`), from another thread: an xdist worker's follower of the
controller's word, while a test runs (:meth:`PoolAhead.launch_ahead_kit`). The pool's gate orders the two: a launch
ahead holds it from its check that its configuration is not there to its registration, and the main thread while it
says that it acquires, gives back or stops a group (:meth:`PoolAhead._at_work_on`). Plain Python: no pytest here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..engine.specs import ModelSpec
from ..errors import SglWorkerError
from .config import WorkerConfig
from .pool_parts import Ahead, AheadKit, Entry, LeaseTimes, Prepared, member_envs
from .process import inherited_environ

if TYPE_CHECKING:
    from ..resources.gpus import Lease, LeaseManager
    from ..resources.warm import BorrowedLease
    from ..resources.warm_keeper import KeeperHandle
    from .group import WorkerGroup
    from .launcher import LaunchOptions
    from .pool_warm import HandOver
    from .warm import Warm

__all__ = ["PoolAhead"]


class PoolAhead:
    """What :class:`~.pool.WorkerPool` does to launch ahead; it holds the attributes named here."""

    leases: LeaseManager | None
    options: LaunchOptions
    release_wait: float
    handover: HandOver | None
    warm: Warm | None
    _lock: threading.RLock
    _gate: threading.RLock
    _at_work: int
    _stopping: bool
    _finished: set[str]
    _idle: OrderedDict[str, Entry]
    _busy: dict[str, Entry]
    _ahead: dict[WorkerConfig, Ahead]

    if TYPE_CHECKING:
        def _has_group(self, config: WorkerConfig) -> bool: ...
        def _adopt(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str]) -> Entry | None: ...
        def _prepare(self, config: WorkerConfig, environ: Mapping[str, str]) -> Prepared: ...
        def _member_envs(self, config: WorkerConfig, prepared: Prepared,
                         lease: Lease | BorrowedLease | None) -> list[dict[str, str]]: ...
        def _keeper(self, *, fresh: bool, environ: Mapping[str, str], ahead: bool = False) -> KeeperHandle | None: ...
        @staticmethod
        def _keeper_workers(keeper: KeeperHandle | None) -> tuple[str, ...]: ...
        def _retiring_now(self) -> bool: ...
        def _join_retiring(self) -> None: ...
        def _take_spare(self, config: WorkerConfig | None, *, others: bool = True) -> Any: ...
        def _wanted(self, config: WorkerConfig, counts: Sequence[int] | None = None) -> Any: ...
        def _launch(self, config: WorkerConfig, *, holder: str, fresh: bool, options: LaunchOptions,
                    environ: Mapping[str, str] | None = None, lease: Lease | None = None,
                    prepared: Prepared | None = None, envs: list[dict[str, str]] | None = None, quiet: bool = False,
                    cancel: threading.Event | None = None, keeper: KeeperHandle | None = None,
                    lease_times: LeaseTimes | None = None) -> WorkerGroup: ...

    @contextlib.contextmanager
    def _at_work_on(self) -> Iterator[None]:
        """The main thread at work on the entries: no launch ahead from another thread starts meanwhile."""
        with self._gate:
            self._at_work += 1
        try:
            yield
        finally:
            with self._gate:
                self._at_work -= 1

    def launch_ahead(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str] | None = None,
                     wait_retiring: bool = True) -> bool:
        """Start ``config``'s group now, in the background, so that it is ready when its first test begins.
        Only on GPUs that are free this moment and that no other process waits for (it never evicts, never
        waits for a lease; without a free GPU, it waits for this process's retirements under way, and tries once
        more, unless not ``wait_retiring``: a follower thread starts it once their GPUs are free); at most one
        launch ahead per configuration, and none of one whose last test here has run (:meth:`finish`). Returns
        whether it started. The test
        that needs it gets it from :meth:`acquire` (which waits for it), or the failure it met, exactly as if
        it had been launched then. Called on the main thread, which works out here everything the launch thread
        needs (the members' kinds and environments, ``environ``: default this process's, read now); the thread
        touches nothing else of the session."""
        environ = inherited_environ() if environ is None else environ
        with self._gate:
            if self._stopping or config.key in self._finished or self._has_group(config):
                return False
            adopted = self._adopt(config, holder=holder, environ=environ)
            if adopted is not None:  # a warm group of an earlier session: adopted now, ready when its test begins
                with self._lock:
                    self._idle[adopted.group.id] = adopted
                return True
            if self.handover is not None and self.handover.expects(config.key):
                return False  # another xdist worker hands its group over: adopted when its test asks for it
            for _ in range(2):
                if self._start_ahead(config, holder, environ, lambda: self._prepare(config, environ),
                                     lambda prepared, lease: self._member_envs(config, prepared, lease)):
                    return True
                if not wait_retiring or not self._retiring_now():
                    return False
                self._join_retiring()  # the GPUs it wants may be a group's retired off this thread
            return False

    def ahead_kit(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str],
                  worker_env: Callable[[ModelSpec, dict[str, str]], dict[str, str]]) -> AheadKit:
        """A launch ahead of ``config`` worked out now, on the main thread, for :meth:`launch_ahead_kit` to start from
        another thread: the kind hook is asked now, and ``worker_env`` (``(spec, lease_env) -> env``) must be a plain
        function, not a plugin hook."""
        prepared = self._prepare(config, environ)

        return AheadKit(config, holder, prepared, lambda lease: member_envs(config, prepared, lease, worker_env))

    def launch_ahead_kit(self, kit: AheadKit) -> bool:
        """:meth:`launch_ahead` from any thread, with what the main thread worked out (:meth:`ahead_kit`): nothing of
        the session is asked. Nothing starts while the main thread acquires, gives back or stops a group (its own
        launch comes first, and it starts the launches ahead it was told of meanwhile itself: ``follow``; a group
        given back is in none of the entries while it is set back); a configuration whose group is
        here, launched ahead, handed over, or coming from another xdist worker, one a warm record names (adopting
        is the main thread's), and one whose last test here has run (:meth:`finish`) is left alone. Returns whether
        it started."""
        config = kit.config
        with self._gate:
            if self._stopping or self._at_work or config.key in self._finished or self._has_group(config):
                return False
            if self.handover is not None and self.handover.expects(config.key):
                return False
            if self.warm is not None and self.warm.may_have(config.key):
                return False
            return self._start_ahead(config, kit.holder, kit.prepared.environ, lambda: kit.prepared,
                                     lambda prepared, lease: kit.member_envs(lease))

    def _start_ahead(self, config: WorkerConfig, holder: str, environ: Mapping[str, str],
                     prepare: Callable[[], Prepared],
                     member_envs: Callable[[Prepared, Lease | None], list[dict[str, str]]]) -> bool:
        """Lease free GPUs for ``config`` without waiting and start its group in a thread of its own (under the
        gate); whether it started. No keeper is started for GPUs that are not free."""
        prepared = prepare()
        wanted = self._wanted(config, prepared.counts)
        lease = None
        keeper = None
        requested = time.time()
        if self.leases is not None:
            lease = self._take_spare(config, others=False)
            try:
                if lease is not None:
                    lease.holder = holder
                elif self.leases.others_waiting() or not self._may_lease_now(wanted):
                    lease = None
                else:
                    keeper = self._keeper(fresh=False, environ=environ, ahead=True)
                    lease = self.leases.try_acquire(wanted, config.spec.memory_mib, holder=holder,
                                                    workers=self._keeper_workers(keeper))
            except (SglWorkerError, OSError, ValueError):
                lease = None  # it can never fit, or the inventory cannot be read: the test will say so
            if lease is None:
                if keeper is not None:
                    keeper.close()
                return False
            if keeper is None:  # a lease passed on as it is (Ray's spare)
                keeper = self._keeper(fresh=False, environ=environ, ahead=True)
        times = LeaseTimes.taken_now(requested, lease)
        try:
            envs = member_envs(prepared, lease)
        except BaseException:
            if lease is not None:
                lease.release(wait_timeout=self.release_wait)
            if keeper is not None:
                keeper.close()
            raise
        ahead = Ahead(config)

        def run() -> None:
            try:
                group = self._launch(config, holder=holder, fresh=False, options=self.options, lease=lease,
                                     prepared=prepared, envs=envs, quiet=True, cancel=ahead.cancel, keeper=keeper,
                                     lease_times=times)
            except BaseException as exc:  # handed to the test that needs it
                ahead.error = exc
                return
            with self._lock:
                entry = self._busy.pop(group.id)
                entry.launched_ahead = True
                self._idle[group.id] = entry

        ahead.thread = threading.Thread(target=run, name=f"sglworker-ahead-{config.key}", daemon=True)
        with self._lock:
            self._ahead[config] = ahead
        ahead.thread.start()
        return True

    def _may_lease_now(self, wanted: Any) -> bool:
        """Whether enough GPUs look free for a lease this moment (a lease manager that can tell cheaply: the lock
        directory's); a launch ahead that cannot have one starts no keeper to find out."""
        free_now = getattr(self.leases, "free_now", None)
        if free_now is None or isinstance(wanted, list):
            return True
        try:
            return bool(free_now(wanted))
        except Exception:  # the inventory cannot be read: the attempt says why
            return True
