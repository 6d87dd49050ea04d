"""A process proven ours, held so that a signal never reaches another process that got its pid.

Plain Python, no pytest, no psutil: ``/proc`` and the kernel's pidfds. :mod:`.processes` signals through these.

A pid names a process only until its parent reaps it; then the kernel may hand the number to any newcomer (pids
wrap at ``/proc/sys/kernel/pid_max``), and a bare ``os.kill(pid, sig)`` or ``os.killpg(pid, sig)`` reaches the
newcomer, whoever's it is. A :class:`ProcessRef` is taken while the process is proven ours: a child this process
started and has not reaped, or a process whose pid, start time and uid match what a record names. It holds

- a **pidfd** (``os.pidfd_open``, Linux 5.3+): the kernel signals, through it, only the process it was opened on
  (``signal.pidfd_send_signal``), and, with ``PIDFD_SIGNAL_PROCESS_GROUP`` (Linux 6.9+), only the process group
  that process led, however its pid is reused;
- where no pidfd exists (an older kernel, a seccomp filter), the process's **start time** (clock ticks since boot,
  ``/proc/<pid>/stat``) and **real uid**, read again immediately before each signal, through one open
  ``/proc/<pid>`` directory (both read from one process).

A process group or session is the leader's pid number. Its number cannot be reused while any process is in it,
nor while the leader is not reaped; a process that is in it now and started before a moment the leader was seen
holding its pid (:attr:`ProcessRef.last_held`) is therefore ours: the group was ours when it joined, and a group
number is only inherited or joined, never taken by an outsider while it is in use (:meth:`ProcessRef.member`).
Without a pidfd for the group, a group is signalled as a whole only while its leader is held
(:meth:`ProcessRef.signal_group`); once the leader is gone, each member is proven and signalled on its own.

Lifetime: a ref's pidfd is closed by :meth:`ProcessRef.close` (the end of a teardown) or when the ref is
collected; a pidfd is close-on-exec, so no child inherits it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
import weakref
from dataclasses import dataclass

__all__ = [
    "PIDFD_SIGNAL_PROCESS_GROUP",
    "Identity",
    "ProcessRef",
    "boot_clock",
    "identity",
    "open_pidfd",
    "started_before",
]

#: ``pidfd_send_signal``'s flag (Linux 6.9): the signal goes to the process group the pidfd's process leads.
PIDFD_SIGNAL_PROCESS_GROUP = 4
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Identity:
    """What ``/proc/<pid>`` says of one process: its start (clock ticks since boot), real uid, process group and
    session, and whether it is a zombie."""

    start: int
    uid: int
    pgid: int
    sid: int
    zombie: bool


def identity(pid: int) -> Identity | None:
    """The :class:`Identity` of ``pid`` now, or None (gone, or ``/proc`` unreadable). ``stat`` and ``status`` are
    read through one open ``/proc/<pid>`` directory, which stands for one process: a pid reused between the two
    reads makes them fail, never mix."""
    try:
        dirfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        stat = _read(dirfd, "stat")
        status = _read(dirfd, "status")
    except OSError:
        return None
    finally:
        os.close(dirfd)
    try:
        fields = stat[stat.rindex(b")") + 2:].split()  # after the command name, which may hold anything
        uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith(b"Uid:"))
        return Identity(start=int(fields[19]), uid=uid, pgid=int(fields[2]), sid=int(fields[3]),
                        zombie=fields[0] in (b"Z", b"X"))
    except (ValueError, IndexError, StopIteration):
        return None


def _read(dirfd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY, dir_fd=dirfd)
    try:
        return os.read(fd, 64 * 1024)
    finally:
        os.close(fd)


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (close-on-exec), or None where the kernel or Python gives none."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd: int = pidfd_open(pid)
    except OSError:
        return None
    return fd


def boot_clock() -> float:
    """Seconds since boot, the clock of ``/proc/<pid>/stat``'s start times."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


def started_before(ident: Identity, moment: float) -> bool:
    """Whether a process of ``ident`` started before ``moment`` (:func:`boot_clock`), a whole tick to spare."""
    return (ident.start + 1) / _TICKS <= moment


