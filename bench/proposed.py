"""Fixes the benchmark proposes, applied as patches in the bench process only (never in the plugin).

``bench/run.py`` measures each one next to the code it would replace, in the same run, and labels its rows
"proposed": the plugin's own figures are always those of the code as committed.

1. **An ownership check that does not read the kernel's whole TCP table** (the readiness figures). After the
   probe that answers 200, ``ModelInstance.owns_port`` asks psutil for the listening sockets of each process
   of the worker's tree, twice (``processes.listening_pids``, then ``processes.socket_inodes``). psutil's
   ``Process.net_connections`` reads ``/proc/net/tcp`` and ``/proc/net/tcp6``, and a read of either makes the
   kernel walk its whole TCP hash table, milliseconds whatever the number of sockets (``bench/run.py`` times
   one read of the two at each launch), plus psutil's parsing of every line; and before that,
   ``psutil.Process.children(recursive=True)`` reads the stat file of every process of the machine.
   :func:`fast_owns_port` asks the kernel for the sockets that LISTEN on the port with one ``sock_diag``
   netlink request per address family (what ``ss -l`` does; the kernel walks only its listening hash), then
   looks for those inodes among the fds of the worker's root process, and only when they are not there among
   the fds of the rest of its tree. Same answer, and the same ``listen_inodes`` remembered (what the
   teardown's listener check uses); where netlink is refused, the two tables are read once.

2. **A readiness probe that costs the engine nothing** (:class:`ReadyProbe`). sglang 0.5.23's
   ``/health_generate`` (and ``/health``, unless ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``) schedules a
   one-token generation and then sleeps 1 s (``await asyncio.sleep(1)``, ``http_server.py``) before it answers
   200: the confirmation after the ready line costs a generation and at least 1 s, and a probe already in
   flight when the line appears holds the wait as long. ``GET /ready`` answers from the tokenizer manager's
   state (200 once the server is ``Up``: after the warmup request succeeded, just before the ready line)
   without a generation. :class:`ReadyProbe` probes ``/ready`` and falls back to ``/health_generate`` for an
   engine that answers it 404 (an older sglang). The simulated engine answers both at once, so this part of
   the fix shows only against the real engine (``bench/run.py`` part ``real``).

3. **Launch ahead when a GPU comes free** (:mod:`proposed_launch_ahead`, a pytest plugin given with ``-p``):
   see that module.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

from pytest_sglworker.health import HttpHealth, Probe
from pytest_sglworker.kinds import HttpWorker
from pytest_sglworker.sglang_facts import HEALTH_PATH

READY_PATH = "/ready"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"


def listening_inodes(port: int) -> set[int]:
    """Inodes of the sockets that LISTEN on TCP ``port`` (any address, IPv4 and IPv6)."""
    try:
        return {inode for family in (socket.AF_INET, socket.AF_INET6) for inode in _diag_listeners(family, port)}
    except OSError:
        return _table_listeners(port)


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN = 10


def _diag_listeners(family: int, port: int) -> set[int]:
    """One ``SOCK_DIAG_BY_FAMILY`` dump of the TCP sockets in state LISTEN (``struct inet_diag_req_v2``)."""
    sockid = struct.pack("!HH", port, 0) + bytes(32) + struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN) + sockid
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    found: set[int] = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(2.0)
        sock.sendall(header + request)
        while True:
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
                body = offset + 16  # struct inet_diag_msg: state at 1, sport at 4, inode at 68
                if len(data) >= body + 72 and data[body + 1] == _TCP_LISTEN:
                    (sport,) = struct.unpack_from("!H", data, body + 4)
                    (inode,) = struct.unpack_from("=I", data, body + 68)
                    if sport == port:
                        found.add(inode)
                offset += (length + 3) & ~3


def _table_listeners(port: int) -> set[int]:
    suffix = f":{port:04X}"
    found: set[int] = set()
    for table in _TABLES:
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == _LISTEN and fields[1].endswith(suffix):
                        found.add(int(fields[9]))
        except OSError:
            continue
    return found


def _holds(pid: int, wanted: dict[str, int]) -> set[int]:
    """The inodes of ``wanted`` (``socket:[inode]`` links) among the fds of ``pid``."""
    held: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return held
    for fd in fds:
        try:
            inode = wanted.get(os.readlink(f"{fd_dir}/{fd}"))
        except OSError:
            continue
        if inode is not None:
            held.add(inode)
    return held


def fast_owns_port(self: Any) -> bool:
    """Drop-in for ``ModelInstance.owns_port``: whether a process of the worker's tree holds a socket that
    listens on its port; the inodes are remembered in ``listen_inodes`` as the original does. Linux only
    (the bench runs there); elsewhere the original."""
    if _ORIGINAL is not None and not os.path.isdir("/proc/self/fd"):
        return bool(_ORIGINAL(self))
    inodes = listening_inodes(self.port)
    if not inodes:
        return False
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    held = _holds(self.pid, wanted)  # the engine's root process listens itself (sglang, the sim)
    if not held:
        for proc in self._tree(sweep=False):
            if proc.pid != self.pid:
                held |= _holds(proc.pid, wanted)
    self.listen_inodes |= held
    return bool(held)


_ORIGINAL: Callable[[Any], bool] | None = None


@contextlib.contextmanager
def patched_owns_port() -> Iterator[None]:
    """``ModelInstance.owns_port`` replaced by :func:`fast_owns_port` for the duration."""
    global _ORIGINAL
    from pytest_sglworker.launcher import ModelInstance

    original = ModelInstance.owns_port
    _ORIGINAL = original
    ModelInstance.owns_port = fast_owns_port  # type: ignore[method-assign]
    try:
        yield
    finally:
        ModelInstance.owns_port = original  # type: ignore[method-assign]
        _ORIGINAL = None


class ReadyProbe(HttpHealth):
    """``GET /ready`` (no generation); ``/health_generate`` from the first 404 on (an engine without it)."""

    def __init__(self) -> None:
        super().__init__(path=READY_PATH)

    def probe(self, target: Any, deadline: float, abort: Callable[[], bool]) -> Probe:
        answer = super().probe(target, deadline, abort)
        if self.path == READY_PATH and answer.status == "HTTP 404":
            self.path = HEALTH_PATH
            return super().probe(target, deadline, abort)
        return answer


class ProposedWorker(HttpWorker):
    """The regular worker kind with :class:`ReadyProbe` as its readiness (passed to ``spawn_worker(kind=)``)."""

    def readiness(self) -> HttpHealth:
        return ReadyProbe()
