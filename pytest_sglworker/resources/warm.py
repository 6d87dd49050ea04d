"""Warm workers between runs (``--sgl-keep-warm``): who holds a warm group's locks and processes when, the claim
that makes its use exclusive, the hand-over of lock files to another process, the lease an adopter borrows, and
how a warm group ends.

Plain Python, no pytest; ``psutil`` is imported lazily. The record is :mod:`.warm_records`, the
keeper process :mod:`.warm_keeper`; what identifies a group's configuration and how a session adopts one is
:mod:`pytest_sglworker.workers.warm`.

Who holds what, when
--------------------
A group's GPU lease and port blocks are ``flock`` s of lock files (:mod:`.gpus`, :mod:`.ports`); the kernel drops a
flock when the last descriptor of its *open file* closes, whichever process holds it. Processes are the plugin's
when they carry its owner tag (:mod:`.processes`), whose session id names the process that answers for them: the
session watchdog ends a dead session's, and every janitor takes the tagged processes of a dead session for orphans.

1. **Launch** (a session with ``--sgl-keep-warm``, a pooled group): the session starts the group's **keeper**
   first (``python -m pytest_sglworker.resources.warm_keeper``, :class:`~.warm_keeper.KeeperHandle`), then leases
   the GPUs (their holder records name the keeper's session among their workers) and starts the members with
   owner tags of the *keeper's* session id. The keeper waits on a socket whose other end only the session holds.
   The session holds the flocks, as for any group.
2. **Session ends, group kept warm** (idle, every member answers its readiness check): the session writes the
   group's warm record (state ``handover``) and sends the keeper duplicates of its lock descriptors over that socket
   (``SCM_RIGHTS``, :func:`dup_lock_fd`): the same open files, so the keeper holds the same flocks, and there is no
   moment at which the GPUs or ports are unlocked. The keeper rewrites the GPUs' holder records under its own pid
   and writes itself into the record (state ``warm``); only on its ``ok`` does the session forget its own
   descriptors (:func:`forget_lock`: closed without unlocking). Without an ``ok`` the group is torn down as any other.
3. **Session ends otherwise, or dies** (SIGKILL included): the socket reaches end of file; the keeper ends whatever
   its session id tags and exits. A retired group's keeper goes the same way, with nothing left to end.
4. **Warm**: the keeper alone holds the flocks (and a shared flock on the session log directory's ``.lock``, so
   log retention keeps the group's log), and ends the group at its TTL, when a member dies, when another process
   waits for a GPU or a port, when its record disappears (a wiped lock directory), or on SIGTERM. Since the
   members' tags name the keeper's session, every janitor (of any version) leaves them alone while the keeper
   lives, and reaps them as orphans once it is gone; the holder records name the keeper, with its session among
   their workers, so a GPU whose keeper died is not handed out while the group still runs.
5. **Adopted**: a session that wants the group takes its **claim**, the flock of ``warm-<id>.lock``
   (:class:`Claim`): whoever holds it is the only one that may adopt, end or re-warm the group, so two sessions
   never share one. The claim's lock file must be this user's: another user's file at its path (planted where
   the sticky directory lets anybody create one) is no claim anybody of this user can hold (:func:`claim_blocked`),
   so the record's keeper, the janitor or ``--sgl-warm stop`` ends the group without one, and says why; it is
   never read as "held by another session". The adopter writes itself into the record (state ``adopted``). The
   keeper keeps the flocks all along (the session's lease is a :class:`BorrowedLease`): a session that dies while
   it uses the group cannot leave them locked, since the keeper sees its adopter gone and ends the group. At the
   adopter's end the group is kept warm again (state ``warm``, a new expiry, the claim released) or ended
   (:func:`end_warm`: its members, then its keeper, which unlocks as it exits).

Records are written atomically (:func:`~.state.atomic_write`), read without trusting the lock directory (a
symlink, a FIFO, an oversized or malformed file is *untrusted*: ignored, and removed by the janitor when no
claim is held), and every pid they name is acted on only after :func:`~.processes.prove_process` proved it
(pid, start time, owner tag or keeper marker). The janitor (:func:`reap_warm`) ends the groups whose keeper is
gone or failed to end them at their TTL; ``pytest --sgl-warm list|stop`` shows and ends them
(:func:`~.warm_records.warm_records`, :func:`stop_warm`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .lockfiles import LockFile
from .owned_files import append_owned, entry_problem, remove_own_entry, unlink_owned
from .processes import AdoptedProcess, find_tagged_processes, hostname, process_alive, prove_process, terminate_tree
from .retention import keeps
from .shown import shown
from .signals import signals_deferred
from .warm_records import (
    KEEPER_GRACE,
    WarmEntry,
    WarmRecord,
    adopter_alive,
    claim_path,
    keeper_alive,
    read_warm_record,
    record_id,
    record_path,
    run_alive,
    warm_records,
    write_warm_record,
)

if TYPE_CHECKING:
    from .gpus.inventory import GpuInfo
    from .gpus.release import ReleaseReport

__all__ = [
    "BorrowedLease",
    "Claim",
    "StopResult",
    "claim_blocked",
    "dup_lock_fd",
    "end_keeper",
    "end_members",
    "end_warm",
    "forget_lock",
    "members_alive",
    "note_in_logs",
    "reap_warm",
    "remove_holder_records",
    "remove_logs",
    "stop_warm",
]

# ---------------------------------------------------------------------------------------------- hand-over


def dup_lock_fd(lock: LockFile) -> int:
    """A new descriptor of the open file whose flock ``lock`` holds (the same open file, so the same flock), for a
    keeper to inherit. ``OSError`` when ``lock`` is not held."""
    if lock.fd is None:
        raise OSError(f"{lock.lock_file} is not locked by this process")
    return os.dup(lock.fd)


def forget_lock(lock: LockFile) -> None:
    """Drop this process's hold of ``lock`` *without unlocking it*: another process holds the same open file now
    (:func:`dup_lock_fd`, its duplicate closed here since)."""
    lock.forget()


# ---------------------------------------------------------------------------------------------- claims


class Claim:
    """This process's exclusive hold on one warm group: the flock of ``warm-<id>.lock``. Only its holder adopts
    the group, ends it, or keeps it warm again; the record is read again once it is held."""

    def __init__(self, lock_dir: Path, wid: str, lock: LockFile | None) -> None:
        self.lock_dir = Path(lock_dir)
        self.id = wid
        self._lock: LockFile | None = lock

    @classmethod
    def take(cls, lock_dir: Path, wid: str, *, wait: float = 0.0) -> Claim | None:
        """The claim, or None when another process holds it (still after ``wait`` seconds) or nobody of this user
        can hold it (:func:`claim_blocked` says why: then there is no use waiting)."""
        lock = LockFile(claim_path(lock_dir, wid), mode=0o600, own_only=True)
        try:
            if not lock.acquire(timeout=wait):
                return None
        except OSError:
            return None  # another user's file, a directory or a symlink in the way: nobody of ours may claim it
        return cls(lock_dir, wid, lock)

    @classmethod
    def unclaimable(cls, lock_dir: Path, wid: str) -> Claim:
        """A stand-in for the claim of a group whose claim nobody of this user can hold (:func:`claim_blocked`):
        what :func:`end_warm` needs to end it; it holds no lock."""
        return cls(lock_dir, wid, None)

    @property
    def held(self) -> bool:
        return self._lock is not None

    def read(self) -> WarmRecord | None:
        """The group's record, if it is trusted and this user's."""
        return read_warm_record(record_path(self.lock_dir, self.id)).mine

    def write(self, record: WarmRecord) -> None:
        write_warm_record(self.lock_dir, record)

    def remove(self) -> None:
        """Remove the record and the claim's own lock file (while it is held: a process that opened the old file
        and flocks it after this finds no record, and gives up)."""
        for path in (record_path(self.lock_dir, self.id), claim_path(self.lock_dir, self.id)):
            remove_own_entry(path)

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


def claim_blocked(lock_dir: Path, wid: str) -> str | None:
    """Why nobody of this user can hold the claim of warm group ``wid`` (another user's file, a directory or a
    symlink where its lock file goes), or None when it can be held (it may be held right now). A group whose claim
    is blocked has no adopter and no other ender of this user: its record's holder ends it without the claim, and
    says why."""
    path = claim_path(lock_dir, wid)
    why = entry_problem(path)
    if why is None or why == "is gone":
        return None
    return f"its claim file {path.name} {why.replace(': left alone', '')}, so no session of yours can claim it"


# ---------------------------------------------------------------------------------------------- ending


def note_in_logs(record: WarmRecord, text: str) -> None:
    """Append one line to each member's log (the reason its warm life ended, or who adopted it): the log is the
    first place a person looks. Only to the file its session created (:mod:`.owned_files`), never to whatever the
    record's path names now."""
    line = f"[pytest-sglworker {time.strftime('%H:%M:%S')}] {text}\n".encode()
    for member in record.members:
        append_owned(member.log, member.log_id, line)


