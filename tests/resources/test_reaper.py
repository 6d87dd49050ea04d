"""Unit tests of :mod:`pytest_sglworker.resources.reaper` and :mod:`pytest_sglworker.resources.processes`: the
watchdog ends a session's tagged processes when the session's end of its pipe closes; the janitor ends those of
sessions whose pytest is gone; teardown finds renamed session members and children that left the session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

import psutil
import pytest

from pytest_sglworker.resources import reaper
from pytest_sglworker.resources.processes import (
    OWNER_ENV,
    find_session_processes,
    process_tree,
    tag_session,
    tag_session_pid,
    terminate_tree,
)
from pytest_sglworker.resources.reaper import Watchdog, reap_dead_sessions

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _wait(condition: Callable[[], bool], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _gone(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is not None


def _tagged(tag: str, **kwargs) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    return subprocess.Popen(SLEEPER, env={**os.environ, OWNER_ENV: tag}, start_new_session=True, **kwargs)


def test_tags_name_their_session() -> None:
    assert tag_session("4242-ab12cd34:9f00") == "4242-ab12cd34"
    assert tag_session_pid("4242-ab12cd34:9f00") == 4242 and tag_session_pid("garbage") is None


def test_the_watchdog_ends_the_sessions_processes_when_its_pipe_closes() -> None:
    session = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    mine, other = _tagged(f"{session}:w1"), _tagged(f"{os.getpid()}-{uuid.uuid4().hex[:8]}:w2")
    try:
        assert _wait(lambda: len(find_session_processes(session)) == 1)
        watchdog = Watchdog(session)
        time.sleep(0.2)
        assert mine.poll() is None  # alive while the session holds its end
        watchdog.close()
        assert _wait(lambda: _gone(mine)), "the watchdog did not end the session's worker"
        assert other.poll() is None  # another session's worker is not touched
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()


def test_the_janitor_ends_workers_of_dead_sessions_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Janitors are machine-wide: every plugin session starting on this machine runs one (the suite's other xdist
    # worker starts many). So that this janitor is the one that ends the orphan, the orphan's session is named by a
    # live process without an owner tag, which every janitor takes for a running pytest and leaves alone; this one
    # is told that the pid was taken over by an unrelated process since (the janitor's check for a reused pid),
    # so that for it alone the session is dead.
    stand_in = subprocess.Popen(SLEEPER)
    orphan = _tagged(f"{stand_in.pid}-deadbeef:w")
    live = _tagged(f"{os.getpid()}-{uuid.uuid4().hex[:8]}:w")
    is_pytest_like = reaper._is_pytest_like
    monkeypatch.setattr(reaper, "_is_pytest_like", lambda pid: pid != stand_in.pid and is_pytest_like(pid))
    try:
        assert _wait(lambda: bool(find_session_processes(f"{stand_in.pid}-deadbeef")))
        assert is_pytest_like(stand_in.pid)  # what every other janitor sees
        report = reap_dead_sessions()
        assert orphan.pid in report.processes and live.pid not in report.processes
        assert f"killed {len(report.processes)} worker process(es) of dead sessions (pids " in str(report)
        assert str(orphan.pid) in str(report)
        assert _wait(lambda: _gone(orphan)) and live.poll() is None
        assert orphan.returncode == -signal.SIGTERM  # ended by the janitor (SIGTERM first), not killed otherwise
    finally:
        for proc in (orphan, live, stand_in):
            proc.kill()
            proc.wait()


def test_teardown_finds_session_members_and_escaped_children() -> None:
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}:tree"
    # the root starts a child in its own session (like sglang's scheduler) and one that escapes the session
    script = (
        "import os, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(120)'])\n"
        "time.sleep(120)\n"
    )
    root = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, OWNER_ENV: tag}, start_new_session=True)
    try:
        assert _wait(lambda: len(process_tree(root.pid, tag)) == 3)
        pids = [p.pid for p in process_tree(root.pid, tag)]
        terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=5, kill_timeout=5)
        assert _wait(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                     for p in pids))
    finally:
        for proc in process_tree(root.pid, tag):
            proc.kill()
        root.kill()
        root.wait()


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_stopped_tree_is_ended_without_waiting_for_the_kill(stopped: bool) -> None:
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}:stop"
    root = _tagged(tag)
    if stopped:
        os.kill(root.pid, signal.SIGSTOP)
    # The grace is an hour: the teardown ends within the test's 60 s wait only by returning once the tree is gone
    # (a stopped root resumed with its SIGTERM), not by sitting the grace out.
    result: list[list[int]] = []
    teardown = threading.Thread(target=lambda: result.append(
        terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=3600, kill_timeout=10)), daemon=True)
    teardown.start()
    teardown.join(60)
    try:
        assert not teardown.is_alive(), "the teardown was still waiting out its grace"
        assert root.poll() is not None and result == [[]]  # SIGTERM (with SIGCONT) sufficed
    finally:
        root.kill()
        root.wait()


# ---------------------------------------------------------------------------------------------- listeners


def test_listening_inodes_name_the_ports_listeners_by_netlink_and_by_the_tables() -> None:
    """The kernel's listeners of one port (IPv4 and IPv6), the same from sock_diag and from /proc/net/tcp*;
    a connected or merely bound socket on the port is not a listener; the holder's fds hold the inodes."""
    import socket

    from pytest_sglworker.resources.processes import (
        _table_listeners,
        held_socket_inodes,
        listening_inodes,
        socket_inodes,
    )

    with socket.socket() as v4:
        v4.bind(("127.0.0.1", 0))
        port = v4.getsockname()[1]
        assert listening_inodes(port) == set()  # bound, not listening
        v4.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            v4_inodes = listening_inodes(port)
            assert v4_inodes == _table_listeners(port) == socket_inodes(os.getpid(), port), (port, v4_inodes)
            assert len(v4_inodes) == 1  # the client's connected socket is not one of them
            assert held_socket_inodes(os.getpid(), v4_inodes) == v4_inodes
            assert client.fileno() >= 0
        try:
            v6 = socket.socket(socket.AF_INET6)
            v6.bind(("::1", port))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        with v6:
            v6.listen()
            both = listening_inodes(port)
            assert both == _table_listeners(port) and len(both) == 2 and v4_inodes < both
    assert listening_inodes(port) == set()


