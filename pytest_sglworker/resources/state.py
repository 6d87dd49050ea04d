"""Where the plugin keeps its files: lock and log directories, created safely in a shared temp dir, and how
it writes a file so that no reader ever sees half of it.

Plain Python: no pytest here. A directory we create is ours alone (mode 0700). An existing directory is
used only if it is not a symlink and, when it sits in a world-writable place such as /tmp, it is owned by
us and not writable by others: a planted directory or symlink is refused, never followed.

Every file the plugin produces (holder records, the run report) is written with :func:`atomic_write`: a
temporary file in the same directory, then a rename, so that a full disk, a crash or an interrupt leaves
the old file or the new one, never a truncated one, and never a temporary file behind.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import uuid
from pathlib import Path

from ..errors import SglWorkerError

__all__ = [
    "UnsafeDirectory",
    "UnusableFile",
    "atomic_write",
    "default_lock_dir",
    "default_log_dir",
    "default_root",
    "describe_file_problem",
    "ensure_private_dir",
    "read_bounded",
    "read_bounded_owned",
]


class UnsafeDirectory(SglWorkerError):
    """A lock or log directory that another user could tamper with."""


class UnusableFile(SglWorkerError):
    """A path where the plugin must keep a file (a lock, a holder record) holds something else: a directory,
    a symlink, a device. The message names the path and what to do."""


def describe_file_problem(path: Path | str, exc: OSError) -> str:
    """Why ``path`` cannot be used as a file, in words: ``"is a directory"``, ``"is a symlink"``, ..."""
    try:
        st = os.lstat(path)
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if st is not None and stat.S_ISLNK(st.st_mode):
        return "is a symlink (never followed)"
    if st is not None and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if exc.errno == errno.ELOOP:
        return "is a symlink (never followed)"
    return exc.strerror or str(exc)


def atomic_write(path: Path | str, data: bytes | str, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or all of the new one, nothing between.

    The data goes to a new temporary file in the same directory (``O_EXCL | O_NOFOLLOW``: never through a file
    or symlink planted at that name), with ``mode`` exactly (whatever the umask), is fsynced, and replaces
    ``path`` by ``os.replace``. On any failure (a full disk, ``path`` being a directory, an interrupt) the
    temporary file is removed, ``path`` keeps its old content, and the error is raised (an ``OSError`` for
    file-system errors, whose ``filename`` is ``path``). ``str`` data is written as UTF-8.
    """
    path = Path(path)
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        # a rename would replace a device node, a symlink or a FIFO with this file: never
        what = "a symlink" if stat.S_ISLNK(existing.st_mode) else (
            "a directory" if stat.S_ISDIR(existing.st_mode) else "not a regular file")
        raise OSError(errno.EEXIST, f"{what} is in the way (only a regular file is ever replaced)", str(path))
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, mode & 0o777)
    try:
        try:
            os.fchmod(fd, mode & 0o7777)  # exactly ``mode``: os.open's mode is reduced by the umask
            view = memoryview(payload)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # onto a directory: IsADirectoryError, and the temporary file goes
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def read_bounded(path: Path | str, limit: int) -> tuple[bytes | None, str | None]:
    """The bytes of the small regular file at ``path``: ``(data, None)``, ``(None, None)`` when there is none, or
    ``(None, why)`` when what lies there cannot be trusted (a directory, a symlink, a FIFO, more than ``limit``
    bytes, unreadable). Never follows a symlink, never blocks on a FIFO, never raises."""
    data, why, _ = read_bounded_owned(path, limit)
    return data, why


def read_bounded_owned(path: Path | str, limit: int) -> tuple[bytes | None, str | None, int | None]:
    """:func:`read_bounded`, with the uid that owns the file as the third item (read with ``fstat`` from the
    descriptor the bytes came from, so it is the owner of those very bytes; None when nothing was opened). A
    record's owner is that uid, whatever the record says."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, None, None
    except OSError as exc:
        return None, describe_file_problem(path, exc), None
    try:
        st = os.fstat(fd)
        owner = st.st_uid
        if stat.S_ISDIR(st.st_mode):
            return None, "is a directory", owner
        if not stat.S_ISREG(st.st_mode):
            return None, "is not a regular file", owner
        if st.st_size > limit:
            return None, f"is {st.st_size} bytes, larger than {limit}", owner
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            return None, f"is larger than {limit}", owner  # it grew while being read
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})", None
    finally:
        os.close(fd)
    return b"".join(chunks), None, owner


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: some file systems refuse to fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
