"""Worker logs kept the way pytest keeps ``tmp_path``: a directory per session, the last few kept.

Plain Python, no pytest. Under the default log root (``<tmp>/pytest-sglworker-<uid>/logs``) each session
logs into ``session-<N>`` (N counts up), ``current`` links to the newest, and only the newest ``count``
session directories are kept (like pytest's ``tmp_path_retention_count``). A session holds an ``flock`` on
``<dir>/.lock`` while it runs, so a concurrent session's directory is never removed under it. Which logs a
session keeps is the policy (like ``tmp_path_retention_policy``): ``all``, ``failed`` (only the logs of
workers that failed or served a failing test) or ``none``. An explicit ``--sgl-log-dir`` is used as it is,
without session directories (as pytest uses an explicit ``--basetemp``), and the policy still applies.

A log the run reports as kept (a failed worker's, or every log under ``--sgl-keep-logs``) outlives the count:
its session directory is marked (:func:`mark_kept`, a ``.kept`` file) and stays ``KEEP_DAYS`` days, however many
sessions of the same user (other CI jobs beside this one) start meanwhile; after that the count applies to it
again. The janitor removes logs unchanged for as long from an explicit ``--sgl-log-dir`` (:mod:`reaper`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .state import ensure_private_dir

if TYPE_CHECKING:
    from filelock import BaseFileLock

__all__ = ["KEEP_DAYS", "KEEP_SECONDS", "POLICIES", "SessionLogDir", "keeps", "kept_until", "make_session_dir",
           "mark_kept"]

POLICIES = ("all", "failed", "none")
#: How long a log the run reports as kept stays, whatever the retention count.
KEEP_DAYS = 7
KEEP_SECONDS = KEEP_DAYS * 24 * 3600
_KEPT = ".kept"
_SESSION = re.compile(r"session-(\d+)")
_held: list[BaseFileLock] = []


def keeps(policy: str, *, failed: bool) -> bool:
    """Whether a worker's log stays after its teardown under ``policy``."""
    return policy == "all" or (policy == "failed" and failed)


class SessionLogDir:
    """The numbered session directory this session logs into."""

    def __init__(self, path: Path, lock: BaseFileLock) -> None:
        self.path = path
        self._lock = lock

    def release(self) -> None:
        self._lock.release(force=True)
        with contextlib.suppress(ValueError):
            _held.remove(self._lock)


def mark_kept(directory: Path) -> float:
    """Mark a session directory as holding a kept log: retention leaves it ``KEEP_SECONDS`` from now. Returns
    that time (seconds since the epoch)."""
    marker = directory / _KEPT
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    os.utime(marker)  # a second mark in the same session counts from now
    return marker.stat().st_mtime + KEEP_SECONDS


def kept_until(directory: Path) -> float | None:
    """Until when a marked session directory is kept; None when it is not marked."""
    try:
        return (directory / _KEPT).lstat().st_mtime + KEEP_SECONDS
    except OSError:
        return None


def _number(path: Path) -> int | None:
    match = _SESSION.fullmatch(path.name)
    return int(match.group(1)) if match else None


def make_session_dir(root: Path, count: int) -> SessionLogDir:
    """Create ``root/session-<N+1>``, point ``root/current`` at it, and remove the oldest session directories
    beyond ``count`` that no running session holds and that hold no kept log younger than ``KEEP_SECONDS``
    (:func:`mark_kept`; those do not count). ``count`` 0 keeps none of the earlier ones."""
    from filelock import FileLock, Timeout

    root = ensure_private_dir(root, what="log directory")
    numbers = [n for n in (_number(p) for p in root.iterdir()) if n is not None]
    n = max(numbers, default=0) + 1
    while True:
        path = root / f"session-{n}"
        try:
            path.mkdir(mode=0o700)
            break
        except FileExistsError:  # a concurrent session took this number
            n += 1
    lock = FileLock(path / ".lock", thread_local=False, mode=0o600)
    lock.acquire()
    _held.append(lock)
    current = root / "current"
    with contextlib.suppress(OSError):
        tmp = root / f".current-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.name)
        os.replace(tmp, current)
    now = time.time()
    sessions = sorted((p for p in root.iterdir() if _number(p) is not None and p != path
                       and (kept_until(p) or 0) <= now),
                      key=lambda p: _number(p) or 0)
    for old in sessions[: max(0, len(sessions) - max(0, count - 1))]:
        other = FileLock(old / ".lock", thread_local=False, mode=0o600)
        try:
            other.acquire(blocking=False)
        except (Timeout, OSError):
            continue  # a running session's logs
        try:
            shutil.rmtree(old, ignore_errors=True)
        finally:
            other.release(force=True)
    return SessionLogDir(path, lock)