def test_listeners_of_a_port_block_read_no_process_where_nothing_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    """``listeners`` names this process for its listening port and nothing for the block's others; where the kernel
    says no port of the block is listened on, no process's sockets are read; where the kernel cannot be asked,
    every process's are."""
    import socket

    from pytest_sglworker.resources import processes

    with socket.socket() as sock, socket.socket() as idle:
        sock.bind(("127.0.0.1", 0))
        idle.bind(("127.0.0.1", 0))  # bound, never listening: not a listener
        sock.listen()
        port, other = sock.getsockname()[1], idle.getsockname()[1]
        assert processes.listeners([port, other]) == {os.getpid(): [port]}
        read: list[int] = []
        original = psutil.Process.net_connections

        def counted(self: psutil.Process, kind: str = "inet") -> list:  # type: ignore[type-arg]
            read.append(self.pid)
            return original(self, kind)

        monkeypatch.setattr(psutil.Process, "net_connections", counted)
        assert processes.listeners([other]) == {}
        assert read == []
        monkeypatch.setattr(processes, "listening_inodes", lambda port: None)
        assert processes.listeners([port, other]) == {os.getpid(): [port]}
        assert os.getpid() in read


def test_held_socket_inodes_of_another_process_and_of_a_dead_one() -> None:
    from pytest_sglworker.resources.processes import held_socket_inodes, listening_inodes

    code = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        inodes = listening_inodes(port)
        assert inodes and held_socket_inodes(proc.pid, inodes) == inodes
        assert held_socket_inodes(os.getpid(), inodes) == set()  # not ours
    finally:
        proc.kill()
        proc.wait(10)
    assert held_socket_inodes(proc.pid, inodes) == set()  # gone: nothing, no error
