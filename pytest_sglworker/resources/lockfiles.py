"""Lock files of the lock directory: the ``flock`` s behind GPU leases, port blocks and warm claims, taken the same
way by every user who shares the directory.

Plain Python, no pytest. A ``flock`` needs an open descriptor of the file, not the right to write it: a lock file
is created ``0644`` whatever the umask (never through a symlink, never replacing anything), opened read-write
when this user may, else read-only (a lock file another user created first), and locked. Nothing ever reads or
writes a lock file's content, so who may write one does not matter; the lock is the truth. So the sessions of
every user of a shared lock directory take and release every GPU lock and port block, whoever made the file. An
existing file is opened without ``O_CREAT`` (the create is ``O_CREAT | O_EXCL``, which fails at once on an existing
name): Linux's ``fs.protected_regular`` refuses ``O_CREAT`` on another user's file in a sticky directory.

A warm group's claim is a lock file of its owner only (``own_only``): another user's file at its path is no claim
anybody of ours can hold (:class:`Unusable` says why), never read as "held".

The file is reached through the lock directory's pinned descriptor when there is one (:func:`.state.in_dir`), so
that a lock directory swapped for a symlink mid-session never gets a lock file created elsewhere.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

from .state import in_dir

__all__ = ["LockFile", "Unusable"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class Unusable(OSError):
    """What lies at a lock file's path cannot be locked by this user: a directory, a symlink, a file it may not
    open, or (``own_only``) a file of another user. ``str()`` of it is the reason in words."""


def _open_lock_file(path: Path, mode: int, own_only: bool) -> int:
    """A descriptor of the lock file ``path``, made if missing; ``OSError`` (its ``filename`` the path) when what
    lies there is no lock file this user can use."""
    dir_fd, name = in_dir(path)
    base = _NOFOLLOW | _NONBLOCK | _CLOEXEC
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | base, mode, dir_fd=dir_fd)
    except FileExistsError:
        try:
            fd = os.open(name, os.O_RDWR | base, dir_fd=dir_fd)
        except PermissionError:
            if own_only:
                raise
            fd = os.open(name, os.O_RDONLY | base, dir_fd=dir_fd)  # another user's: a flock needs no write access
        except IsADirectoryError:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path)) from None
    else:
        try:
            os.fchmod(fd, mode)  # exactly ``mode``: the umask must not keep other users from opening it
        except BaseException:
            os.close(fd)
            raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Unusable(errno.EINVAL, "is not a regular file", str(path))
    if own_only and st.st_uid != os.getuid():
        os.close(fd)
        raise Unusable(errno.EPERM, f"belongs to uid {st.st_uid} (another user), not to you (uid {os.getuid()})",
                       str(path))
    return fd


class LockFile:
    """One ``flock`` of the lock file at ``path``: :meth:`acquire`, :meth:`release`, and for a hand-over to another
    process (``--sgl-keep-warm``) :attr:`fd` and :meth:`forget`. Not reentrant; not thread-safe (each lease or
    block has its own)."""

    def __init__(self, path: Path | str, *, mode: int = 0o644, own_only: bool = False) -> None:
        self.lock_file = str(path)
        self.mode = mode
        self.own_only = own_only
        self._fd: int | None = None

    @property
    def is_locked(self) -> bool:
        return self._fd is not None

    @property
    def fd(self) -> int | None:
        """The descriptor whose open file holds the flock (None when not locked)."""
        return self._fd

    def acquire(self, *, timeout: float = 0.0, poll_interval: float = 0.02) -> bool:
        """Take the flock, waiting up to ``timeout`` seconds: True when held now, False when another open file
        holds it still. ``OSError`` when the path holds no lock file this user can use (a directory, a symlink,
        a file it may not open; :class:`Unusable` for what it opened and refused)."""
        import fcntl

        if self._fd is not None:
            return True
        deadline = time.monotonic() + max(timeout, 0.0)
        fd = _open_lock_file(Path(self.lock_file), self.mode, self.own_only)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        os.close(fd)
                        return False
                    time.sleep(min(poll_interval, left))
                    continue
                self._fd = fd
                return True
        except BaseException:
            if self._fd is None:
                os.close(fd)
            raise

    def release(self, force: bool = True) -> None:
        """Unlock and close. Idempotent. (``force`` is accepted for the callers of filelock's signature.)"""
        import fcntl

        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(fd)

    def forget(self) -> None:
        """Close this process's descriptor *without unlocking*: another process holds a duplicate of the same
        open file (``SCM_RIGHTS``), and with it the flock, which the kernel drops only when the last descriptor
        of that open file closes."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        # A lock object dropped without release (a lease forgotten) keeps nothing open: its holder lists keep the
        # ones that must stay held referenced.
        fd = getattr(self, "_fd", None)
        if fd is not None:
            self._fd = None
            try:
                os.close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"<LockFile {self.lock_file} ({'held' if self._fd is not None else 'free'})>"
