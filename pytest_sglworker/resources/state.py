"""Where the plugin keeps its files: lock and log directories, created safely in a shared temp dir, and how
it writes a file so that no reader ever sees half of it.

Plain Python: no pytest here. A directory we create is ours alone (mode 0700). An existing directory is
used only if it is not a symlink, belongs to us (a shared lock directory: to us or to root) and is not writable by
others (a shared lock directory: unless it is sticky), and only if every directory above it belongs to us or to
root and nobody else can swap an entry in it: a planted directory or symlink is refused, never followed. A
directory that passed is *pinned*: opened once (:func:`pinned_dir`), and every file the plugin creates or opens in
it afterwards (:func:`atomic_write`, :func:`read_bounded_owned`, the lock files of :mod:`.lockfiles`) is reached
through that descriptor, so that a directory swapped for a symlink mid-session never makes it create a file
anywhere else.

Every file the plugin produces (holder records, the run report) is written with :func:`atomic_write`: a
temporary file in the same directory, then a rename, so that a full disk, a crash or an interrupt leaves
the old file or the new one, never a truncated one, and never a temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import threading
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
    "in_dir",
    "pin_directory",
    "pinned_dir",
    "read_bounded",
    "read_bounded_owned",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_PATH = getattr(os, "O_PATH", os.O_RDONLY)
#: directories checked and opened once by this process (absolute path -> descriptor), see :func:`pinned_dir`
_PINNED: dict[str, int] = {}
_PIN_LOCK = threading.Lock()


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
    text = exc.strerror or str(exc)
    if st is not None and exc.errno in (errno.EACCES, errno.EPERM) and st.st_uid != os.getuid():
        text += f" (it belongs to uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
    return text


def atomic_write(path: Path | str, data: bytes | str, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or all of the new one, nothing between.

    The data goes to a new temporary file in the same directory (``O_EXCL | O_NOFOLLOW``: never through a file
    or symlink planted at that name), with ``mode`` exactly (whatever the umask), is fsynced, and replaces
    ``path`` by ``os.replace``. On any failure (a full disk, ``path`` being a directory, an interrupt) the
    temporary file is removed, ``path`` keeps its old content, and the error is raised (an ``OSError`` for
    file-system errors, whose ``filename`` is ``path``). ``str`` data is written as UTF-8.
    """
    path = Path(path)
    dir_fd, name = in_dir(path)
    try:
        existing = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        # a rename would replace a device node, a symlink or a FIFO with this file: never
        what = "a symlink" if stat.S_ISLNK(existing.st_mode) else (
            "a directory" if stat.S_ISDIR(existing.st_mode) else "not a regular file")
        raise OSError(errno.EEXIST, f"{what} is in the way (only a regular file is ever replaced)", str(path))
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp_name = f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    tmp = tmp_name if dir_fd is not None else str(path.with_name(tmp_name))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    fd = os.open(tmp, flags, mode & 0o777, dir_fd=dir_fd)
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
        # onto a directory: IsADirectoryError, and the temporary file goes
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if dir_fd is not None:
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    else:
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
    flags = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
    try:
        dir_fd, name = in_dir(Path(path))
        fd = os.open(name, flags, dir_fd=dir_fd)
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
    """Create ``path`` (and parents) if needed, check that it is safe to use, and pin it (:func:`pinned_dir`).

    Safe: not a symlink; every directory above it (after resolving symlinks in the parents) belongs to this user
    or to root and nobody else can swap an entry in it (not writable by others, or sticky like /tmp); the
    directory itself belongs to this user and is not writable by others. ``shared_ok``: a directory the user named
    explicitly (``--sgl-lock-dir``) that several users share: it may belong to root as well, and be writable by
    others when it is sticky (``install -d -m 1777``), so that nobody can remove or rename another user's files
    in it. Such a directory is shared between users: every user's sessions take and release each other's lock
    files (:mod:`.lockfiles`), and read each other's records as "busy" only (docs/SECURITY.md).
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
    fd = _open_checked(path, what)
    try:
        st = os.fstat(fd)
        writable_by_others = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        # A shared lock directory may belong to root (as the how-to makes it); one of another user is theirs to
        # rename files in, sticky or not (the sticky bit does not bind a directory's owner).
        if st.st_uid != os.getuid() and not (shared_ok and st.st_uid == 0):
            raise UnsafeDirectory(
                f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
                + (" or to root" if shared_ok else "")
                + "; another user may have planted it, and its owner can rename any file in it: remove it or "
                "choose another path"
            )
        if writable_by_others and not (shared_ok and st.st_mode & stat.S_ISVTX):
            raise UnsafeDirectory(
                f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run 'chmod go-w {path}' or choose another path"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise UnsafeDirectory(f"{what} {path} is not writable; choose a writable path")
    except BaseException:
        os.close(fd)
        raise
    _pin(path, fd)
    return path


def _ancestor_problem(st: os.stat_result) -> str | None:
    """Why another user could swap entries of the directory ``st`` (a parent of a directory of ours), or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (0, os.getuid()):
        return f"belongs to uid {st.st_uid} (neither you nor root)"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o}) without the sticky bit"
    return None


