"""GPU leases: :class:`LeaseManager` hands out exclusive use of GPUs of an inventory (:meth:`LeaseManager.acquire`,
:meth:`LeaseManager.try_acquire`), coordinated through lock files and holder records in a lock directory
(:mod:`.holders`); a :class:`Lease` holds them until :meth:`Lease.release`, which first waits for their memory
to come back (:mod:`.release`).

Candidate groups come best first (runs of consecutive indices, aligned runs first); a GPU is free when its
lock can be taken, its free memory (re-read after locking) suffices, and no worker of a dead holder still
runs on it. A process that waits for a lease flags itself in the lock directory
(:mod:`pytest_sglworker.resources.waiters`), so that holders of idle pooled workers let go. Plain Python, no
pytest.

In a lock directory several users share, every user's session takes and releases every GPU lock, whoever created
its file (:mod:`..lockfiles`). Another user's holder record is only ever read as "busy": a GPU whose lock is free
but whose record belongs to another user (a holder of theirs that died, whose own janitor removes it) is skipped,
never cleared; a lock file this user cannot open skips that GPU, never the whole session.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from ...errors import LeaseImpossible, LeaseTimeout
from ..lockfiles import LockFile
from ..owned_files import entry_problem, remove_own_entry
from ..processes import hostname
from ..shown import shown
from ..waiters import flag_waiting, lease_waiting_prefix, live_waiters, others_waiting_for_ports, unflag_waiting
from .holders import (
    NAMESPACE_RE,
    HolderRecord,
    HolderRecordWarning,
    dead_holder_leftovers,
    gpu_lock_path,
    holder_record_path,
    inspect_holder_record,
    lock_is_held,
    read_holder_record,
    remove_dead_temporaries,
    unlocked_count,
    write_holder_record,
)
from .inventory import GpuInfo, Inventory, join_indices
from .release import ReleaseReport, wait_for_release

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Lease", "LeaseManager"]

#: Leases not yet released. The strong reference keeps a forgotten lease held until the process exits
#: (then the kernel drops the locks) instead of letting garbage collection unlock GPUs a worker may use.
_HELD_LEASES: set[Lease] = set()
#: guards _HELD_LEASES (a launch ahead releases the lease of a launch it gave up on from its own thread)
_HELD_LOCK = threading.Lock()


class Lease:
    """Exclusive use of some GPUs, held until :meth:`release` (also a context manager)."""

    def __init__(
        self,
        manager: LeaseManager,
        gpus: tuple[GpuInfo, ...],
        locks: list[LockFile],
        *,
        holder: str,
        memory_mib: int,
    ) -> None:
        self._manager = manager
        self.gpus = gpus
        self._locks = locks
        self.holder = holder
        self.memory_mib = memory_mib
        self.namespace = manager.namespace
        self.acquired_at = time.time()
        self.cuda_visible_devices = manager.inventory.visible_devices_value(gpus)
        self._free_before = {g.index: g.free_mib for g in gpus}
        self._release_lock = threading.Lock()
        self._report: ReleaseReport | None = None
        self._unlocked = False
        with _HELD_LOCK:
            _HELD_LEASES.add(self)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    @property
    def released(self) -> bool:
        return self._unlocked

    @property
    def report(self) -> ReleaseReport | None:
        """The report of the release, once released."""
        return self._report

    def env(self) -> dict[str, str]:
        """Environment entries that give a worker exactly these GPUs."""
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def release(self, *, worker_pids: Collection[int] = (), wait_timeout: float = 60.0) -> ReleaseReport:
        """Wait (bounded) for the GPUs to come back, then unlock them. Idempotent.

        With NVML: polls until none of ``worker_pids`` is listed on the leased GPUs and each GPU's free
        memory is back to what it was at acquisition (minus the manager's tolerance), or until
        ``wait_timeout``; the locks are released either way and the report says what was seen.
        """
        with self._release_lock:
            if self._report is not None:
                return self._report
            if self._unlocked:  # an earlier release() was interrupted after unlocking
                return ReleaseReport(
                    gpus=self.indices,
                    source=self._manager.inventory.source,
                    memory_back=False,
                    waited_s=0.0,
                    error="an earlier release was interrupted before the memory check finished",
                )
            try:
                report = wait_for_release(self._manager, self.indices, self._free_before, worker_pids, wait_timeout)
            finally:
                # Unlocked even when the wait is interrupted (Ctrl-C): the lease never outlives release().
                self._unlock()
                self._unlocked = True
                with _HELD_LOCK:
                    _HELD_LEASES.discard(self)
            self._report = report
            return report

    def held_locks(self) -> list[LockFile]:
        """The locks this lease holds (for a hand-over to another process, ``--sgl-keep-warm``: see
        :meth:`handed_over`)."""
        return list(self._locks)

    def handed_over(self) -> None:
        """Say that another process holds this lease's locked files now (a warm group's keeper inherited them)
        and that the caller has forgotten its own copies (:func:`pytest_sglworker.resources.warm.forget_lock`):
        the lease counts as released from now on, without unlocking anything and without touching the holder
        records (the new holder rewrote them)."""
        with self._release_lock:
            self._locks = []
            self._unlocked = True
            self._report = ReleaseReport(gpus=self.indices, source="handed over", memory_back=True, waited_s=0.0)
            with _HELD_LOCK:
                _HELD_LEASES.discard(self)

    def _unlock(self) -> None:
        manager = self._manager
        for index in self.indices:
            path = holder_record_path(manager.lock_dir, manager.namespace, index)
            record = read_holder_record(path, only_live=False)
            if record is not None and record.pid == os.getpid():
                remove_own_entry(path)  # another user's record naming our pid is theirs
        _let_go(self._locks)
        self._locks = []

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.namespace} GPUs {join_indices(self.indices)} for {self.holder!r} ({state})>"


@dataclass
class _Attempt:
    """Why one allocation attempt failed: for the wait and timeout messages."""

    gpus: list[GpuInfo]
    locked: set[int] = field(default_factory=set)
    low: set[int] = field(default_factory=set)
    #: GPU index -> (dead holder pid, pids of the workers it left running there)
    orphans: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    #: GPU index -> why this user cannot take it although nobody holds its lock (another user's lock file it may
    #: not open, another user's holder record left beside a free lock)
    foreign: dict[int, str] = field(default_factory=dict)


class LeaseManager:
    """Hands out exclusive GPU leases from ``inventory``, coordinated through lock files in ``lock_dir``.

    ``namespace`` keeps lock files of different inventories apart (``nvml``, ``sim-4x80``). ``clock``
    and ``sleep`` drive polling (monotonic seconds); tests pass fakes.
    """

    def __init__(
        self,
        lock_dir: Path,
        inventory: Inventory,
        *,
        namespace: str,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        notice_interval: float = 30.0,
        release_tolerance_mib: int = 256,
        release_poll_interval: float = 0.5,
        on_message: Callable[[str], None] | None = None,
    ) -> None:
        if not NAMESPACE_RE.match(namespace):
            raise ValueError(f"lease namespace {namespace!r} may only hold letters, digits, '.', '_' and '-'")
        self.lock_dir = Path(lock_dir)
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        self.inventory = inventory
        self.namespace = namespace
        self.clock = clock
        self.sleep = sleep
        self.notice_interval = notice_interval
        self.release_tolerance_mib = release_tolerance_mib
        self.release_poll_interval = release_poll_interval
        self.on_message = on_message
        #: what :meth:`sweep_untrusted_records` said, for callers that show messages their own way
        self.notices: list[str] = []
        self._reported_untrusted: set[tuple[str, str]] = set()
        inventory.bind_leases(self.lock_dir, namespace)
        self.sweep_untrusted_records()

    def lock_path(self, index: int) -> Path:
        return gpu_lock_path(self.lock_dir, self.namespace, index)

    def record_path(self, index: int) -> Path:
        return holder_record_path(self.lock_dir, self.namespace, index)

    def can_ever_fit(self, tp: int, memory_mib: int) -> str | None:
        """Reason why such a lease can never be granted by this inventory, or ``None``."""
        return self.inventory.can_ever_fit(tp, memory_mib)

    def holders(self) -> dict[int, HolderRecord]:
        """Live holder records of locked GPUs, by GPU index."""
        result = {}
        for gpu in self.inventory.static_gpus():
            record = read_holder_record(self.record_path(gpu.index))
            if record is not None and lock_is_held(self.lock_path(gpu.index)):
                result[gpu.index] = record
        return result

    # -- untrusted records

    def _notify(self, text: str) -> None:
        self.notices.append(text)
        if self.on_message is not None:
            self.on_message(text)
            return
        import warnings

        with contextlib.suppress(HolderRecordWarning):  # -W error must not turn a cleanup into a crash
            warnings.warn(text, HolderRecordWarning, stacklevel=4)  # the LeaseManager(...) call

    def sweep_untrusted_records(self) -> list[str]:
        """Ignore every GPU holder record of the lock directory that cannot be trusted, remove those whose
        lock is free (under that lock), and say so in one message (``on_message``, else a
        :class:`HolderRecordWarning`). Also removes temporary files that dead writers left. Returns the
        names of the records removed. Called when the manager is made; never raises for what it finds."""
        found: list[str] = []
        removed: list[str] = []
        try:
            paths = sorted(self.lock_dir.glob("gpu-*.json"))
        except OSError:
            return removed
        for path in paths:
            _, problem = inspect_holder_record(path)
            if problem is None:
                continue
            outcome = "kept: its lock is held"
            owner = _owner(path)
            if owner is not None and owner != os.getuid():
                outcome = f"kept: it belongs to uid {owner} (another user), whose sessions remove it"
            else:
                lock = LockFile(path.with_suffix(".lock"))
                try:
                    locked = lock.acquire()
                except OSError as exc:
                    from ..state import describe_file_problem

                    locked = False
                    outcome = f"kept: its lock file {describe_file_problem(lock.lock_file, exc)}"
                if locked:
                    try:
                        _, problem_now = inspect_holder_record(path)
                        if problem_now is not None:
                            why = remove_own_entry(path)
                            if why is None:
                                outcome = "removed"
                                removed.append(path.name)
                            elif why.startswith("is a directory"):
                                outcome = "kept: a directory is never removed"
                            else:
                                outcome = f"kept: it {why}"
                        else:
                            outcome = "rewritten meanwhile"
                    finally:
                        lock.release()
            key = (path.name, problem)
            if key not in self._reported_untrusted:
                self._reported_untrusted.add(key)
                found.append(f"{shown(path.name)} ({problem}; {outcome})")
        remove_dead_temporaries(self.lock_dir)
        if found:
            self._notify(f"ignored {len(found)} untrusted GPU holder record(s) in {self.lock_dir}: "
                         + "; ".join(found))
        return removed

    # -- acquisition

    def try_acquire(self, tp: int, memory_mib: int, *, holder: str, workers: Sequence[str] = ()) -> Lease | None:
        """One non-blocking attempt; ``None`` if no fitting GPUs are free now. ``workers``: owner tags (or
        session-wide ``<session>:`` prefixes) of the workers that will run on the GPUs when they are not of this
        process's session (a group that may be kept warm: its keeper's), for the holder records."""
        reason = self.can_ever_fit(tp, memory_mib)
        if reason is not None:
            raise LeaseImpossible(reason)
        lease, _ = self._attempt(tp, memory_mib, holder, workers)
        return lease

    def acquire(
        self,
        tp: int,
        memory_mib: int,
        *,
        holder: str,
        timeout: float,
        poll_interval: float = 0.5,
        on_wait: Callable[[str], None] | None = None,
        workers: Sequence[str] = (),
    ) -> Lease:
        """Lease ``tp`` GPUs with at least ``memory_mib`` MiB free each, waiting up to ``timeout`` s.

        Raises :class:`LeaseImpossible` at once if the request can never be met (:meth:`can_ever_fit`), and
        :class:`LeaseTimeout` naming the holders and the GPUs short of memory when the time is up.
        ``on_wait`` gets a message when the wait starts and then every ``notice_interval`` seconds.
        """
        reason = self.can_ever_fit(tp, memory_mib)
        if reason is not None:
            raise LeaseImpossible(reason)
        start = self.clock()
        next_notice: float | None = None
        waiting_flag: Path | None = None
        try:
            while True:
                lease, attempt = self._attempt(tp, memory_mib, holder, workers)
                if lease is not None:
                    return lease
                if waiting_flag is None:
                    waiting_flag = flag_waiting(self.lock_dir, lease_waiting_prefix(self.namespace))
                now = self.clock()
                waited = now - start
                if waited >= timeout:
                    raise LeaseTimeout(
                        f"no lease of {tp} GPU(s) with {memory_mib} MiB free each for {holder!r} within "
                        f"{timeout:g} s ({self.inventory.describe()}, locks in {self.lock_dir}): "
                        + self._explain(attempt, memory_mib)
                    )
                if on_wait is not None and (next_notice is None or now >= next_notice):
                    on_wait(
                        f"waiting for {tp} GPU(s) with {memory_mib} MiB free each for {holder!r} "
                        f"({waited:.0f} s of {timeout:g} s): " + self._explain(attempt, memory_mib)
                    )
                    next_notice = now + self.notice_interval
                self.sleep(max(min(poll_interval, timeout - waited), 0.0))
        finally:
            unflag_waiting(waiting_flag)

    # -- waiters: a process that waits for a lease says so (resources.waiters), so that holders of idle pooled
    # workers let go

    def free_now(self, tp: int) -> bool:
        """Whether ``tp`` GPUs have their locks free this moment: a cheap probe, never a promise (any thread)."""
        return unlocked_count(self.lock_dir, self.namespace, [g.index for g in self.inventory.static_gpus()], tp) >= tp

    def others_waiting(self) -> bool:
        """Whether another live process of this machine waits for a lease of this inventory: a pool then
        retires its idle workers instead of keeping their GPUs."""
        return (live_waiters(self.lock_dir, lease_waiting_prefix(self.namespace))
                or others_waiting_for_ports(self.lock_dir))

    def _attempt(self, tp: int, memory_mib: int, holder: str,
                 workers: Sequence[str] = ()) -> tuple[Lease | None, _Attempt]:
        gpus = self.inventory.snapshot()
        attempt = _Attempt(gpus=gpus)
        eligible = [g.index for g in gpus if g.free_mib >= memory_mib]
        attempt.low = {g.index for g in gpus if g.free_mib < memory_mib}
        for group in _candidate_groups(eligible, tp, attempt):
            locks = self._lock_group(group, attempt)
            if locks is None:
                continue
            orphans = dead_holder_leftovers(self.lock_dir, self.namespace, group)
            if orphans:  # the GPU is unlocked but its dead holder's engine still runs there: not free yet
                attempt.orphans.update(orphans)
                attempt.locked.update(orphans)
                _let_go(locks)
                continue
            # We hold the locks now, so any record still there is stale (a live process that left it behind,
            # a planted one): one of this user's must not make the GPU look used, and our own record replaces it
            # below. Another user's is theirs (their holder died; their watchdog or janitor removes it): the GPU
            # stays busy for us until then, and the record is never touched.
            foreign = self._foreign_records(group)
            if foreign:
                attempt.foreign.update(foreign)
                attempt.locked.update(foreign)
                _let_go(locks)
                continue
            for index in group:
                path = self.record_path(index)
                if os.path.lexists(path) and not path.is_dir():
                    remove_own_entry(path)
            # Re-read after locking: someone may have started on a GPU between the reading and the lock.
            try:
                fresh = {g.index: g for g in self.inventory.snapshot()}
            except BaseException:
                _let_go(locks)
                raise
            short = [i for i in group if i not in fresh or fresh[i].free_mib < memory_mib]
            if short:
                attempt.low.update(short)
                _let_go(locks)
                continue
            chosen = tuple(fresh[i] for i in group)
            try:
                self._write_records(chosen, holder, memory_mib, workers)
            except BaseException:
                for index in group:
                    remove_own_entry(self.record_path(index))
                _let_go(locks)
                raise
            return Lease(self, chosen, locks, holder=holder, memory_mib=memory_mib), attempt
        return None, attempt

    def _foreign_records(self, group: Sequence[int]) -> dict[int, str]:
        """The GPUs of ``group`` whose holder record belongs to another user, with why that makes them busy."""
        found = {}
        for index in group:
            why = entry_problem(self.record_path(index))
            if why is not None and why.startswith("belongs to uid"):
                owner = _owner(self.record_path(index))
                found[index] = (f"its holder record {self.record_path(index).name} belongs to uid {owner} (another "
                                "user) although its lock is free: a holder of theirs that died; their session's "
                                "watchdog or next janitor removes it")
        return found

    def _lock_group(self, group: Sequence[int], attempt: _Attempt) -> list[LockFile] | None:
        locks: list[LockFile] = []
        for index in group:
            lock = LockFile(self.lock_path(index))  # 0644 whatever the umask: every user may open it to lock it
            try:
                locked = lock.acquire()
            except OSError as exc:  # a directory, a symlink, a file this user may not open at the lock's path
                _let_go(locks)
                owner = _owner(self.lock_path(index))
                if owner is not None and owner != os.getuid():
                    # another user's entry: that GPU is not for us, the others still are
                    from ..state import describe_file_problem

                    path = self.lock_path(index)
                    attempt.foreign[index] = (
                        f"its lock file {path.name} cannot be opened by you ({describe_file_problem(path, exc)}); a "
                        f"shared lock file must be a regular file every user may read (its owner, uid {owner}, can "
                        f"run 'chmod 644 {path}')")
                    attempt.locked.add(index)
                    return None
                raise self._unusable("GPU lock file", self.lock_path(index), exc) from None
            if not locked:
                attempt.locked.add(index)
                _let_go(locks)
                return None
            locks.append(lock)
        return locks

    def _unusable(self, what: str, path: Path, exc: OSError) -> Exception:
        import errno

        from ..state import UnusableFile, describe_file_problem

        problem = describe_file_problem(path, exc)
        if problem.startswith("is "):  # something in the way
            return UnusableFile(
                f"cannot use the {what} {path}: it {problem}; remove it (the lock directory "
                f"{self.lock_dir} holds only files the plugin makes) or choose another --sgl-lock-dir"
            )
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free some space or choose another --sgl-lock-dir"
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            owner = _owner(path)
            whose = f" (it belongs to uid {owner}; you are uid {os.getuid()})" if owner is not None else ""
            fix = (f"check the permissions of {path}{whose} and of the lock directory {self.lock_dir}, or choose "
                   "another --sgl-lock-dir")
        else:
            fix = "choose another --sgl-lock-dir"
        return UnusableFile(f"cannot write the {what} {path}: {problem}; {fix}")

    def _write_records(self, gpus: Sequence[GpuInfo], holder: str, memory_mib: int,
                       workers: Sequence[str] = ()) -> None:
        now = time.time()
        host = hostname()
        indices = tuple(g.index for g in gpus)
        for gpu in gpus:
            path = self.record_path(gpu.index)
            try:
                write_holder_record(path, HolderRecord(
                    pid=os.getpid(),
                    hostname=host,
                    holder=holder,
                    since=now,
                    uuid=gpu.uuid,
                    memory_mib=memory_mib,
                    index=gpu.index,
                    namespace=self.namespace,
                    gpus=indices,
                    workers=tuple(workers),
                ))
            except OSError as exc:
                raise self._unusable("GPU holder record", path, exc) from None

    def _explain(self, attempt: _Attempt, memory_mib: int) -> str:
        now = time.time()
        parts = []
        for gpu in attempt.gpus:
            record = read_holder_record(self.record_path(gpu.index))
            if record is not None and not lock_is_held(self.lock_path(gpu.index)):
                record = None  # trust the lock, not the record
            label = f"GPU {gpu.index}"
            if record is not None:
                parts.append(f"{label} leased by {record.describe(now)}")
            elif gpu.index in attempt.orphans:
                dead, pids = attempt.orphans[gpu.index]
                parts.append(f"{label} still used by worker process(es) {join_indices(pids)} of pid {dead}, which "
                             "died without releasing its lease (its session watchdog ends them)")
            elif gpu.index in attempt.foreign:
                parts.append(f"{label} not usable by you: {attempt.foreign[gpu.index]}")
            elif gpu.index in attempt.locked:
                parts.append(f"{label} locked (holder record not written yet or unreadable)")
            elif gpu.index in attempt.low:
                procs = f"; processes on it: {join_indices(gpu.pids)}" if gpu.pids else ""
                parts.append(
                    f"{label} skipped: {gpu.free_mib} MiB free of {gpu.total_mib} MiB < {memory_mib} MiB "
                    f"needed{procs}"
                )
            else:
                parts.append(f"{label} free")
        return "; ".join(parts) if parts else "the inventory has no GPU"


def _candidate_groups(eligible: Sequence[int], tp: int, attempt: _Attempt) -> Iterator[list[int]]:
    """Groups of ``tp`` GPUs to try, best first: runs of consecutive indices (aligned runs first), then
    any ``tp`` GPUs not known to be locked, lowest indices first. Skips GPUs found locked meanwhile."""
    ordered = sorted(eligible)
    present = set(ordered)
    if tp > 1:
        runs = [
            list(range(start, start + tp))
            for start in ordered
            if all(start + k in present for k in range(tp))
        ]
        runs.sort(key=lambda run: (run[0] % tp != 0, run[0]))
        for run in runs:
            if not attempt.locked.intersection(run) and not attempt.low.intersection(run):
                yield run
    tried: set[tuple[int, ...]] = set()
    while True:
        free = [i for i in ordered if i not in attempt.locked and i not in attempt.low]
        if len(free) < tp:
            return
        group = free[:tp]
        key = tuple(group)
        if key in tried:
            return
        tried.add(key)
        yield group


def _owner(path: Path) -> int | None:
    """The uid that owns the entry at ``path`` (not followed), or None when there is none."""
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None


def _let_go(locks: Sequence[LockFile]) -> None:
    """Let go of the locks of a group this attempt took and does not keep, at once: an attempt that raises keeps
    its frame (and with it the lock objects, whose finalizer would let go of them) for as long as its traceback
    lives."""
    for lock in locks:
        lock.release()
