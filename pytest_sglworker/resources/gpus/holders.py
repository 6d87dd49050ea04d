"""GPU holder records and lock files: who holds which GPU lock, read without trusting what the lock
directory holds.

One lock file per GPU, ``<lock_dir>/gpu-<namespace>-<index>.lock`` (:func:`gpu_lock_path`), held with
``flock`` by the :class:`~pytest_sglworker.resources.gpus.leases.LeaseManager`; beside it the holder record
``<lock_dir>/gpu-<namespace>-<index>.json`` (:func:`holder_record_path`, :class:`HolderRecord`), written
atomically after locking (:func:`write_holder_record`) and removed before unlocking. The lock is the truth
(:func:`lock_is_held`); the record only feeds messages, the declared inventory's free memory and the
dead-holder guard (:func:`dead_holder_leftovers`). A record that cannot be trusted is ignored
(:func:`inspect_holder_record`, :func:`read_holder_record`).

Plain Python, no pytest; ``fcntl`` and ``psutil`` are imported lazily.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..owned_files import remove_own_entry
from ..processes import (
    PID_MAX,
    find_session_processes,
    find_tagged_processes,
    hostname,
    plausible_pid,
    process_alive,
    session_worker_pids,
)

__all__ = [
    "MAX_RECORD_BYTES",
    "NAMESPACE_RE",
    "HolderRecord",
    "HolderRecordWarning",
    "dead_holder_leftovers",
    "gpu_lock_path",
    "holder_leftover_pids",
    "holder_record_path",
    "inspect_holder_record",
    "lock_is_held",
    "read_holder_record",
    "remove_dead_temporaries",
    "write_holder_record",
]

#: What a lease namespace (``nvml``, ``sim-4x80``) may look like: it is part of lock file names.
NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class HolderRecord:
    """Who holds one GPU lock: written next to the lock, for messages and declared free memory."""

    pid: int
    hostname: str
    holder: str
    since: float
    uuid: str
    memory_mib: int
    index: int
    namespace: str
    gpus: tuple[int, ...] = ()
    #: owner tags of workers on the GPU that are not of the holder's own session: a warm group's keeper holds
    #: the lease of workers an earlier session started (``--sgl-keep-warm``)
    workers: tuple[str, ...] = ()

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        stamp = time.strftime("%H:%M:%S", time.localtime(self.since))
        host = "" if self.hostname == hostname() else f" on {self.hostname}"
        return f"pid {self.pid}{host} for {self.holder!r} since {stamp} ({max(now - self.since, 0):.0f} s)"


def holder_record_path(lock_dir: Path, namespace: str, index: int) -> Path:
    """The holder record of GPU ``index`` of the lease namespace ``namespace``."""
    return lock_dir / f"gpu-{namespace}-{index}.json"


def gpu_lock_path(lock_dir: Path, namespace: str, index: int) -> Path:
    """The lock file of GPU ``index`` of the lease namespace ``namespace``."""
    return lock_dir / f"gpu-{namespace}-{index}.lock"


#: A holder record is a few hundred bytes; anything much larger is not one of ours (and is never parsed).
MAX_RECORD_BYTES = 16 * 1024
_MAX_INDEX = 1 << 16
_MAX_MIB = 1 << 40
_RECORD_NAME_RE = re.compile(r"^gpu-(?P<namespace>[A-Za-z0-9][A-Za-z0-9._-]*)-(?P<index>[0-9]{1,6})\.json$")
_PRINTABLE_RE = re.compile(r"^[\x21-\x7e]+$")


class HolderRecordWarning(UserWarning):
    """A GPU holder record in the lock directory that cannot be trusted was ignored (and removed)."""


def _bounded_int(data: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key!r} is {_short(value)}, not a whole number in {low}..{high}")
    return value


def _bounded_str(data: Mapping[str, Any], key: str, limit: int, *, printable: bool = False) -> str:
    value = data[key]
    if not isinstance(value, str) or len(value) > limit or (printable and not _PRINTABLE_RE.match(value)):
        kind = "printable text without spaces" if printable else "text"
        raise ValueError(f"{key!r} is {_short(value)}, not {kind} of at most {limit} characters")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _parse_record(raw: bytes, path: Path) -> HolderRecord:
    """The record in ``raw``, validated field by field; ``ValueError`` says what cannot be trusted."""
    def no_constant(name: str) -> object:
        raise ValueError(f"{name} is not a number a holder record holds")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    try:
        data = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise ValueError("nested too deeply to be a holder record") from None
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    missing = [k for k in ("pid", "hostname", "holder", "since", "uuid", "memory_mib", "index", "namespace")
               if k not in data]
    if missing:
        raise ValueError(f"missing {', '.join(map(repr, missing))}")
    since = data["since"]
    if isinstance(since, bool) or not isinstance(since, (int, float)) or not 0 <= since <= time.time() + 86400:
        raise ValueError(f"'since' is {_short(since)}, not a time stamp")
    gpus = data.get("gpus", [])
    if not isinstance(gpus, list) or len(gpus) > 1024:
        raise ValueError(f"'gpus' is {_short(gpus)}, not a list of GPU indices")
    indices = tuple(_bounded_int({"gpus": g}, "gpus", 0, _MAX_INDEX) for g in gpus)
    workers = data.get("workers", [])
    if not isinstance(workers, list) or len(workers) > 256:
        raise ValueError(f"'workers' is {_short(workers)}, not a list of owner tags")
    tags = tuple(_bounded_str({"workers": w}, "workers", 200, printable=True) for w in workers)
    namespace = _bounded_str(data, "namespace", 200, printable=True)
    if not NAMESPACE_RE.match(namespace):
        raise ValueError(f"'namespace' is {_short(namespace)}, not a lease namespace")
    record = HolderRecord(
        pid=_bounded_int(data, "pid", 1, PID_MAX),
        hostname=_bounded_str(data, "hostname", 255, printable=True),
        holder=_bounded_str(data, "holder", 4096),
        since=float(since),
        uuid=_bounded_str(data, "uuid", 256),
        memory_mib=_bounded_int(data, "memory_mib", 0, _MAX_MIB),
        index=_bounded_int(data, "index", 0, _MAX_INDEX),
        namespace=namespace,
        gpus=indices,
        workers=tags,
    )
    named = _RECORD_NAME_RE.match(path.name)
    if named and (named["namespace"], int(named["index"])) != (record.namespace, record.index):
        raise ValueError(f"it names GPU {record.index} of {record.namespace!r}, not the GPU its file name says")
    return record


def inspect_holder_record(path: Path) -> tuple[HolderRecord | None, str | None]:
    """``(record, None)`` for a record that can be trusted, ``(None, None)`` when there is none, and
    ``(None, why)`` when what lies at ``path`` cannot be trusted: not a regular file (a directory, a symlink,
    a FIFO), larger than :data:`MAX_RECORD_BYTES`, not JSON, nested, or a field out of its range (a pid of
    ``1e999`` or ``-5``, a GPU index of ``1e999``). Never follows a symlink, never blocks on a FIFO, never
    raises for what the file holds."""
    from ..state import read_bounded

    raw, why = read_bounded(path, MAX_RECORD_BYTES)
    if raw is None:
        return None, why and why.replace(f"larger than {MAX_RECORD_BYTES}", "far larger than a holder record")
    if not raw.strip():
        return None, "is empty"
    try:
        return _parse_record(raw, path), None
    except (ValueError, TypeError, KeyError) as exc:
        return None, str(exc)


def read_holder_record(path: Path, *, only_live: bool = True) -> HolderRecord | None:
    """The record at ``path``; ``None`` if missing, untrusted (see :func:`inspect_holder_record`), or
    (``only_live``) its process is gone."""
    record, _ = inspect_holder_record(path)
    if record is None:
        return None
    if only_live:
        try:
            alive = process_alive(record.pid, record.since, record.hostname)
        except (ValueError, OverflowError, OSError):
            return None
        if not alive:
            return None
    return record


def lock_is_held(path: Path) -> bool:
    """Whether some process holds the ``flock`` of the lock file ``path`` (our own process included: a lock
    is per open file, so our own leases count as held). A missing or unusable file is not held. The probe
    takes a shared lock for an instant; it never creates the file."""
    import fcntl

    from ..state import in_dir

    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        dir_fd, name = in_dir(path)
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


_TEMP_RE = re.compile(r"^(?:\.gpu-.+\.json\.(?P<pid>[0-9]{1,7})-[0-9a-f]+|gpu-.+\.json\.(?P<old>[0-9]{1,7}))\.tmp$")



def unlocked_count(lock_dir: Path, namespace: str, indices: Sequence[int], enough: int) -> int:
    """How many of the GPUs ``indices`` have their lock free this moment (counted up to ``enough``): a probe, any
    thread."""
    free = 0
    for index in indices:
        free += not lock_is_held(gpu_lock_path(lock_dir, namespace, index))
        if free >= enough:
            break
    return free

def remove_dead_temporaries(lock_dir: Path) -> None:
    """Remove the temporary record files whose writer died between creating and renaming them (SIGKILL)."""
    import psutil

    try:
        paths = [p for p in lock_dir.iterdir() if p.name.endswith(".tmp")]
    except OSError:
        return
    for path in paths:
        named = _TEMP_RE.match(path.name)
        if named is None:
            continue
        pid = plausible_pid(named["pid"] or named["old"] or "")
        if pid is not None and psutil.pid_exists(pid) and pid != os.getpid():
            continue
        if pid == os.getpid():
            continue  # ours: being written right now
        if path.is_file() and not path.is_symlink():
            remove_own_entry(path)  # another user's temporary file is theirs


def write_holder_record(path: Path, record: HolderRecord) -> None:
    """Write ``record`` to ``path`` as JSON, atomically; ``OSError`` if it cannot be written there."""
    from ..state import atomic_write

    payload: dict[str, Any] = {
        "pid": record.pid,
        "hostname": record.hostname,
        "holder": record.holder,
        "since": record.since,
        "uuid": record.uuid,
        "memory_mib": record.memory_mib,
        "index": record.index,
        "namespace": record.namespace,
        "gpus": list(record.gpus),
    }
    if record.workers:
        payload["workers"] = list(record.workers)
    # 0644 whatever the umask, never through a planted file or symlink, never seen half-written.
    atomic_write(path, json.dumps(payload, indent=1), mode=0o644)


def dead_holder_leftovers(
    lock_dir: Path, namespace: str, group: Sequence[int]
) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Workers still running on GPUs of ``group`` whose lease holder died without releasing the lease.

    The kernel drops a dead holder's ``flock`` at once, but the engine it launched lives on until the
    holder's session watchdog (or the next session's janitor) ends it, which may take the engine's whole
    SIGTERM grace: the GPU must not be handed out meanwhile. Only a clean release removes the holder record,
    so a record whose process is gone names the dead holder; its workers carry ``SGLWORKER_OWNER=<pid>-...``.
    Cheap when nobody died: the process table is scanned only for such stale records.
    """
    result: dict[int, tuple[int, tuple[int, ...]]] = {}
    for index in group:
        record = read_holder_record(holder_record_path(lock_dir, namespace, index), only_live=False)
        if record is None or record.hostname != hostname():
            continue
        if process_alive(record.pid, record.since, record.hostname):
            continue
        pids = holder_leftover_pids(record)
        if pids:
            result[index] = (record.pid, pids)
    return result


def holder_leftover_pids(record: HolderRecord) -> tuple[int, ...]:
    """The live worker processes a (dead) holder leaves behind: those of its own session
    (:func:`session_worker_pids`) and those its record names by owner tag (``workers``: a warm keeper's)."""
    pids = set(session_worker_pids(record.pid, record.since))
    for tag in record.workers:  # a whole tag, or a session id followed by ":" (a warm keeper's whole group)
        found = find_session_processes(tag[:-1]) if tag.endswith(":") else find_tagged_processes(tag)
        pids.update(p.pid for p in found)
    return tuple(sorted(pids))