def end_members(record: WarmRecord, *, timeout: float = 10.0) -> list[int]:
    """End every member's process tree: the root first when it is provably the process the record names, then
    everything that carries the member's owner tag and the members of its session. Returns the pids that needed
    SIGKILL."""
    killed: list[int] = []
    for member in record.members:
        proven = prove_process(member.pid, member.since, member.tag) is None
        handle = AdoptedProcess(member.pid, member.since, tag=member.tag) if proven else None
        killed += terminate_tree(handle, lambda tag=member.tag: find_tagged_processes(tag),  # type: ignore[misc]
                                 term_timeout=timeout, kill_timeout=timeout)
    return killed


def members_alive(record: WarmRecord) -> bool:
    return all(AdoptedProcess(m.pid, m.since).poll() is None for m in record.members)


def end_keeper(record: WarmRecord, *, timeout: float = 5.0) -> None:
    """Ask the record's keeper to end (SIGCONT, then SIGTERM), SIGKILL it after ``timeout``; only when it is
    provably that keeper."""
    keeper = record.keeper
    if keeper is None or not keeper_alive(record):
        return
    handle = AdoptedProcess(keeper.pid, keeper.since)
    handle.send_signal(signal.SIGCONT)
    handle.send_signal(signal.SIGTERM)
    with contextlib.suppress(Exception):
        handle.wait(timeout)
        return
    handle.kill()
    with contextlib.suppress(Exception):
        handle.wait(timeout)


