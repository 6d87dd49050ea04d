"""Files the plugin created, touched again only once proven to be those very files.

Plain Python, no pytest. A record in the lock directory may name a file (a warm group's log and its links); on a
shared machine anyone who can write that directory can write such a record, and an edited or planted path could
name any file the session's user may write (as root: any file). So a path read from a record is never opened,
appended to, linked or deleted on the record's word:

- when the plugin creates a file it notes its identity, :class:`FileId` (device and inode; the file must be a
  regular file of this user), and a record carries it beside the path;
- before touching the path again, the file there is opened without following a symlink (``O_NOFOLLOW``) and its
  ``fstat`` must show the same device and inode, a regular file, owned by this user; a deletion checks the same
  with ``lstat`` and requires that no other user can swap the directory entry meanwhile (the directory is this
  user's or root's, and not writable by others unless it is sticky);
- a hard link is made without following a symlink, then checked the same way, and undone when it is not the file.

Everything here answers with a reason in words instead of raising (:func:`why_not_ours`), so a caller can say
why it left a file alone.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FileId", "append_owned", "entry_problem", "link_owned", "remove_own_entry", "unlink_owned",
           "why_not_ours"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True)
class FileId:
    """The identity of a file the plugin created: its device and inode (a hard link of it has the same)."""

    dev: int
    ino: int

    @classmethod
    def of(cls, path: Path | str) -> FileId | None:
        """The identity of the regular file of this user at ``path`` (not followed if a symlink), else None."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        return cls(st.st_dev, st.st_ino)

    def as_list(self) -> list[int]:
        return [self.dev, self.ino]


def _why_not(st: os.stat_result, ident: FileId | None) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if ident is None:
        return "has no identity on record (a record older than this check, or not written by the plugin)"
    if (st.st_dev, st.st_ino) != (ident.dev, ident.ino):
        return "is not the file the plugin created there (another device or inode)"
    return None


def _directory_problem(path: Path) -> str | None:
    """Why another user could swap the entry ``path`` in its directory, or None."""
    try:
        st = os.lstat(path.parent)
    except OSError as exc:
        return f"its directory cannot be inspected ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "its directory is not a directory"
    if st.st_uid not in (os.getuid(), 0):
        return f"its directory belongs to uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return "its directory is writable by other users"
    return None


def _lstat(path: Path | str) -> os.stat_result | str:
    """The entry at ``path`` (a symlink not followed), or why there is none to look at: ``"is gone"``, ..."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return "is gone"
    except OSError as exc:
        return f"cannot be inspected ({exc.strerror or exc})"


def why_not_ours(path: Path | str, ident: FileId | None) -> str | None:
    """Why the file at ``path`` is not provably the file of identity ``ident`` that this user created (None: it
    is). Never follows a symlink, never blocks on a FIFO."""
    st = _lstat(path)
    if isinstance(st, str):
        return st
    return _why_not(st, ident) or _directory_problem(Path(path))


def append_owned(path: Path | str, ident: FileId | None, data: bytes) -> str | None:
    """Append ``data`` to the file at ``path`` if it is provably ``ident``: the check is made on the opened
    descriptor, so nothing can be swapped in between. None when written, else why not."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        return f"cannot be opened ({exc.strerror or exc})"
    try:
        why = _why_not(os.fstat(fd), ident)
        if why is None:
            os.write(fd, data)
        return why
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"
    finally:
        os.close(fd)


def unlink_owned(path: Path | str, ident: FileId | None) -> str | None:
    """Delete ``path`` if it is provably ``ident`` in a directory no other user can swap it in. None when
    deleted (or already gone), else why it was left alone."""
    why = why_not_ours(path, ident)
    if why == "is gone":
        return None
    if why is not None:
        return why
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be deleted ({exc.strerror or exc})"
    return None


def link_owned(source: Path | str, ident: FileId | None, target: Path | str) -> str | None:
    """Make ``target`` a hard link of ``source`` if ``source`` is provably ``ident``. None when linked, else why
    not (and no link is left)."""
    why = why_not_ours(source, ident)
    if why is not None:
        return why
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        return f"cannot be linked ({exc.strerror or exc})"
    why = why_not_ours(target, ident)
    if why is not None:  # swapped between the check and the link: undo it
        with contextlib.suppress(OSError):
            os.unlink(target)
        return why
    return None


def entry_problem(path: Path | str) -> str | None:
    """Why the lock directory's entry ``path`` is not this user's to remove (``"is gone"`` when there is none), or
    None: another user's entry is theirs whatever its name says (and as root the sticky bit would not stop us), and a
    directory is never removed."""
    st = _lstat(path)
    if isinstance(st, str):
        return st
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid} (another user): left alone"
    if stat.S_ISDIR(st.st_mode):
        return f"is a directory: left alone (remove it by hand: rm -r {path})"
    return None


def remove_own_entry(path: Path | str) -> str | None:
    """Remove the lock directory's entry ``path`` (a record, a claim's lock file, a symlink) when it is this user's
    (:func:`entry_problem`). None when removed or gone, else why it was left."""
    why = entry_problem(path)
    if why is not None:
        return None if why == "is gone" else why
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be removed ({exc.strerror or exc})"
    return None
