"""A local Ray cluster for the Ray tests (tests/workers/test_ray_cluster.py, tests/workers/test_ray_auth.py), hermetic.

Whatever the user's ``~/.ray`` and environment hold, the cluster and every client of it run with what
:func:`cluster_env` sets, on the head and on the clients alike:

- **Its own authentication.** Ray (2.60) turns token authentication on for ``ray start --head`` when
  ``RAY_AUTH_MODE`` is unset and ``~/.ray/auth_token`` exists (any earlier ``ray.init()`` on the machine leaves that
  file), and a client then joins only with ``RAY_AUTH_MODE=token`` and the token. So ``RAY_AUTH_MODE`` is always set:
  ``disabled``, or ``token`` with a token of the cluster's own in a file under its temp dir
  (``RAY_AUTH_TOKEN_PATH``, which Ray reads before ``~/.ray/auth_token``); ``RAY_AUTH_TOKEN`` is dropped. With the
  mode set, ``ray start`` and ``ray.init`` neither read nor write the user's ``~/.ray``.
- **Loopback only.** Ray takes ``--node-ip-address=127.0.0.1`` and every ``127.0.0.1`` address it is given for "this
  machine" and replaces it by the address other machines reach it at (``services.resolve_ip_for_localhost``, also
  applied to a client's ``ray.init(address="127.0.0.1:PORT")``); only ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's
  single-machine mode, ``ray_constants.ENABLE_RAY_CLUSTER``) keeps ``127.0.0.1``. With the node's address
  ``127.0.0.1`` Ray's servers (GCS, raylet, the Ray Client server) listen on loopback only, so the clients need the
  setting too (else they are sent to the machine's other address, where nothing answers).
- **Its own temp dir** (``--temp-dir`` and ``RAY_TMPDIR``): nothing under the user's ``/tmp/ray``.

Every process of the cluster carries a mark in its environment, so that its stop ends only those, by PID, and a
guard process ends them if the test process dies without its teardown.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

CLUSTER_MARK = "SGLWORKER_RAY_TEST_CLUSTER"
#: what a client of the cluster must not inherit from the test process
DROPPED = ("SGLWORKER_TEST_MARK", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
           "RAY_TMPDIR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
#: Run by :func:`_cluster_guard`: block until the test process's end of the pipe closes, then kill, by PID, every
#: process that carries the cluster's mark (``ray start --block`` alone did not always stop its cluster on SIGTERM).
GUARD = """
import os, sys, psutil
sys.stdin.buffer.read()
for proc in psutil.process_iter(["pid"]):
    try:
        if proc.pid != os.getpid() and proc.environ().get(sys.argv[1]) == sys.argv[2]:
            proc.kill()
    except (psutil.Error, OSError):
        pass