class ProcessRef:
    """One process proven ours (see the module's text). Build it with :meth:`child` or :meth:`prove`."""

    def __init__(self, pid: int, ident: Identity, fd: int | None, held_at: float) -> None:
        self.pid = pid
        self.ident = ident
        self._fd = fd
        #: the last moment (:func:`boot_clock`) the process was seen holding its pid (running or not yet reaped)
        self.last_held = held_at
        self._group_flag = True  # whether the kernel takes PIDFD_SIGNAL_PROCESS_GROUP (found out at first use)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close, fd) if fd is not None else None

    @classmethod
    def child(cls, pid: int) -> ProcessRef | None:
        """A ref of this process's child ``pid``, not yet reaped (so the pid is still its)."""
        at = boot_clock()
        fd = open_pidfd(pid)
        ident = identity(pid)
        if ident is None:
            _close(fd)
            return None
        return cls(pid, ident, fd, at)

    @classmethod
    def prove(cls, pid: int, *, start: int | None = None, uid: int | None = None) -> ProcessRef | None:
        """A ref of ``pid`` if it runs as ``uid`` (default: ours) and, when ``start`` is given, started then;
        else None. The pidfd is opened between two readings of the identity that agree, so it is of that
        process."""
        uid = os.getuid() if uid is None else uid
        at = boot_clock()
        first = identity(pid)
        if first is None or first.uid != uid or (start is not None and first.start != start):
            return None
        fd = open_pidfd(pid)
        if identity(pid) != first:
            _close(fd)
            return None
        return cls(pid, first, fd, at)

    @property
    def has_pidfd(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        """Close the pidfd (the process is ended, or no longer ours to signal): from then on nothing is sent
        through this ref, and it holds nothing. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self._fd = None
        self._closed = True

    def _matches(self, ident: Identity | None) -> bool:
        return (not self._closed and ident is not None and ident.start == self.ident.start
                and ident.uid == self.ident.uid)

    def held(self) -> bool:
        """Whether the process still holds its pid (running, or exited and not yet reaped); records the moment
        in :attr:`last_held`."""
        at = boot_clock()
        if self._fd is not None:
            try:
                signal.pidfd_send_signal(self._fd, 0)
                held = True
            except ProcessLookupError:
                held = False
            except PermissionError:  # alive, not signallable by us (it changed its uid)
                held = True
        else:
            held = self._matches(identity(self.pid))
        if held:
            self.last_held = max(self.last_held, at)
        return held

    def running(self) -> bool:
        """Whether the process runs (held, and not a zombie)."""
        if not self.held():
            return False
        ident = identity(self.pid)
        return self._matches(ident) and ident is not None and not ident.zombie

    def wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to exit; True as soon as it has (its pidfd turns readable
        when it does, reaped or not). Without a pidfd this only sleeps ``timeout`` and says False: the caller polls."""
        if self._fd is None:
            time.sleep(max(timeout, 0.0))
            return False
        import select

        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        try:
            return bool(poller.poll(max(int(timeout * 1000), 0)))
        except OSError:  # the fd closed meanwhile (another thread closed the ref)
            return False

    def mark_held(self, moment: float) -> None:
        """Record that the process held its pid at ``moment`` (a parent that has not reaped its child knows)."""
        self.last_held = max(self.last_held, moment)

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to this process and no other. False when it is gone (or no longer provably it)."""
        if self._fd is not None:
            try:
                signal.pidfd_send_signal(self._fd, sig)
                return True
            except (ProcessLookupError, PermissionError):
                return False
        if not self._matches(identity(self.pid)):  # checked immediately before the signal
            return False
        try:
            os.kill(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the process group this process leads, only where it is provably that group: through
        the pidfd (Linux 6.9+: the group of that process, whatever has its number since), else while the leader
        still holds its pid. True when done (sent, or the group provably empty); False when it cannot be done
        provably (the caller then signals each member it proves, :meth:`member`)."""
        if self._fd is not None and self._group_flag:
            try:
                signal.pidfd_send_signal(self._fd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
                return True
            except ProcessLookupError:  # nobody left in the group
                return True
            except PermissionError:
                return False
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    return False
                self._group_flag = False  # a kernel before 6.9
        if not self.held():
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            return False
        return True

    def member(self, pid: int) -> ProcessRef | None:
        """A ref of ``pid`` if it is provably in this process's group or session: ours (same uid), its process
        group or session is this pid, and it started before the last moment this process was seen holding its
        pid (a process in a group whose number was reused started after the reuse)."""
        if pid == self.pid:
            return self if self.held() else None
        ref = ProcessRef.prove(pid, uid=self.ident.uid)
        if ref is None:
            return None
        if self.pid not in (ref.ident.pgid, ref.ident.sid) or not started_before(ref.ident, self.last_held):
            ref.close()
            return None
        return ref

    def __repr__(self) -> str:
        return f"ProcessRef(pid={self.pid}, start={self.ident.start}, pidfd={self._fd is not None})"


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