def remove_holder_records(lock_dir: Path, record: WarmRecord) -> None:
    """Remove the GPU holder records that describe this group (its keeper's, or naming its owner tags)."""
    from .gpus.holders import holder_record_path, read_holder_record

    keeper_pid = record.keeper.pid if record.keeper else None
    for index in record.gpus:
        path = holder_record_path(Path(lock_dir), record.namespace, index)
        holder = read_holder_record(path, only_live=False)
        if holder is not None and (holder.pid == keeper_pid or set(holder.workers) & {*record.tags, f"{record.id}:"}):
            remove_own_entry(path)


def remove_logs(record: WarmRecord, *, spare: Collection[str] = ()) -> None:
    """The group's logs go when the policy it was kept under says so (``failed``: only a tainted group's stay);
    ``spare``: paths whose fate another policy decides (the log links of the session that retires it)."""
    if keeps(record.log_policy, failed=record.tainted):
        return
    for member in record.members:
        for path in (member.log, *member.links):
            if path not in spare:
                unlink_owned(path, member.log_id)


def end_warm(claim: Claim, record: WarmRecord, why: str, *, note: bool = True,
             spare_logs: Collection[str] = ()) -> None:
    """End a warm group its claim's holder decided to end: the reason into its logs, the record marked
    ``stop`` (its keeper does nothing else from then on), its processes, then its keeper (which unlocks the
    GPUs and ports as it exits), its holder records, its logs (per its policy), its record and claim. An interrupt
    (Ctrl-C, SIGTERM) that arrives meanwhile takes effect once all of that is done (bounded: every wait has its
    timeout): a group left half-ended would be a worker no record names any more."""
    with signals_deferred():
        if note:
            note_in_logs(record, f"warm worker ended: {why}")
        with contextlib.suppress(OSError):
            claim.write(replace(record, state="stop"))
        try:
            end_members(record)
        finally:
            end_keeper(record)
            remove_holder_records(claim.lock_dir, record)
            remove_logs(record, spare=spare_logs)
            claim.remove()
            claim.release()


def _when(stamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(stamp))


