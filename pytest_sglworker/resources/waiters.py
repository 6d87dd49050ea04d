"""Waiters: a process that waits for a GPU lease or a port block says so in the lock directory, so that holders
of idle pooled workers let go of them instead of keeping them.

The one home of this bookkeeping, for the GPU leases (:mod:`pytest_sglworker.resources.gpus`) and the port
blocks (:mod:`pytest_sglworker.resources.ports`) alike. Plain Python, no pytest; ``psutil`` is imported lazily.

A waiter flags itself with an empty file ``<lock_dir>/<prefix><pid>`` (:func:`flag_waiting`, 0600, never
through a symlink) when its wait starts and removes it when the wait ends (:func:`unflag_waiting`). Threads of
one process share its flag: it is counted, and removed when the last of them stops waiting. The
prefix says what it waits for: ``waiting-<namespace>-`` for a GPU lease of that namespace
(:func:`lease_waiting_prefix`), ``waiting-ports-`` for a port block (:data:`PORTS_WAITING_PREFIX`). A holder
asks :func:`live_waiters` whether a live process other than itself left such a flag; the flags of dead waiters
are removed on the way, and a file name that does not end with a plausible pid is ignored. Best effort: a
flag that cannot be made is no flag, and the wait goes on without it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from .owned_files import remove_own_entry
from .processes import plausible_pid

__all__ = [
    "PORTS_WAITING_PREFIX",
    "flag_waiting",
    "lease_waiting_prefix",
    "live_waiters",
    "others_waiting_for_ports",
    "unflag_waiting",
]

#: The flag prefix of a process waiting for a port block.
PORTS_WAITING_PREFIX = "waiting-ports-"
#: How many threads of this process wait behind each flag file (the file goes when the count drops to 0).
_WAITING: dict[Path, int] = {}
_WAITING_LOCK = threading.Lock()


def lease_waiting_prefix(namespace: str) -> str:
    """The flag prefix of a process waiting for a GPU lease of the lease namespace ``namespace``."""
    return f"waiting-{namespace}-"


def flag_waiting(lock_dir: Path, prefix: str) -> Path | None:
    """Flag this process as waiting: the file ``<lock_dir>/<prefix><pid>``, or ``None`` if it cannot be made."""
    path = lock_dir / f"{prefix}{os.getpid()}"
    with _WAITING_LOCK:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600))
        except OSError:
            return None
        _WAITING[path] = _WAITING.get(path, 0) + 1
    return path


def unflag_waiting(flag: Path | None) -> None:
    """Remove a flag :func:`flag_waiting` made (``None``: there is none). Never raises for a file gone already."""
    if flag is None:
        return
    with _WAITING_LOCK:
        left = _WAITING.get(flag, 1) - 1
        if left > 0:
            _WAITING[flag] = left
            return  # another thread of this process still waits behind it
        _WAITING.pop(flag, None)
        with contextlib.suppress(OSError):
            flag.unlink()


def live_waiters(lock_dir: Path, prefix: str) -> bool:
    """Whether a live process other than this one left a ``<prefix><pid>`` flag in ``lock_dir``; the flags of
    dead waiters are removed (this user's only: another user's flag is theirs)."""
    import psutil

    me = os.getpid()
    try:
        paths = list(lock_dir.glob(f"{prefix}*"))
    except OSError:
        return False
    for path in paths:
        pid = plausible_pid(path.name[len(prefix):])
        if pid is None or pid == me:
            continue
        if psutil.pid_exists(pid):
            return True
        remove_own_entry(path)  # a waiter that died; another user's flag is theirs to remove
    return False


def others_waiting_for_ports(lock_dir: Path) -> bool:
    """Whether another live process of this machine waits for a port block in ``lock_dir`` (its idle pooled
    workers' blocks should then be given back)."""
    return live_waiters(Path(lock_dir), PORTS_WAITING_PREFIX)
