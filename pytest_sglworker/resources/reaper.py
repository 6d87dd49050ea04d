"""Nothing the plugin starts outlives the session, even when pytest itself is SIGKILLed.

Plain Python: no pytest here. Two lines of defence beyond normal teardown:

- a **watchdog** process per session (``python -m pytest_sglworker.resources.reaper``), started with the first worker.
  It blocks reading a pipe whose only write end the session holds; when the session exits by any means,
  SIGKILL included, the kernel closes that end, the read returns, and the watchdog kills every process
  carrying the session's environment marker;
- a **janitor** run by the next session: it finds workers whose session is gone (the marker names the
  session's pid), stale lease records, and logs past the retention age, and cleans them, saying what it
  reaped; and it ends the warm groups (``--sgl-keep-warm``) whose keeper is gone or did not end them at their
  TTL (:func:`~.warm.reap_warm`).

A warm worker's owner tag names its keeper's session, not the pytest process that launched it (see
:mod:`.warm`): while the keeper lives, neither the watchdog nor any janitor takes it for an orphan.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .processes import (
    OWNER_ENV,
    SESSION_ID,
    find_session_processes,
    hostname,
    process_alive,
    tag_session_pid,
    tagged_sessions,
    terminate_tree,
)
from .retention import KEEP_SECONDS

LOG_RETENTION_SECONDS = KEEP_SECONDS  # the age at which a kept log goes (retention.py)


@dataclass
class JanitorReport:
    processes: list[int] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)
    warm: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.logs or self.records or self.warm)

    def __str__(self) -> str:
        parts = []
        if self.warm:
            parts.append(f"ended {len(self.warm)} warm worker group(s): {'; '.join(self.warm)}")
        if self.processes:
            parts.append(f"killed {len(self.processes)} worker process(es) of dead sessions "
                         f"(pids {', '.join(map(str, self.processes))})")
        if self.records:
            parts.append(f"removed {len(self.records)} GPU lease record(s) of dead sessions "
                         f"({', '.join(self.records)})")
        if self.logs:
            parts.append(f"removed {len(self.logs)} worker log(s) older than "
                         f"{LOG_RETENTION_SECONDS // 86400} days")
        return "; ".join(parts)


def remove_stale_holder_records(lock_dir: Path, *, session_pid: int | None = None) -> list[str]:
    """Remove GPU holder records (``gpu-*.json``) left by a dead process (only ``session_pid``'s, if given).

    A record is removed only when its writer is gone, no worker of that writer's session still runs (until
    then the record is what keeps the GPU from being handed out, see ``gpus.holders.dead_holder_leftovers``) and
    the GPU's lock is free; it is removed while holding that lock, so a live holder's record is never touched.
    Only this user's records: another user's is theirs, whatever it says (their own watchdog and janitor remove
    it), and is never even a reason to look at processes.
    """
    from .gpus.holders import holder_leftover_pids, read_holder_record
    from .lockfiles import LockFile
    from .owned_files import entry_problem, remove_own_entry

    removed: list[str] = []
    if not lock_dir.is_dir():
        return removed
    for path in sorted(lock_dir.glob("gpu-*.json")):
        if entry_problem(path) is not None:
            continue  # another user's (or a directory): never ours to remove
        record = read_holder_record(path, only_live=False)
        if record is None or record.hostname != hostname() or (session_pid is not None and record.pid != session_pid):
            continue
        if process_alive(record.pid, record.since, record.hostname) or holder_leftover_pids(record):
            continue
        lock = LockFile(path.with_suffix(".lock"))
        try:
            if not lock.acquire():
                continue
        except OSError:
            continue
        try:
            if read_holder_record(path, only_live=False) == record and remove_own_entry(path) is None:
                removed.append(path.name)
        except OSError:
            pass
        finally:
            lock.release()
    return removed


def reap_dead_sessions(log_dir: Path | None = None, *, lock_dir: Path | None = None,
                       retention: float = LOG_RETENTION_SECONDS) -> JanitorReport:
    """Kill workers of sessions whose pytest process is gone; remove their GPU holder records from
    ``lock_dir`` and old logs from ``log_dir``."""
    import psutil

    from .warm import reap_warm

    report = JanitorReport()
    if lock_dir is not None:
        with contextlib.suppress(Exception):  # the janitor never stops a session from starting
            report.warm = reap_warm(lock_dir)
    for session, procs in tagged_sessions().items():
        pid = tag_session_pid(session)
        if session == SESSION_ID or pid is None or (psutil.pid_exists(pid) and _is_pytest_like(pid)):
            continue
        report.processes += sorted(p.pid for p in procs)
        terminate_tree(None, lambda procs=procs: [p for p in procs if p.is_running()],  # type: ignore[misc]
                       term_timeout=5.0, kill_timeout=5.0)
    if lock_dir is not None:
        report.records = remove_stale_holder_records(lock_dir)
    if log_dir is not None and log_dir.is_dir():
        cutoff = time.time() - retention
        for path in log_dir.glob("sglang-worker-*.log"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    report.logs.append(str(path))
    return report


def _is_pytest_like(pid: int) -> bool:
    """The pid of a dead session may have been reused by an unrelated process."""
    import psutil

    try:
        return OWNER_ENV not in psutil.Process(pid).environ() and psutil.Process(pid).is_running()
    except psutil.Error:
        return False


class Watchdog:
    """The session's watchdog process; :meth:`close` at normal session end."""

    def __init__(self, session_id: str = SESSION_ID, *, lock_dir: Path | None = None) -> None:
        read_end, self._write_end = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pytest_sglworker.resources.reaper", session_id,
                 *([str(lock_dir)] if lock_dir else [])],
                stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True,
                env={k: v for k, v in os.environ.items() if k != OWNER_ENV},
            )
        finally:
            os.close(read_end)
        os.set_inheritable(self._write_end, False)

    def close(self, timeout: float = 15.0) -> None:
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m pytest_sglworker.resources.reaper SESSION_ID [LOCK_DIR]  (reads stdin until EOF)",
              file=sys.stderr)
        return 2
    session_id = args[0]
    lock_dir = Path(args[1]) if len(args) == 2 else None
    if lock_dir is not None:
        from .state import pin_directory

        pin_directory(lock_dir)  # what its session checked, opened now: never followed elsewhere later
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(4096):
            pass
    # The session is gone (or closed its end after its own teardown): kill whatever still carries its tag.
    terminate_tree(None, lambda: find_session_processes(session_id), term_timeout=10.0, kill_timeout=10.0)
    # A session that died (SIGKILL, os._exit) left its GPU holder records: the kernel dropped its locks, the
    # records say who held the GPUs until its workers were gone, which they now are.
    session_pid = tag_session_pid(session_id)
    if lock_dir is not None and session_pid is not None:
        with contextlib.suppress(Exception):
            remove_stale_holder_records(lock_dir, session_pid=session_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