def _remove_untrusted(lock_dir: Path, entry: WarmEntry) -> str | None:
    """Remove an untrusted warm record of this user (and its claim's lock file, a dangling symlink included) while
    nobody holds its claim. None when removed, else why it stays (in words a person can act on)."""
    wid = record_id(entry.path)
    if wid is None:
        return "its name is no warm record's"
    why = entry_problem(entry.path)
    if why is not None:
        return None if why == "is gone" else why
    lock = claim_path(lock_dir, wid)
    if os.path.islink(lock):  # a symlink where the claim's lock file goes: nobody could ever claim the record
        why = remove_own_entry(lock)
        if why is not None:
            return f"{lock.name} is a symlink that {why}"
    claim = Claim.take(lock_dir, wid)
    if claim is None:
        if claim_blocked(lock_dir, wid) is None:
            return f"its claim {lock.name} is held by another process"
        claim = Claim.unclaimable(lock_dir, wid)  # nobody of ours can hold it: nobody of ours uses the record
    try:
        if read_warm_record(entry.path).record is not None:
            return "it was rewritten meanwhile"
        why = remove_own_entry(entry.path)
        if why is None:
            remove_own_entry(lock)
        return why
    finally:
        claim.release()


def reap_warm(lock_dir: Path | None) -> list[str]:
    """The janitor's part: end the warm groups whose keeper is gone, or that outlived their TTL by more than
    :data:`KEEPER_GRACE` (a keeper that is frozen or stuck), and remove untrusted records nobody claims. Only this
    user's records are acted on: another user's is never a reason to touch a file or a process. Returns what it
    did, one phrase per group."""
    done: list[str] = []
    if lock_dir is None:
        return done
    now = time.time()
    for entry in warm_records(lock_dir):
        if not entry.ours and not _ours_by_lstat(entry.path):
            continue
        record = entry.record
        if record is None:
            if _remove_untrusted(lock_dir, entry) is None:
                done.append(f"an untrusted warm record {shown(entry.path.name)} ({shown(entry.problem or '')})")
            continue
        if record.hostname != hostname():
            continue
        if record.state == "handover" and process_alive(record.kept_by.pid, record.kept_by.since, record.hostname):
            continue  # its session is handing it over right now
        alive = keeper_alive(record)
        run_gone = record.state == "warm" and not run_alive(record)
        if alive and not run_gone and not (record.state == "warm" and now > record.expires_at + KEEPER_GRACE):
            continue
        claim = Claim.take(lock_dir, record.id)
        blocked = claim_blocked(lock_dir, record.id) if claim is None else None
        if claim is None and blocked is None:
            continue  # a live adopter, or someone ending it right now
        if claim is None:
            claim = Claim.unclaimable(lock_dir, record.id)
        current = claim.read()
        if current is None or current != record:
            claim.release()
            continue
        keeper = record.keeper.pid if record.keeper else "?"
        why = ("its keeper is gone" if not alive else
               f"the run that published it (pid {record.run.pid}) ended" if run_gone and record.run else
               f"it expired at {_when(record.expires_at)} and its keeper (pid {keeper}) did not end it")
        if blocked is not None:
            why += f" ({blocked}: ended without it)"
        end_warm(claim, record, why)
        done.append(f"{record.label} ({why})")
    return done


def end_run(lock_dir: Path | None, run: str) -> list[str]:
    """At the end of run ``run`` (its xdist controller): end the groups handed over within it that nobody holds now
    (a group a session of the run still holds is left to it, and to its keeper). Returns their labels."""
    done: list[str] = []
    here = hostname()
    for entry in warm_records(lock_dir) if lock_dir is not None else []:
        record = entry.mine
        if record is None or record.run is None or record.run.session != run or record.hostname != here:
            continue
        claim = Claim.take(lock_dir, record.id, wait=1.0)  # type: ignore[arg-type]
        if claim is None:
            continue
        current = claim.read()
        if current is None or current.run is None or current.run.session != run:
            claim.release()
            continue
        end_warm(claim, current, "the run it was handed over in ended")
        done.append(current.label)
    return done


def _ours_by_lstat(path: Path) -> bool:
    """Whether the entry at ``path`` (not followed) belongs to this user: what a record that could not be opened
    (a symlink, a directory) is judged by."""
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


@dataclass
class StopResult:
    """What ``pytest --sgl-warm stop`` did, one line per group or record."""

    ended: list[str] = field(default_factory=list)
    #: why each stays and, where a person can do something, what
    left: list[str] = field(default_factory=list)
    #: entries of other users: theirs, left alone
    others: list[str] = field(default_factory=list)
    #: untrusted records of this user, removed
    removed: list[str] = field(default_factory=list)
    #: the signal that interrupted it (the groups after the one it was ending were left as they were)
    interrupted: int | None = None


