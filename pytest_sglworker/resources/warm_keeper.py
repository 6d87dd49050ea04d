"""The keeper of one worker group that may be kept warm (``--sgl-keep-warm``): ``python -m
pytest_sglworker.resources.warm_keeper LOCK_DIR ID``, started by the session *before* the group's members, which
carry its session id (``ID``, ``<keeper pid>-<random>``) in their owner tags instead of the pytest process's.

Plain Python, no pytest; the protocol (records, claims, ending) is :mod:`.warm`. Its stdin is one end of a socket
pair whose other end only the session holds (:class:`KeeperHandle`). The keeper lives in two phases:

- **attached**, while the session uses the group: it waits on the socket. End of file (the session retired the
  group, or died by any means, SIGKILL included) ends everything its session id tags (what the session watchdog
  does for the session's own processes) and the keeper exits. A ``keep`` message, which carries the group's GPU and
  port lock descriptors (``SCM_RIGHTS``: the same open files, so the same flocks), is the hand-over: the keeper
  checks its record (state ``handover``, its own id, kept by its parent), rewrites the GPUs' holder records under
  its own pid (naming its session, for the dead-holder guard should it die), writes itself into the record (state
  ``warm``) and answers ``ok``; the session then forgets its own copies of the locks and may end;
- **warm**: every :data:`POLL` seconds (or sooner, at the expiry) it ends the group (:func:`.warm.end_members`, its
  holder records, its logs by their policy, its record and claim file, then exits, which unlocks the GPUs and
  ports) when: its TTL ran out; a member died while warm; another process waits for a GPU lease of its namespace
  or a port block (a warm group gives way, as an idle pooled one does); its record is gone (the lock directory
  was wiped) or names another keeper; its adopter died without handing it back; SIGTERM (``pytest --sgl-warm
  stop``, the janitor, an adopter ending it). A record in state ``stop`` means the claim's holder ends the group:
  the keeper waits until its members are gone and lets go. It holds, as soon as it can, a shared flock on the
  ``.lock`` of the session log directory the group logs into, so log retention never removes it meanwhile.

It runs in a session of its own, without an owner tag, with :data:`.warm.KEEPER_ENV` naming its group (how
:func:`.warm.keeper_alive` proves it is the keeper). Because the members' tags name its session, every janitor
(this version's and older ones) takes them for the processes of a live session while it lives, and for orphans to
reap once it is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from .owned_files import remove_own_entry
from .processes import OWNER_ENV, find_session_processes, hostname, terminate_tree
from .warm import Claim, claim_blocked, end_members, members_alive, note_in_logs, remove_holder_records, remove_logs
from .warm_records import (
    KEEPER_ENV,
    Party,
    WarmRecord,
    adopter_alive,
    read_warm_record,
    record_path,
    run_alive,
    write_warm_record,
)

__all__ = ["ACK_TIMEOUT", "POLL", "KeeperHandle", "main"]

#: how often a warm keeper looks at its group (and the most its TTL can be overrun by, before the teardown itself)
POLL = 0.2
#: how long a session waits for its keeper's answer to a hand-over before it ends the group itself
ACK_TIMEOUT = 15.0
#: the most lock descriptors one hand-over carries (GPUs and port blocks of one group)
MAX_FDS = 250


class KeeperHandle:
    """The session's end of a keeper: started before a group's members (:meth:`start`), their owner tags name
    :attr:`session_id`. :meth:`hand_over` gives it the group's lock descriptors at the session's end;
    :meth:`close` lets it go (it ends whatever its session id still tags, then exits)."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket, session_id: str) -> None:
        self.process = process
        self._sock: socket.socket | None = sock
        self.session_id = session_id

    @classmethod
    def start(cls, lock_dir: Path, environ: Mapping[str, str]) -> KeeperHandle:
        """Start a keeper (``environ``: the environment snapshot the session's main thread made)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        suffix = uuid.uuid4().hex[:8]
        env = {k: v for k, v in environ.items() if k != OWNER_ENV}
        try:
            # The session id names the keeper's pid, which Popen only knows afterwards: the keeper gets the suffix
            # and makes its id itself; the session makes the same one from the pid Popen returns.
            env[KEEPER_ENV] = suffix
            process = subprocess.Popen(
                [sys.executable, "-m", "pytest_sglworker.resources.warm_keeper", str(lock_dir), suffix],
                stdin=theirs.fileno(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                close_fds=True, env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(process, ours, f"{process.pid}-{suffix}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def hand_over(self, fds: Sequence[int], timeout: float | None = None) -> str | None:
        """Send the group's lock descriptors (its record is written, state ``handover``) and wait for the keeper's
        answer (``timeout``: :data:`ACK_TIMEOUT`, read when called). None when it took the group over, else why
        not."""
        if self._sock is None:
            return "its keeper was let go already"
        try:
            socket.send_fds(self._sock, [b"keep\n"], list(fds))
            self._sock.settimeout(ACK_TIMEOUT if timeout is None else timeout)
            answer = self._sock.recv(4096).decode("utf-8", errors="replace").strip()
        except (OSError, TimeoutError) as exc:
            # A keeper that does not answer (frozen, wedged) may still hold the descriptors it was sent: it is
            # killed, so that it neither keeps the locks nor lingers stopped forever.
            self.kill()
            return f"its keeper (pid {self.pid}) did not answer ({type(exc).__name__}: {exc}); killed it"
        if answer == "ok":
            return None
        return f"its keeper (pid {self.pid}) refused: {answer or 'no answer (it exited)'}"

    def close(self, *, wait: float = 30.0) -> None:
        """Let the keeper go: it ends whatever its session id still tags (nothing, after a clean retirement) and
        exits. After a hand-over it stays: the group is warm."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def reap(self, timeout: float = 0.0) -> bool:
        """Whether the keeper has exited (waited for up to ``timeout``)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        return self.process.poll() is not None

    def kill(self) -> None:
        self.close()
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


class _Keeper:
    def __init__(self, lock_dir: Path, wid: str, sock: socket.socket) -> None:
        import psutil

        self.lock_dir = lock_dir
        self.id = wid
        self.sock = sock
        self.fds: list[int] = []
        self.me = Party(os.getpid(), psutil.Process().create_time(), session=f"keeper {wid}")
        self.stop_requested = False
        self.log_dir_fd: int | None = None
        #: the session that started it (its parent until it dies)
        self.session_pid = os.getppid()

    def on_term(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True

    # -- attached ---------------------------------------------------------------------------------------------
    def attached(self) -> WarmRecord | None:
        """Wait for the session: the record once it handed the group over, None at end of file."""
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.sock, 4096, MAX_FDS)
            except InterruptedError:
                continue
            except OSError:
                message, fds = b"", []
            if not message:
                for fd in fds:
                    os.close(fd)
                return None
            self.fds += fds
            record, why = self.acknowledge()
            with contextlib.suppress(OSError):
                self.sock.sendall(b"ok\n" if record is not None else f"{why}\n".encode())
            if record is not None:
                return record
            for fd in self.fds:  # refused: the session retires the group itself, with its own copies
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.fds = []

    def acknowledge(self) -> tuple[WarmRecord | None, str]:
        from .gpus.holders import HolderRecord, holder_record_path, read_holder_record, write_holder_record

        entry = read_warm_record(record_path(self.lock_dir, self.id))
        record = entry.mine
        if record is None:
            return None, f"its warm record {entry.problem or 'belongs to another user'}"
        if record.state != "handover" or record.kept_by.pid != os.getppid():
            return None, f"its warm record is in state {record.state}, kept by pid {record.kept_by.pid}"
        until = time.strftime("%H:%M:%S", time.localtime(record.expires_at))
        holder = f"warm {record.label} (kept warm until {until}; pytest --sgl-warm stop ends it)"
        try:
            for index, uuid_ in zip(record.gpus, record.gpu_uuids, strict=False):
                path = holder_record_path(self.lock_dir, record.namespace, index)
                old = read_holder_record(path, only_live=False)
                write_holder_record(path, HolderRecord(
                    pid=self.me.pid, hostname=hostname(), holder=holder, since=time.time(),
                    uuid=old.uuid if old else uuid_, memory_mib=record.memory_mib, index=index,
                    namespace=record.namespace, gpus=record.gpus, workers=(f"{self.id}:",)))
            record = replace(record, state="warm", keeper=self.me)
            write_warm_record(self.lock_dir, record)
        except OSError as exc:
            return None, f"cannot write its records ({exc.strerror or exc})"
        return record, ""

    # -- warm -------------------------------------------------------------------------------------------------
    def hold_log_dir(self, record: WarmRecord) -> None:
        """A shared flock on the session log directory's ``.lock``: retention then never removes the directory
        (it takes that lock exclusively, without waiting, before it removes one). Tried until it is held: the
        session that made the directory holds it exclusively until it ends."""
        import fcntl

        if self.log_dir_fd is not None or record.log_dir is None:
            return
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(Path(record.log_dir) / ".lock", flags)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return
        self.log_dir_fd = fd

    def why_end(self, record: WarmRecord) -> str | None:
        """Why a warm (not adopted) group must end now, or None."""
        from .processes import AdoptedProcess
        from .waiters import lease_waiting_prefix, live_waiters, others_waiting_for_ports

        if not run_alive(record):
            return f"the run that published it (pid {record.run.pid if record.run else '?'}) ended"
        if time.time() >= record.expires_at:
            return (f"its TTL ran out (kept warm for {record.ttl:g} s after its last use, until "
                    f"{time.strftime('%H:%M:%S', time.localtime(record.expires_at))})")
        if not members_alive(record):
            dead = [m.pid for m in record.members if AdoptedProcess(m.pid, m.since).poll() is not None]
            return f"member pid {', '.join(map(str, dead))} exited while warm"
        if live_waiters(self.lock_dir, lease_waiting_prefix(record.namespace)) or \
                others_waiting_for_ports(self.lock_dir):
            return "another process waits for a GPU lease or a port block: a warm group gives way"
        return None

    def warm(self, record: WarmRecord) -> int:
        while True:
            self.hold_log_dir(record)
            current = read_warm_record(record_path(self.lock_dir, self.id)).mine
            if self.stop_requested:
                return self.finish(current or record, None, "its keeper was asked to stop (SIGTERM)")
            if current is None:
                return self.finish(record, None, "its warm record is gone (was the lock directory wiped?)")
            if current.keeper is None or current.keeper.pid != self.me.pid:
                return self.finish(record, None, "its warm record names another keeper")
            record = current
            if record.state == "stop":
                return self.finish(record, None, None)  # the claim's holder ends it
            why: str | None = None
            if record.state == "adopted" and not adopter_alive(record):
                who = record.adopter.pid if record.adopter else "?"
                why = f"the session that adopted it (pid {who}) ended without handing it back"
            elif record.state == "warm":
                why = self.why_end(record)
            if why is not None:
                claim = Claim.take(self.lock_dir, self.id, wait=1.0 if record.state == "adopted" else 0.0)
                if claim is not None:
                    if claim.read() == record:
                        return self.finish(record, claim, why)
                    claim.release()
                else:
                    blocked = claim_blocked(self.lock_dir, self.id)
                    if blocked is not None:  # nobody of this user can hold it: nobody else ends the group
                        return self.finish(record, None, f"{why} ({blocked}: ended without it)")
            time.sleep(max(0.01, min(POLL, record.expires_at - time.time())))

    def finish(self, record: WarmRecord, claim: Claim | None, why: str | None) -> int:
        """End the group (what is left of it), its files, and let go of every lock by exiting."""
        try:
            if why is not None and record.state != "stop":
                note_in_logs(record, f"warm worker ended: {why}")
            with contextlib.suppress(Exception):
                end_members(record)
            with contextlib.suppress(Exception):
                self.sweep()
            with contextlib.suppress(Exception):
                remove_holder_records(self.lock_dir, replace(record, keeper=self.me))
            if record.state != "stop":
                with contextlib.suppress(Exception):
                    remove_logs(record)
                if claim is None:
                    claim = Claim.take(self.lock_dir, self.id, wait=2.0)
                if claim is None and claim_blocked(self.lock_dir, self.id) is not None:
                    remove_own_entry(record_path(self.lock_dir, self.id))  # nobody of ours can claim it
                if claim is not None:
                    claim.remove()
        finally:
            if claim is not None:
                claim.release()
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return 0

    def sweep(self) -> None:
        """End whatever its session id still tags (an escaped child of a member)."""
        terminate_tree(None, lambda: find_session_processes(self.id), term_timeout=10.0, kill_timeout=10.0)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        record = self.attached()
        if record is None:  # the session let it go, or died: what its session id tags goes with it
            self.sweep()
            with contextlib.suppress(Exception):  # a dead session's GPU holder records, now that its group is gone
                from .reaper import remove_stale_holder_records

                remove_stale_holder_records(self.lock_dir, session_pid=self.session_pid)
            return 0
        with contextlib.suppress(OSError):
            self.sock.close()
        return self.warm(record)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m pytest_sglworker.resources.warm_keeper LOCK_DIR SUFFIX  (stdin: the session's "
              "socket; started by pytest --sgl-keep-warm)", file=sys.stderr)
        return 2
    wid = f"{os.getpid()}-{args[1]}"
    try:
        sock = socket.socket(fileno=0)
    except OSError:
        print("stdin is not the session's socket", file=sys.stderr)
        return 2
    from .state import pin_directory

    pin_directory(args[0])  # the lock directory its session checked, opened once: never followed elsewhere later
    return _Keeper(Path(args[0]), wid, sock).run()


if __name__ == "__main__":
    sys.exit(main())