def _open_checked(path: Path, what: str) -> int:
    """A descriptor of the directory ``path``, reached from ``/`` one component at a time without following a
    symlink (the parents' symlinks resolved first), every directory above it checked (:func:`_ancestor_problem`)
    on the very descriptor walked through. ``UnsafeDirectory`` names the directory that fails and why."""
    real = Path(os.path.realpath(path))
    parts = real.parts
    fd = os.open("/", _PATH | _DIRECTORY | _CLOEXEC)
    here = Path("/")
    try:
        for i, name in enumerate(parts[1:], 1):
            problem = _ancestor_problem(os.fstat(fd))
            if problem is not None:
                shown = f"{path} (in {real})" if real != Path(os.path.abspath(path)) else str(path)
                raise UnsafeDirectory(
                    f"{what} {shown} lies in {here}, which {problem}: its owner or another user could swap the "
                    "directory for another; choose a path whose every parent directory belongs to you or to root "
                    "and only they can change"
                )
            last = i == len(parts) - 1
            try:
                step = os.open(name, (os.O_RDONLY if last else _PATH) | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            except OSError as exc:
                why = "changed while it was checked (a symlink now)" if exc.errno == errno.ELOOP else (
                    exc.strerror or str(exc))
                raise UnsafeDirectory(f"cannot open {what} {path}: {here / name} {why}; choose another path") from None
            os.close(fd)
            fd = step
            here = here / name
        return fd
    except BaseException:
        os.close(fd)
        raise


def _key(path: Path | str) -> str:
    return os.path.abspath(path)


def _pin(path: Path, fd: int) -> None:
    """Keep ``fd`` as the descriptor of ``path``; a directory pinned there already stays (the lock files this
    process holds are in it), unless it was removed meanwhile."""
    key = _key(path)
    with _PIN_LOCK:
        old = _PINNED.get(key)
        if old is not None:
            try:
                alive = os.fstat(old).st_nlink > 0
            except OSError:
                alive = False
            if alive:
                os.close(fd)
                return
            os.close(old)
        _PINNED[key] = fd


def pinned_dir(path: Path | str) -> int | None:
    """The descriptor of the directory ``path`` as :func:`ensure_private_dir` checked and opened it in this
    process (None: not pinned). A pinned directory that was removed since is checked and opened again."""
    key = _key(path)
    with _PIN_LOCK:
        fd = _PINNED.get(key)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_nlink > 0:
            return fd
    except OSError:
        pass
    # removed (the lock directory was wiped): what is at the path now must pass the same walk
    try:
        fresh = _open_checked(Path(key), "directory")
    except UnsafeDirectory as exc:
        raise OSError(errno.ENOENT, f"the pinned directory was removed, and what is there now is unsafe ({exc})",
                      key) from None
    except OSError as exc:
        raise OSError(exc.errno, f"the pinned directory was removed ({exc.strerror})", key) from None
    _pin(Path(key), fresh)
    with _PIN_LOCK:
        return _PINNED.get(key)


def pin_directory(path: Path | str) -> int | None:
    """Pin ``path`` for a process that did not check it itself (a warm keeper, a watchdog: their session did),
    after the walk of :func:`_open_checked`; None when that walk refuses it (then paths are used as they are)."""
    existing = pinned_dir(path)
    if existing is not None:
        return existing
    try:
        fd = _open_checked(Path(path), "lock directory")
    except (UnsafeDirectory, OSError):
        return None
    _pin(Path(path), fd)
    with _PIN_LOCK:
        return _PINNED.get(_key(path))


def in_dir(path: Path) -> tuple[int | None, str]:
    """How to reach the file ``path``: ``(descriptor of its pinned directory, its name)``, or ``(None, the whole
    path)`` when its directory is not pinned. For ``os.open(name, ..., dir_fd=fd)`` and the like."""
    fd = pinned_dir(path.parent)
    return (fd, path.name) if fd is not None else (None, str(path))


def default_lock_dir() -> Path:
    return default_root() / "locks"


def default_log_dir() -> Path:
    return default_root() / "logs"