def stop_warm(lock_dir: Path) -> StopResult:
    """``pytest --sgl-warm stop``: end every warm group of this user that no session uses right now, and remove the
    untrusted records of this user it can. An interrupt (Ctrl-C, SIGTERM) lets the group being ended end whole,
    then stops."""
    result = StopResult()
    with signals_deferred(reraise=False) as received:
        for entry in warm_records(lock_dir):
            if received:
                result.interrupted = received[0]
                break
            _stop_one(lock_dir, entry, result)
        if received and result.interrupted is None:
            result.interrupted = received[0]
    return result


def _stop_one(lock_dir: Path, entry: WarmEntry, result: StopResult) -> None:
    record = entry.record
    if not entry.ours and not _ours_by_lstat(entry.path):
        owner = entry.owner if entry.owner is not None else _owner(entry.path)
        result.others.append(f"{shown(entry.path.name)}: belongs to uid {owner} (another user): left alone")
        return
    if record is None:
        why = _remove_untrusted(lock_dir, entry)
        if why is None:
            result.removed.append(f"{shown(entry.path.name)}: untrusted ({shown(entry.problem or '')})")
        else:
            result.left.append(f"{shown(entry.path.name)}: untrusted ({shown(entry.problem or '')}) and not removed: "
                               f"{shown(why)}")
        return
    if record.hostname != hostname():
        return
    claim = Claim.take(lock_dir, record.id, wait=1.0)
    blocked = claim_blocked(lock_dir, record.id) if claim is None else None
    if blocked is not None and not (record.state == "adopted" and adopter_alive(record)):
        claim = Claim.unclaimable(lock_dir, record.id)
    current = claim.read() if claim is not None else None
    if claim is None or current is None:
        if claim is not None:
            claim.release()
            return  # ended meanwhile
        who = record.adopter
        user = f"pytest pid {who.pid} ({who.holder})" if who else "another session"
        result.left.append(f"{record.label}: in use by {user}; that session ends it or keeps it warm when it ends")
        return
    end_warm(claim, current, "stopped by pytest --sgl-warm stop" + (
        f" ({blocked}: ended without it)" if blocked is not None else ""))
    result.ended.append(current.describe() + (f" ({blocked}: ended without it)" if blocked is not None else ""))


def _owner(path: Path) -> int | str:
    try:
        return os.lstat(path).st_uid
    except OSError:
        return "?"


# ---------------------------------------------------------------------------------------------- borrowed lease


@dataclass
class BorrowedLease:
    """The lease of an adopted warm group: its GPU (and port) flocks stay with the group's keeper while the
    session uses the group, so a session that dies cannot leave them locked; the session holds the group's
    :class:`Claim`. Shaped like :class:`~.gpus.Lease` where the pool reads one; :meth:`release` ends the group
    and its keeper (which unlocks as it exits), :meth:`keep_warm` hands it back warm."""

    claim: Claim
    record: WarmRecord
    gpus: tuple[GpuInfo, ...]
    cuda_visible_devices: str
    holder: str
    acquired_at: float = field(default_factory=time.time)
    #: this session's links of the members' logs: its own log policy decides about them
    own_logs: tuple[str, ...] = ()
    _report: ReleaseReport | None = field(default=None, repr=False)

    @property
    def namespace(self) -> str:
        return self.record.namespace

    @property
    def memory_mib(self) -> int:
        return self.record.memory_mib

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    @property
    def released(self) -> bool:
        return self._report is not None

    @property
    def report(self) -> ReleaseReport | None:
        return self._report

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def release(self, *, worker_pids: Collection[int] = (), wait_timeout: float = 60.0) -> ReleaseReport:
        """End what is left of the group and its keeper; the keeper's exit unlocks the GPUs and ports. Idempotent."""
        from .gpus.release import ReleaseReport

        if self._report is None:
            start = time.monotonic()
            end_warm(self.claim, self.record, f"retired by the session that adopted it (pid {os.getpid()})",
                     spare_logs=self.own_logs)
            self._report = ReleaseReport(gpus=self.indices, source="warm keeper", memory_back=True,
                                         waited_s=time.monotonic() - start)
        return self._report

    def keep_warm(self, record: WarmRecord) -> None:
        """Hand the group back warm (``record``: state ``warm``, its new expiry), then release the claim."""
        from .gpus.release import ReleaseReport

        try:
            self.claim.write(record)
        finally:
            self.claim.release()
        self.record = record
        self._report = ReleaseReport(gpus=self.indices, source="kept warm", memory_back=True, waited_s=0.0)
