"""Process ownership: how the plugin marks the processes it starts, finds them again, and ends them.

Plain Python, no pytest; ``psutil`` is imported lazily. This module is the one owner of the protocol; the
launcher, the GPU leases, the watchdog and the janitor call its public functions and never parse a tag
themselves.

The protocol
------------
- Every worker (and router) runs in a session of its own (``start_new_session=True``) with
  ``SGLWORKER_OWNER=<session id>:<worker id>`` in its environment (:data:`OWNER_ENV`, :func:`owner_tag`),
  inherited by its children. The session id is ``<pytest pid>-<random>`` (:data:`SESSION_ID`), so a later
  session can tell whose pytest is gone (:func:`tag_session_pid`).
- sglang's scheduler and detokenizer rename themselves (setproctitle), which overwrites their environment
  in ``/proc``: they are found as members of the worker's session instead (the worker root leads it,
  :func:`with_session_members`). A child that leaves the session keeps the tag.
- Only processes found this way are signalled, and only ours (same uid), each proven at the moment of the signal
  (:mod:`.pidrefs`): through a pidfd held from its launch (:class:`ChildProcess`) or its adoption
  (:class:`AdoptedProcess`), else by its pid, start time and uid read again just before. A process group is
  signalled whole only through its leader's pidfd or while its leader still holds its pid; otherwise each member
  is proven on its own. Nothing is matched by name.
- Teardown (:func:`terminate_tree`) signals the root first (sglang then stops its children cleanly), then
  the group and every collected process, then SIGKILLs what is left and waits until it is gone.
- A worker that may be kept warm (``--sgl-keep-warm``) carries the session id of its group's keeper instead of the
  pytest process's (see :mod:`.warm`): the keeper outlives the session, so no janitor takes the worker for an
  orphan while its keeper lives. A process another session started is handled through an
  :class:`AdoptedProcess` only after :func:`prove_process` proved it is the one its record names (pid, start
  time, owner tag).

Why one module of this size: it is the one owner of the ownership protocol (the tags, the scans that find
tagged processes and their sessions, the proofs, the listening-socket checks and the teardown), which the
launcher, the leases, the watchdog, the janitor and the warm keeper all follow; none of them parses a tag.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import struct
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from .pidrefs import ProcessRef, identity, started_before

if TYPE_CHECKING:
    import psutil

__all__ = [
    "OWNER_ENV",
    "PID_MAX",
    "SESSION_ID",
    "START_TIME_SLACK",
    "UNKNOWN_EXIT",
    "AdoptedProcess",
    "ChildProcess",
    "ProcessHandle",
    "ProcessRef",
    "end_process",
    "find_session_processes",
    "find_tagged_processes",
    "held_socket_inodes",
    "hostname",
    "is_owner_tag",
    "is_session_id",
    "listeners",
    "listening_inodes",
    "listening_pids",
    "owner_tag",
    "plausible_pid",
    "process_alive",
    "process_ref",
    "process_tree",
    "prove_process",
    "same_start",
    "session_worker_pids",
    "signal_proven",
    "socket_inodes",
    "tag_session",
    "tag_session_pid",
    "tagged_processes",
    "tagged_sessions",
    "terminate_tree",
    "with_session_members",
]

#: The environment variable that marks every process of a worker (inherited by its children).
OWNER_ENV = "SGLWORKER_OWNER"
#: This pytest process's session id: ``<pid>-<random>``.
SESSION_ID = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
#: Linux never hands out pids above 2**22 (``/proc/sys/kernel/pid_max`` is at most 4194304).
PID_MAX = 1 << 22
#: The exit status :class:`AdoptedProcess` reports once its process is gone: a process that is not our child
#: (a warm worker an earlier session started) cannot be waited for, so its exit status is never known. Not a
#: status a process can have (those are -64..255); :func:`signal_name` says so in words.
UNKNOWN_EXIT = 1 << 16


# ---------------------------------------------------------------------------------------------- tags


_SESSION_RE = re.compile(r"^[0-9]{1,7}-[0-9a-f]{8}$")
_TAG_RE = re.compile(r"^[0-9]{1,7}-[0-9a-f]{8}:[A-Za-z0-9_.-]{1,64}$")


def is_owner_tag(value: str) -> bool:
    """Whether ``value`` has the shape of a whole owner tag (``<pid>-<8 hex>:<worker id>``, the worker id never
    empty)."""
    return bool(_TAG_RE.match(value))


def is_session_id(value: str) -> bool:
    """Whether ``value`` has the shape of a session id (``<pid>-<8 hex>``)."""
    return bool(_SESSION_RE.match(value))


def owner_tag(session_id: str = SESSION_ID) -> str:
    """A new worker's tag: ``<session id>:<worker id>``."""
    return f"{session_id}:{uuid.uuid4().hex[:12]}"


