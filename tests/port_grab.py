"""A launcher script for the tests of a port taken between its reservation and the bind: before it runs the
real module, it lets a foreign process (no owner tag, not a descendant) listen on the port it was given, once
(the file named by ``GRAB_FLAG`` records the port and the foreign pid). And :func:`free_port_block`, for tests that
pin a port themselves (a ``base_url``)."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import stat
import tempfile
from pathlib import Path
from typing import IO

_TEMPLATE = r'''
"""A launcher that lets a foreign process take the port just before @MODULE@ binds it (once)."""
import os, runpy, socket, subprocess, sys, time

LISTENER = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(64)
s.settimeout(0.02)
watched = sys.argv[2] if len(sys.argv) > 2 else ""  # a log: leave once it shows the engine's bind failed there
end = time.monotonic() + 60
while time.monotonic() < end:
    if watched:
        with open(watched, errors="replace") as fh:
            if "address already in use" in fh.read().lower():
                break
    try:
        c, _ = s.accept()
        c.close()
    except OSError:
        pass
s.close()
"""

SPAWN = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid)
"""

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
flag = os.environ["GRAB_FLAG"]
if not os.path.exists(flag):
    # Not ours: no owner tag, and not our descendant either (started through a parent that exits at once).
    env = {k: v for k, v in os.environ.items() if k != "SGLWORKER_OWNER"}
    # GRAB_LEAVE=1: the listener leaves as soon as the engine's log (this launcher's stdout) shows the failed bind
    watched = [os.readlink("/proc/self/fd/1")] if os.environ.get("GRAB_LEAVE") == "1" else []
    foreign = int(subprocess.run([sys.executable, "-c", SPAWN, LISTENER, str(port), *watched], env=env, check=True,
                                 stdin=subprocess.DEVNULL, capture_output=True, text=True).stdout)
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.01)
    with open(flag + ".tmp", "w") as fh:
        fh.write(f"{port} {foreign}")
    os.replace(flag + ".tmp", flag)
sys.argv = ["@MODULE@", *argv]
runpy.run_module("@MODULE@", run_name="__main__", alter_sys=True)
'''


def grab_launcher(module: str) -> str:
    """The launcher's source: it grabs the ``--port`` it is given, then runs ``python -m module``."""
    return _TEMPLATE.replace("@MODULE@", module)


#: Blocks this test process has claimed (their lock files stay open, so locked, until the process ends).
_CLAIMED: list[IO[str]] = []


#: The variable the plugin reads its port range from (``--sgl-port-range``).
PORT_RANGE_ENV = "SGLWORKER_PORT_RANGE"


def xdist_port_slice(worker_id: str, count: int) -> str | None:
    """The share of the plugin's default port range that the inner sessions of xdist worker ``worker_id`` (one of
    ``count``) use, as ``LOW-HIGH``: the widest part of the default range outside the ports other services hand out,
    cut into ``count`` slices of whole blocks. Each test gives its inner sessions a lock directory of their own, so
    two tests running at once on different xdist workers never saw each other's reservations: a router once got a
    port another test's server had just taken, and its launch was retried. None when a slice would hold fewer than
    32 blocks."""
    from pytest_sglworker.resources.ports import FOREIGN_PORTS, PORT_BLOCK_SIZE, default_port_range

    parts = [default_port_range()]
    for lo, hi in FOREIGN_PORTS:
        parts = [piece for low, high in parts
                 for piece in ((low, min(high, lo - 1)), (max(low, hi + 1), high)) if piece[0] <= piece[1]]
    low, high = max(parts, key=lambda part: part[1] - part[0])
    blocks = (high - low + 1) // PORT_BLOCK_SIZE // max(count, 1)
    index = int(worker_id.removeprefix("gw")) if worker_id.removeprefix("gw").isdigit() else -1
    if blocks < 32 or not 0 <= index < count:
        return None
    first = low + index * blocks * PORT_BLOCK_SIZE
    return f"{first}-{first + blocks * PORT_BLOCK_SIZE - 1}"


def _default_range() -> tuple[int, int]:
    from pytest_sglworker.resources.ports import parse_port_range

    value = os.environ.get(PORT_RANGE_ENV)
    return parse_port_range(value) if value else (20000, 32767)


def free_port_block(low: int | None = None, high: int | None = None) -> int:
    """An aligned port in ``low``..``high`` (by default the inner sessions' port range: this xdist worker's slice,
    :func:`xdist_port_slice`, else below the ephemeral range) whose block of 4 is free now and claimed by no other
    test process of this run: tests that run at once (xdist) never pin the same ports, where a free-now check alone
    let two of them pick the first free block and the second wait for the first one's server. The claim is an
    exclusive ``flock`` on a per-block file, held until this process ends."""
    if low is None or high is None:
        low, high = _default_range()
    claims = Path(tempfile.gettempdir()) / f"pytest-sglworker-tests-ports-{os.getuid()}"
    claims.mkdir(mode=0o700, exist_ok=True)
    info = claims.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(f"{claims} is not a directory of this user: remove it")
    rng = random.Random()
    for _ in range(200):
        port = low + 4 * rng.randrange(0, (high - low + 1) // 4)
        claim = open(claims / str(port), "a")  # held open: the lock lasts as long as the process
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            claim.close()
            continue
        if all(bindable(p) for p in range(port, port + 4)):
            _CLAIMED.append(claim)
            return port
        claim.close()
    raise RuntimeError(f"no free, unclaimed port block of 4 in {low}-{high}")


def bindable(port: int) -> bool:
    """Whether a TCP socket can bind ``port`` on 127.0.0.1 now (nothing bound there, no ``TIME_WAIT`` in the way)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
