"""A launcher script for the tests of a port taken between its reservation and the bind: before it runs the
real module, it lets a foreign process (no owner tag, not a descendant) listen on the port it was given, once
(the file named by ``GRAB_FLAG`` records the port and the foreign pid). And :func:`free_port_block`, for tests that
pin a port themselves (a ``base_url``)."""

from __future__ import annotations

import random
import socket

_TEMPLATE = r'''
"""A launcher that lets a foreign process take the port just before @MODULE@ binds it (once)."""
import os, runpy, socket, subprocess, sys, time

LISTENER = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(64)
s.settimeout(0.2)
end = time.monotonic() + 60
while time.monotonic() < end:
    try:
        c, _ = s.accept()
        c.close()
    except OSError:
        pass
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
    foreign = int(subprocess.run([sys.executable, "-c", SPAWN, LISTENER, str(port)], env=env, check=True,
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


def free_port_block() -> int:
    """An aligned port whose block of 4 is free now, below the ephemeral range (the plugin's default range)."""
    rng = random.Random()
    for _ in range(200):
        port = 20000 + 4 * rng.randrange(0, 3000)
        ok = True
        for p in range(port, port + 4):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise RuntimeError("no free port block found")
