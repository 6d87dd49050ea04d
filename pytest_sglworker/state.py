"""Where the plugin keeps its files: lock and log directories, created safely in a shared temp dir.

Plain Python: no pytest here. A directory we create is ours alone (mode 0700). An existing directory is
used only if it is not a symlink and, when it sits in a world-writable place such as /tmp, it is owned by
us and not writable by others: a planted directory or symlink is refused, never followed.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .errors import SglWorkerError


class UnsafeDirectory(SglWorkerError):
    """A lock or log directory that another user could tamper with."""


def default_root() -> Path:
    """``<system temp>/pytest-sglworker-<uid>``: per user, so that a shared /tmp is safe."""
    return Path(tempfile.gettempdir()) / f"pytest-sglworker-{os.getuid()}"


def ensure_private_dir(path: Path, *, what: str, shared_ok: bool = False) -> Path:
    """Create ``path`` (and parents) if needed and check that it is safe to use.

    ``shared_ok``: a directory the user named explicitly (``--sgl-lock-dir``) may be group/other writable if
    it has the sticky bit; it must still not be a symlink. Lock files are created 0644, so processes of
    *one* user coordinate there; sharing leases between users is not supported yet.
    """
    path = Path(path)
    root = default_root()
    if path != root and root in path.parents:
        # <tmp>/pytest-sglworker-<uid> sits in a world-writable place: check it before creating anything in it,
        # or a directory (or symlink) planted there by another user would be used as our parent.
        ensure_private_dir(root, what=f"{what} parent")
    if os.path.islink(path):
        raise UnsafeDirectory(f"{what} {path} is a symlink; refusing to follow it (remove it or choose another path)")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise UnsafeDirectory(f"{what} {path} exists and is not a directory; choose another path") from None
    except OSError as exc:
        raise UnsafeDirectory(f"cannot create {what} {path}: {exc.strerror}; choose a writable path") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"{what} {path} is a symlink; refusing to follow it (remove it or choose another path)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{what} {path} is not a directory")
    writable_by_others = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    # A shared lock directory may belong to root or be a sticky one (1777) of another user; a plain directory
    # of another user is theirs to swap files in.
    if st.st_uid != os.getuid() and not (shared_ok and (st.st_uid == 0 or st.st_mode & stat.S_ISVTX)):
        raise UnsafeDirectory(
            f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            "another user may have planted it: remove it or choose another path"
        )
    if writable_by_others and not (shared_ok and st.st_mode & stat.S_ISVTX):
        raise UnsafeDirectory(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run 'chmod go-w {path}' or choose another path"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise UnsafeDirectory(f"{what} {path} is not writable; choose a writable path")
    return path


def default_lock_dir() -> Path:
    return default_root() / "locks"


def default_log_dir() -> Path:
    return default_root() / "logs"