def tag_session(tag: str) -> str:
    """The session id of a tag (``"4242-ab12cd34"`` of ``"4242-ab12cd34:9f..."``)."""
    return tag.split(":", 1)[0]


def tag_session_pid(tag: str) -> int | None:
    """The pid of the pytest process that made a tag (or a session id), or None for a malformed one."""
    head = tag_session(tag).split("-", 1)[0]
    return int(head) if head.isdigit() else None


def signal_name(returncode: int | None) -> str:
    """``"code -9 (SIGKILL)"`` / ``"code 1"``."""
    if returncode is None:
        return "no exit code"
    if returncode == UNKNOWN_EXIT:
        return "an exit code nobody can know (not a child of this process: an adopted warm worker)"
    if returncode < 0:
        try:
            return f"code {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"code {returncode}"
    return f"code {returncode}"


def plausible_pid(text: str) -> int | None:
    """The pid ``text`` (the end of a file name) spells, if it is a plausible one (never a 1e999 or a 40-digit
    number)."""
    if not text.isdigit() or len(text) > 7:
        return None
    pid = int(text)
    return pid if 0 < pid <= PID_MAX else None


def hostname() -> str:
    import socket

    return socket.gethostname()


# ---------------------------------------------------------------------------------------------- scanning


def tagged_processes() -> list[tuple[psutil.Process, str]]:
    """Every process of ours (same uid, not this one) that carries :data:`OWNER_ENV`, with its value."""
    import psutil

    found: list[tuple[psutil.Process, str]] = []
    me = os.getpid()
    uid = os.getuid()
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.pid == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            value = proc.environ().get(OWNER_ENV)
        except (psutil.Error, OSError):
            continue
        if value:
            found.append((proc, value))
    return found