"""


def _client_server_env() -> dict[str, str]:
    """The head's settings for its Ray Client server (``ray://``)."""
    # The Ray Client server gives a new client's own server process 30 s to come up by default; on a loaded 2-core
    # CI runner (both xdist workers busy) that process took longer and test_ray_client_address failed with "Proxy
    # failed to Connect to backend". The plugin's bound for ray:// (120 s) is beyond this one.
    extra: dict[str, str] = {"RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "90"}
    # The Ray Client server forks each new client's server process (with a preexec_fn, so a real fork()) while
    # its own gRPC threads are busy; gRPC's fork handlers then skip their preparation ("Other threads are currently
    # calling into gRPC, skipping fork() handlers") and the child's post-fork handler can start a gRPC thread that
    # crashes before the exec: twice in full runs here, dmesg showed "event_engine[PID]: segfault ... in cygrpc" for
    # the child and the client failed with "Starting Ray client server failed" (the child's logs empty). gRPC's fork
    # support notes say to turn the handlers off when every fork is followed by an exec, as the server's are.
    extra["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    return extra


@dataclass(frozen=True)
class LocalCluster:
    address: str  #: the GCS address, 127.0.0.1:PORT
    client_port: int  #: the Ray Client server's port
    temp: Path  #: the cluster's --temp-dir (its token file is beside its sessions)
    auth: dict[str, str]  #: what a client sets to join it: the auth mode, the token file, loopback, the temp dir
    mark: str  #: the value of CLUSTER_MARK in its processes' environment

    def client_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) as a client of this cluster runs it."""
        base = os.environ if base is None else base
        return {**{k: v for k, v in base.items() if k not in DROPPED}, **self.auth}

    def processes(self) -> list[psutil.Process]:
        """The live processes of this cluster (its mark in their environment)."""
        return marked_processes(self.mark)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def marked_processes(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(CLUSTER_MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def cluster_env(temp: Path, *, token: bool) -> dict[str, str]:
    """The variables the cluster's head and every client of it run with (see the module's doc); ``token``: token
    authentication on, with a new token in ``temp/auth_token``."""
    env = {"RAY_TMPDIR": str(temp), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_AUTH_MODE": "token" if token else "disabled"}
    if token:
        path = temp / "auth_token"
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
        env["RAY_AUTH_TOKEN_PATH"] = str(path)
    return env


def _cluster_guard(mark: str) -> subprocess.Popen[bytes]:
    """A process that ends the cluster when this test process ends by any means (a SIGTERM or SIGKILL that skips
    the teardown included): the kernel closes the pipe's write end, which only we hold."""
    return subprocess.Popen([sys.executable, "-c", GUARD, CLUSTER_MARK, mark], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={k: v for k, v in os.environ.items() if k != "SGLWORKER_TEST_MARK"})


@contextlib.contextmanager
def local_cluster(*, gpus: int, token: bool = False, extra_env: Mapping[str, str] | None = None,
                  up_timeout: float = 90.0) -> Iterator[LocalCluster]:
    """A local Ray cluster with ``gpus`` declared GPUs (and as many CPUs), up (a client sees its GPUs) before it is
    yielded, stopped and checked gone after: no process with its mark is left."""
    port, client_port = free_port(), free_port()
    temp = Path(tempfile.mkdtemp(prefix="sglray-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    mark = uuid.uuid4().hex
    auth = cluster_env(temp, token=token)
    cluster = LocalCluster(f"127.0.0.1:{port}", client_port, temp, auth, mark)
    env = {**cluster.client_env(), **_client_server_env(), **(extra_env or {}), CLUSTER_MARK: mark}
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    guard = _cluster_guard(mark)
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--num-gpus={gpus}", f"--num-cpus={gpus}", f"--port={port}",
         "--disable-usage-stats", "--include-dashboard=false", f"--temp-dir={temp}",
         "--node-ip-address=127.0.0.1", f"--ray-client-server-port={client_port}"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                 f"assert ray.cluster_resources().get('GPU') == {gpus}")
        deadline = time.monotonic() + up_timeout
        last = ""
        while True:
            assert head.poll() is None, "ray start --head exited"
            done = subprocess.run([sys.executable, "-c", probe, cluster.address], env=env, capture_output=True,
                                  text=True, timeout=60)
            if done.returncode == 0:
                break
            last = (done.stderr.strip().splitlines() or [""])[-1]
            assert time.monotonic() < deadline, f"the local Ray cluster did not come up within {up_timeout:g} s: {last}"
            time.sleep(0.5)
        yield cluster
    finally:
        with_pids = marked_processes(mark)
        with contextlib.suppress(OSError, psutil.Error):
            os.killpg(head.pid, signal.SIGTERM)  # ray start --block stops the cluster's processes
        deadline = time.monotonic() + 10
        while marked_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        for proc in marked_processes(mark):  # what did not stop in time: by PID, only this cluster's
            with contextlib.suppress(OSError, psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(10)
        guard.stdin.close()  # type: ignore[union-attr]
        guard.wait(30)
        deadline = time.monotonic() + 10
        while marked_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = marked_processes(mark)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes left after the cluster's stop: {[p.pid for p in left]} of {len(with_pids)}"