def with_session_members(procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` plus every process whose session is led by one of them (a worker root leads its session)."""
    import psutil

    leaders = {p.pid for p in procs}
    found = {p.pid: p for p in procs}
    if not leaders:
        return procs
    uid = os.getuid()
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.pid in found or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if os.getsid(proc.pid) in leaders:
                found[proc.pid] = proc
        except (OSError, psutil.Error):
            continue
    return list(found.values())


def find_tagged_processes(tag: str) -> list[psutil.Process]:
    """Our processes whose tag is exactly ``tag``, with the members of the sessions they lead. A tag is matched
    whole, never as a prefix: a record that names ``"<session id>:"`` (or any other part of a tag) finds nothing
    (:func:`find_session_processes` is the one way to ask for a whole session)."""
    if not is_owner_tag(tag):
        return []
    return with_session_members([proc for proc, value in tagged_processes() if value == tag])


def find_session_processes(session_id: str) -> list[psutil.Process]:
    """Our processes whose tag names session ``session_id`` exactly (any worker of it), with the members of the
    sessions they lead."""
    if not _SESSION_RE.match(session_id):
        return []
    return with_session_members([proc for proc, value in tagged_processes() if tag_session(value) == session_id])


def tagged_sessions() -> dict[str, list[psutil.Process]]:
    """Our tagged processes (and their session members) grouped by session id."""
    groups: dict[str, list[psutil.Process]] = {}
    for proc, value in tagged_processes():
        groups.setdefault(tag_session(value), []).append(proc)
    return {session: with_session_members(procs) for session, procs in groups.items()}


def process_tree(root_pid: int, tag: str | None = None, *, sweep: bool = True,
                 ref: ProcessRef | None = None) -> list[psutil.Process]:
    """The root and every descendant; with ``sweep``, also every process of ours (same uid) in the session the
    root leads and every process carrying ``tag`` (a child that left the session).

    ``ref`` proves the root (:class:`ChildProcess`, :class:`AdoptedProcess`; without it, the process that has
    ``root_pid`` now, if ours): the root and its descendants are taken only while it still holds its pid, and a
    member of its session only while it does, or when the member started before the root was last seen holding
    it (the session's number may have been reused since: its new members started after)."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    own = ref if ref is not None else ProcessRef.prove(root_pid)
    uid = own.ident.uid if own is not None else os.getuid()
    held = own is not None and own.held()
    if held:
        try:
            root = psutil.Process(root_pid)
            procs[root.pid] = root
            for child in root.children(recursive=True):
                procs[child.pid] = child
        except psutil.Error:
            pass
    if sweep and own is not None:
        for proc in psutil.process_iter(["pid", "uids"]):
            try:
                if proc.info["uids"] is None or proc.info["uids"].real != uid:
                    continue
                if os.getsid(proc.pid) == root_pid:
                    procs.setdefault(proc.pid, proc)
            except (OSError, psutil.Error):
                continue
    if own is not None and not own.held():  # not (or no longer) held: only what started while it was
        procs = {pid: proc for pid, proc in procs.items() if _started_before(pid, own)}
    if sweep and tag is not None:
        for proc in find_tagged_processes(tag):
            procs.setdefault(proc.pid, proc)
    return list(procs.values())


def _started_before(pid: int, ref: ProcessRef) -> bool:
    ident = identity(pid)
    return ident is not None and started_before(ident, ref.last_held)


# The kernel's answer to "who listens on this port", without reading its whole TCP table: psutil's
# ``net_connections`` reads ``/proc/net/tcp`` and ``tcp6``, and every read of those makes the kernel walk its
# whole TCP hash table (milliseconds on a busy machine, twice per process and per call), which was most of the
# time between an engine's ready line and the fixture's return. One ``SOCK_DIAG_BY_FAMILY`` netlink dump per
# address family, filtered to state LISTEN (what ``ss -l`` sends), walks only the listening hash.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN = 10
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def listening_inodes(port: int) -> set[int] | None:
    """The inodes of the sockets that LISTEN on TCP ``port`` (any address, IPv4 and IPv6), from the kernel's
    sock_diag netlink interface, else one read of ``/proc/net/tcp`` and ``tcp6``; None where neither exists
    (not Linux: ask :func:`listening_pids`)."""
    try:
        found: set[int] = set()
        for family in (socket.AF_INET, socket.AF_INET6):
            found |= _diag_listeners(family, port)
        return found
    except (OSError, AttributeError, struct.error):  # no AF_NETLINK, or the request refused
        return _table_listeners(port)


def _diag_listeners(family: int, port: int) -> set[int]:
    """One dump of the TCP sockets in state LISTEN of ``family`` (``struct inet_diag_req_v2``, bounded)."""
    sockid = struct.pack("!HH", port, 0) + bytes(32) + struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN) + sockid
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    found: set[int] = set()
    deadline = time.monotonic() + 2.0
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(2.0)
        sock.sendall(header + request)
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return found
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR or length < 16:
                    raise OSError("sock_diag refused the request")
                body = offset + 16  # struct inet_diag_msg: state at 1, source port at 4, inode at 68
                if len(data) >= body + 72 and data[body + 1] == _TCP_LISTEN:
                    (sport,) = struct.unpack_from("!H", data, body + 4)
                    (inode,) = struct.unpack_from("=I", data, body + 68)
                    if sport == port:
                        found.add(inode)
                offset += (length + 3) & ~3
    raise OSError("sock_diag answered past its deadline")


def _table_listeners(port: int) -> set[int] | None:
    suffix = f":{port:04X}"
    found: set[int] = set()
    readable = False
    for table in _TCP_TABLES:
        try:
            with open(table) as fh:
                readable = True
                next(fh, None)
                for line in fh:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == "0A" and fields[1].endswith(suffix):  # 0A: LISTEN
                        found.add(int(fields[9]))
        except OSError:
            continue
    return found if readable else None


def held_socket_inodes(pid: int, wanted: Iterable[int]) -> set[int]:
    """Which of the socket inodes ``wanted`` process ``pid`` holds among its fds (``socket:[inode]`` links)."""
    links = {f"socket:[{inode}]": inode for inode in wanted}
    held: set[int] = set()
    if not links:
        return held
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return held
    for fd in fds:
        try:
            inode = links.get(os.readlink(f"{fd_dir}/{fd}"))
        except OSError:
            continue
        if inode is not None:
            held.add(inode)
    return held


def listening_pids(procs: Iterable[psutil.Process], port: int) -> list[int]:
    """The pids among ``procs`` that listen on TCP ``port``."""
    import psutil

    found = []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.Error, OSError):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            found.append(proc.pid)
    return found


def socket_inodes(pid: int, port: int | None = None) -> set[int]:
    """The inodes of the TCP sockets ``pid`` holds (LISTEN on ``port`` only, when given), read from its fds."""
    import psutil

    inodes: set[int] = set()
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return inodes
    for conn in conns:
        if port is not None and not (conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port):
            continue
        if conn.fd is None or conn.fd < 0:
            continue
        try:
            link = os.readlink(f"/proc/{pid}/fd/{conn.fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[len("socket:["):-1]))
    return inodes


def listeners(ports: Iterable[int]) -> dict[int, list[int]]:
    """``{pid: [ports]}`` of our processes (same uid) that LISTEN on any of ``ports``. The kernel is asked first
    which of the ports anything listens on (:func:`listening_inodes`): where none is, every process's sockets are
    not read (that walk took 0.1-0.35 s of each teardown beside a Ray cluster's processes on 2 CPUs)."""
    import psutil

    wanted = set()
    for port in set(ports):
        inodes = listening_inodes(port)
        if inodes is None:  # the kernel cannot be asked: every port is looked for
            wanted = set(ports)
            break
        if inodes:
            wanted.add(port)
    if not wanted:
        return {}
    found: dict[int, list[int]] = {}
    uid = os.getuid()
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            conns = proc.net_connections(kind="tcp")
        except (psutil.Error, OSError):
            continue
        hits = sorted({c.laddr.port for c in conns
                       if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in wanted})
        if hits:
            found[proc.pid] = hits
    return found


def end_process(pid: int, timeout: float = 10.0) -> bool:
    """SIGKILL one process of ours we identified, by pid, and wait (bounded) until it is gone. True if gone. It is
    held (:class:`ProcessRef`) from before the kill: the wait is for it, the kill reaches no other process."""
    ref = ProcessRef.prove(pid)
    if ref is None:
        return identity(pid) is None
    try:
        ref.signal(signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while ref.running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True
    finally:
        ref.close()


def process_alive(pid: int, since: float, host: str) -> bool:
    """Whether the process that wrote a record at ``since`` (epoch seconds) on ``host`` still runs; a reused
    pid of a younger process does not count. On another host it cannot be told: True."""
    if host != hostname():
        return True
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return process.create_time() <= since + 2.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def session_worker_pids(session_pid: int, since: float) -> tuple[int, ...]:
    """Live processes of the workers of the (dead) pytest process ``session_pid``, which leased at ``since``:
    those tagged with its session, and the members of their sessions (sglang's renamed children)."""
    import psutil

    prefix = f"{session_pid}-"
    try:  # a process with that pid created after the lease reused it: its own workers are not leftovers
        created = psutil.Process(session_pid).create_time()  # (the dead holder itself, as a zombie, is not)
        reused_at: float | None = created if created > since + 2.0 else None
    except psutil.Error:
        reused_at = None
    found = []
    for proc in with_session_members([p for p, value in tagged_processes() if value.startswith(prefix)]):
        try:
            if reused_at is None or proc.create_time() < reused_at:
                found.append(proc.pid)
        except psutil.Error:
            continue  # gone meanwhile
    return tuple(sorted(found))


# ---------------------------------------------------------------------------------------------- handles


class ProcessHandle(Protocol):
    """What teardown and the readiness wait need of a process: a ``subprocess.Popen`` of one we started, or an
    :class:`AdoptedProcess` of one an earlier session started."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


#: How far two readings of one process's start time may differ. psutil adds the kernel's boot time (``btime`` of
#: ``/proc/stat``, whole seconds, worked out anew at each read from the wall clock less the uptime) to the start
#: ticks, so one process read twice can differ by a second; a pid reused within a second and a half of its last
#: holder's start would need the kernel to hand out every pid (``pid_max``) in that time.
START_TIME_SLACK = 1.5


def same_start(a: float, b: float) -> bool:
    """Whether two start times read from psutil name the same process start (see :data:`START_TIME_SLACK`)."""
    return abs(a - b) <= START_TIME_SLACK


class ChildProcess(subprocess.Popen[bytes]):
    """A ``subprocess.Popen`` that holds a :class:`ProcessRef` of its child from the moment it started (a pidfd
    where the kernel gives one): its signals reach that child only, never a process that got its pid after it
    was reaped (by this handle, or by another thread's ``waitpid``). Each :meth:`poll` that finds it running
    asks the ref whether it still holds its pid (the moment is what proves the members of its group,
    :meth:`ProcessRef.member`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ref: ProcessRef | None = ProcessRef.child(self.pid)

    def poll(self) -> int | None:
        code = super().poll()
        if code is None and self.ref is not None:  # (``waitpid`` of a pid reused by another child answers too)
            self.ref.held()
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        if self.ref is None:
            super().send_signal(sig)
        else:
            self.ref.signal(sig)


class AdoptedProcess:
    """A handle on a process that is not our child (a warm worker kept by an earlier session), shaped like the
    parts of ``subprocess.Popen`` the plugin uses: it is proven at construction by its pid, its start time, its
    uid (ours) and, given ``tag``, its owner tag, and then held (:class:`ProcessRef`: a pidfd where the kernel
    gives one), so a pid the kernel reused is never signalled; :meth:`poll` is None while it runs and
    :data:`UNKNOWN_EXIT` once it is gone (a zombie counts as gone: its parent reaps it, not us). A process that
    cannot be proven is gone from the start."""

    def __init__(self, pid: int, create_time: float, *, tag: str | None = None) -> None:
        self._pid = pid
        self.create_time = create_time
        self.returncode: int | None = None
        self.ref: ProcessRef | None = self._prove(tag)

    def _prove(self, tag: str | None) -> ProcessRef | None:
        import psutil

        ref = ProcessRef.prove(self._pid)
        if ref is None:
            return None
        started = psutil.boot_time() + ref.ident.start / _clock_ticks()  # psutil's create_time of that start
        if not same_start(started, self.create_time):
            return None  # (a ref dropped closes its pidfd)
        if tag is not None and (prove_process(self._pid, self.create_time, tag) is not None or not ref.held()):
            return None  # not that tag, or the pid changed hands while it was read
        return ref  # a zombie is proven, and gone at once (poll)

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None and (self.ref is None or not self.ref.running()):
            self.returncode = UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self._pid}", timeout or 0.0)
            time.sleep(0.02)
        return UNKNOWN_EXIT

    def send_signal(self, sig: int) -> None:
        """Signal the process, only while it is provably the one this handle was proven on (a zombie's signal is
        lost: nothing to run)."""
        if self.ref is not None:
            self.ref.signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def process_ref(process: object) -> ProcessRef | None:
    """The :class:`ProcessRef` a handle holds (:class:`ChildProcess`, :class:`AdoptedProcess`), else None."""
    ref = getattr(process, "ref", None)
    return ref if isinstance(ref, ProcessRef) else None


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def prove_process(pid: int, create_time: float, tag: str, *, env_name: str = OWNER_ENV) -> str | None:
    """Whether pid ``pid`` is provably the process a record names: it runs (not a zombie), it is ours (same
    uid), it started at ``create_time`` (a reused pid started later), and its environment carries ``env_name`` =
    ``tag`` (the owner tag a worker was started with; a keeper's marker). None when proven, else why not, in
    words."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return f"pid {pid} has exited"
        if proc.uids().real != os.getuid():
            return f"pid {pid} belongs to another user"
        started = proc.create_time()
        if not same_start(started, create_time):
            return (f"pid {pid} is another process now (started at {time.strftime('%H:%M:%S', time.localtime(started))}"
                    f", not at {time.strftime('%H:%M:%S', time.localtime(create_time))}: the pid was reused)")
        value = proc.environ().get(env_name)
    except psutil.NoSuchProcess:
        return f"pid {pid} has exited"
    except (psutil.Error, OSError) as exc:
        return f"pid {pid} cannot be inspected ({type(exc).__name__})"
    if value != tag:
        return f"pid {pid} does not carry {env_name}={tag} (it has {value!r})"
    return None


# ---------------------------------------------------------------------------------------------- teardown


def terminate_tree(
    process: ProcessHandle | None,
    collect: Callable[[], list[psutil.Process]],
    *,
    term_timeout: float = 10.0,
    kill_timeout: float = 10.0,
) -> list[int]:
    """Stop a worker's whole tree; returns the PIDs that needed SIGKILL.

    The root first: on SIGTERM sglang's parent shuts its scheduler and detokenizer down cleanly (about 4 s,
    exit 0), whereas a SIGTERM to the whole group kills the scheduler first and the parent then sleeps 5 s
    and ends with -9. Then SIGTERM to the group and to every collected process still alive (escaped
    children included), a bounded wait, SIGKILL to what is left, and a wait until every collected process
    is gone (zombies count as gone). A stopped (SIGSTOPped) root gets SIGCONT with its SIGTERM.

    Every signal reaches only a process proven ours at that moment: the root through the :class:`ProcessRef`
    its handle holds (a plain ``Popen`` still running gets one here), the group through the root's pidfd or
    while the root holds its pid, else each of its members proven on its own (:meth:`ProcessRef.member`); a
    collected process through a pidfd opened and checked against it (:func:`signal_proven`). The root's ref is
    closed at the end: the tree is gone."""
    ref = process_ref(process)
    if ref is None and process is not None and process.poll() is None:
        ref = ProcessRef.child(process.pid)  # a child not yet reaped: its pid is still its own
    try:
        return _terminate(process, ref, collect, term_timeout, kill_timeout)
    finally:
        if ref is not None:
            ref.close()


def _terminate(process: ProcessHandle | None, ref: ProcessRef | None, collect: Callable[[], list[psutil.Process]],
               term_timeout: float, kill_timeout: float) -> list[int]:
    # The graces' lengths: how long a wait may last, never whether it happens (timing, which no test bounds)
    resend_after = min(1.0, term_timeout)  # pragma: no mutate
    root_rest = max(0.0, term_timeout - 1.0)  # pragma: no mutate
    group_grace = min(5.0, term_timeout) if process is not None else term_timeout  # pragma: no mutate
    procs = {p.pid: p for p in collect()}
    if process is not None and process.poll() is None:
        _signal_root(process, ref, signal.SIGCONT)  # a frozen worker handles nothing until it runs again
        _signal_root(process, ref, signal.SIGTERM)
        # A signal can land on a thread that does not act on it (a resumed engine's HTTP thread while its main
        # thread sleeps): once more after a second, then the rest of the grace.
        _wait_gone(process, [], resend_after, ref)
        if process.poll() is None:
            _signal_root(process, ref, signal.SIGTERM)
            _wait_gone(process, [], root_rest, ref)
        procs.update((p.pid, p) for p in collect())
    remaining = [p for p in procs.values() if _alive(p)]
    if ref is not None:
        _signal_group(ref, signal.SIGTERM)
    for proc in remaining:
        signal_proven(proc, signal.SIGCONT)
        signal_proven(proc, signal.SIGTERM)
    _wait_gone(process, remaining, group_grace, ref)
    procs.update((p.pid, p) for p in collect())
    leftovers = [p for p in procs.values() if _alive(p)]
    killed: list[int] = []
    if ref is not None and process is not None and process.poll() is None:  # a root deaf to SIGTERM: its group
        _signal_group(ref, signal.SIGKILL)
        # The root needed SIGKILL, whichever ends it: the group's can turn it zombie while the loop below proves it
        # (two reads of its identity that differ prove nothing), and it then went uncounted (once in CI)
        _signal_root(process, ref, signal.SIGKILL)
        killed.append(process.pid)
    for proc in leftovers:
        if signal_proven(proc, signal.SIGKILL):
            killed.append(proc.pid)
    _wait_gone(process, leftovers, kill_timeout)
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=kill_timeout)
    return sorted(set(killed))


def _signal_root(process: ProcessHandle, ref: ProcessRef | None, sig: int) -> None:
    if ref is not None:
        ref.signal(sig)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        process.send_signal(sig)


def _signal_group(leader: ProcessRef, sig: int) -> None:
    """``sig`` to the leader's process group: whole where that is provably its group
    (:meth:`ProcessRef.signal_group`), else to each process of ours in a group of that number proven to be in it
    (:meth:`ProcessRef.member`)."""
    if leader.signal_group(sig):
        return
    import psutil

    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != leader.ident.uid:
                continue
            if os.getpgid(proc.pid) != leader.pid:
                continue
        except (OSError, psutil.Error):
            continue
        member = leader.member(proc.pid)
        if member is not None and member is not leader:
            member.signal(sig)
            member.close()


def signal_proven(proc: psutil.Process, sig: int) -> bool:
    """Send ``sig`` to the process ``proc`` was read from, only while it is ours (same uid) and still that
    process (psutil's pid and start time, checked after its pidfd was opened). True when sent."""
    import psutil

    ref = ProcessRef.prove(proc.pid)
    if ref is None:
        return False
    try:
        if not proc.is_running():  # the pid names another process now (or none)
            return False
        return ref.signal(sig)
    except psutil.Error:
        return False
    finally:
        ref.close()


def sweep_session(session_id: str = SESSION_ID, *, timeout: float = 10.0) -> list[int]:
    """Kill every process still tagged with this session (the last line of defence at session end)."""
    return terminate_tree(None, lambda: find_session_processes(session_id), term_timeout=timeout,
                          kill_timeout=timeout)


def _alive(proc: psutil.Process) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(process: ProcessHandle | None, procs: list[psutil.Process], timeout: float,
               ref: ProcessRef | None = None) -> None:
    """Until the root and ``procs`` are gone, or ``timeout``: polled every 50 ms, and, while the root runs and ``ref``
    (the root's) holds a pidfd, woken at once by the root's exit (a worker's stop waits on it first)."""
    deadline = time.monotonic() + timeout
    exit_seen = False  # the pidfd said so once: from then on plain polls (never a spin on a handle slow to agree)
    while True:
        now = time.monotonic()
        if now >= deadline:
            return
        # poll() also reaps our direct child, so it does not linger as a zombie
        root_runs = process is not None and process.poll() is None
        if not root_runs and not any(_alive(p) for p in procs):
            return
        pause = min(0.05, deadline - now)  # pragma: no mutate (how often, never whether)
        # woken at the root's exit rather than up to 50 ms later: how soon, never whether
        if root_runs and ref is not None and not exit_seen:  # pragma: no mutate
            exit_seen = ref.wait_exit(pause)  # pragma: no mutate
        else:
            time.sleep(pause)
