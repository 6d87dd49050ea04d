"""The drop-in's pinned port (``base_url``) across the classes and tests of one sglang unittest file.

Every class of such a file launches on the same ``base_url`` (sglang's ``DEFAULT_URL_FOR_TEST``):

- the next class's server starts as soon as the previous one is gone, though the previous server's closed
  connections linger on the port in ``TIME_WAIT`` for up to 60 s (the engine binds with ``SO_REUSEADDR``, and so
  does the plugin's check of the pinned port);
- a second ``popen_launch_server`` on a ``base_url`` whose server this session still runs is an error at once,
  naming the URL and the server's owner (its port block would wait for this very process);
- a server ended by sglang's own ``kill_process_tree`` (not the drop-in's) frees its URL for the next launch in
  the same test;
- a wait for the pinned port (another process holds its block) is said whatever the verbosity and counted as a
  lease wait in the summary and the report.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from port_grab import free_port_block
from session_helpers import Session

from pytest_sglworker.resources.waiters import PORTS_WAITING_PREFIX

INNER_CONFTEST = '''
from pytest_sglworker import ModelSpec
from pytest_sglworker.compat import map_model


def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec("tiny-sim", "org/tiny-sim", 1, features={"chat"}))


map_model("sglang-org/Small-Model", "tiny-sim")
'''

INNER_HEAD = '''
import errno
import json
import os
import socket
import unittest

import httpx
import psutil

from pytest_sglworker.compat import CompatError, kill_process_tree, popen_launch_server

PORT = int(os.environ["COMPAT_PORT"])
BASE_URL = f"http://127.0.0.1:{PORT}"
MODEL = "sglang-org/Small-Model"


def record(**data):
    with open(os.environ["COMPAT_OBS"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(data) + "\\n")
'''

INNER_CLASSES = INNER_HEAD + '''

def only_closed_connections(port):
    """Whether a plain bind of port fails while an SO_REUSEADDR bind succeeds: nobody listens there, yet closed
    connections of an earlier server linger in TIME_WAIT."""
    def bindable(reuse):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as exc:
                return exc.errno != errno.EADDRINUSE
            return True
    return bindable(True) and not bindable(False)


class TestA_LeavesClosedConnections(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60)
        cls.client = httpx.Client(timeout=30)

    @classmethod
    def tearDownClass(cls):
        kill_process_tree(cls.process.pid)  # the server side closes the client's kept-alive connection first
        cls.client.close()

    def test_served(self):
        resp = self.client.post(BASE_URL + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 200


class TestB_NextClassOnTheSamePort(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        record(test="B_before", only_closed_connections=only_closed_connections(PORT))
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60)

    @classmethod
    def tearDownClass(cls):
        kill_process_tree(cls.process.pid)

    def test_served(self):
        record(test="B", pid=self.process.pid, port=self.process.worker.port,
               health=httpx.get(BASE_URL + "/health", timeout=10).status_code)


class TestC_TwiceOnOneUrl(unittest.TestCase):
    def test_a_second_launch_while_the_first_runs(self):
        first = popen_launch_server(MODEL, BASE_URL, timeout=60)
        try:
            with self.assertRaises(CompatError) as caught:
                popen_launch_server(MODEL, BASE_URL, timeout=60)
            record(test="C", error=str(caught.exception), first=first.pid, alive=first.poll() is None)
        finally:
            kill_process_tree(first.pid)

    def test_a_launch_after_sglangs_own_kill(self):
        first = popen_launch_server(MODEL, BASE_URL, timeout=60)
        root = psutil.Process(first.pid)  # what sglang.srt.utils.kill_process_tree does, not the drop-in's
        procs = root.children(recursive=True) + [root]
        for proc in procs:
            proc.kill()
        psutil.wait_procs(procs, timeout=30)
        second = popen_launch_server(MODEL, BASE_URL, timeout=60)
        try:
            record(test="D", first=first.pid, second=second.pid,
                   health=httpx.get(BASE_URL + "/health", timeout=10).status_code)
        finally:
            kill_process_tree(second.pid)
'''

INNER_WAITS = INNER_HEAD + '''

class TestW_WaitsForThePort(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.process = popen_launch_server(MODEL, BASE_URL, timeout=60)

    @classmethod
    def tearDownClass(cls):
        kill_process_tree(cls.process.pid)

    def test_served(self):
        record(test="W", port=self.process.worker.port)
'''


def _args(report: Path, gpus: int = 1) -> list[str]:
    return ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim", "--sgl-gpus", f"sim:{gpus}",
            "--sgl-lease-timeout", "20", "--sgl-startup-timeout", "60", "--sgl-report", str(report)]


def _obs(path: Path) -> dict[str, dict[str, Any]]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return {row["test"]: row for row in map(json.loads, lines)}


@pytest.fixture
def inner_env(pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> int:
    port = free_port_block()
    monkeypatch.setenv("COMPAT_PORT", str(port))
    monkeypatch.setenv("COMPAT_OBS", str(pytester.path / "obs.jsonl"))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # the wait's message reaches the output file while it waits
    for key in ("SGLWORKER_MODELS", "SGLWORKER_LAUNCHER", "SGLWORKER_GPUS", "SGLWORKER_REPORT"):
        monkeypatch.delenv(key, raising=False)
    pytester.makeconftest(INNER_CONFTEST)
    return port


def test_classes_on_one_url_start_at_once_and_a_second_launch_there_is_refused(
        pytester: pytest.Pytester, inner_env: int) -> None:
    """Class B launches on the port that class A's server left with closed connections in TIME_WAIT, without a
    wait (a wait of their 60 s would pass the 20 s lease timeout and fail B); a second launch on a URL whose
    server runs is refused at once with the URL and the owner; after sglang's own kill the URL is free again."""
    port = inner_env
    pytester.makepyfile(test_suite=INNER_CLASSES)
    # two GPUs: a second server in one test gets a lease, so only its port can stand in its way
    result = pytester.runpytest_subprocess(*_args(pytester.path / "report.json", gpus=2), timeout=300)
    output = "\n".join(result.outlines + result.errlines)
    obs = _obs(pytester.path / "obs.jsonl")
    assert result.ret == 0, output
    assert obs["B_before"]["only_closed_connections"], "the case needs TIME_WAIT connections on the port"
    assert obs["B"]["port"] == port and obs["B"]["health"] == 200
    assert "waiting for a free block" not in output
    error = obs["C"]["error"]
    assert f"base_url http://127.0.0.1:{port} is still served by worker tiny-sim on 127.0.0.1:{port} " \
           f"(pid {obs['C']['first']}" in error, error
    assert "test_suite.py::TestC_TwiceOnOneUrl::test_a_second_launch_while_the_first_runs launched: this test " \
           "already holds that port" in error, error
    assert "kill_process_tree(process.pid)" in error and obs["C"]["alive"]
    assert obs["D"]["health"] == 200 and obs["D"]["second"] != obs["D"]["first"]


@pytest.mark.parametrize("xdist", [False, True], ids=["no-xdist", "xdist-worker"])
def test_a_wait_for_the_pinned_port_is_shown_and_counted(pytester: pytest.Pytester, inner_env: int,
                                                          sim_env: dict[str, str], xdist: bool) -> None:
    """Another process holds the pinned port's block: the launch waits, says so under ``-q`` while it waits (the
    block is let go only once the line shows: on an xdist worker too, whose own terminal writes nowhere, the line
    naming the worker), and the summary and the report count the wait as a lease wait (at least as long as the
    block was held after the wait began)."""
    port = inner_env
    lock_dir = Path(sim_env["SGLWORKER_LOCK_DIR"])
    lock_dir.mkdir(parents=True, exist_ok=True)
    pytester.makepyfile(test_suite=INNER_WAITS)
    report = pytester.path / "report.json"
    lock = FileLock(lock_dir / f"port-{port}.lock", thread_local=False)
    lock.acquire()
    args = _args(report)
    if xdist:
        at = args.index("no:xdist")
        args[at - 1:at + 1] = ["-n", "1"]
    session = Session(pytester, *args, "test_suite.py")
    flagged: float | None = None  # when the session's flag of a port waiter was first seen
    try:
        deadline = time.monotonic() + 120
        while flagged is None or "waiting for a free block" not in session.output():
            assert session.proc.poll() is None and time.monotonic() < deadline, session.output()
            if flagged is None and list(lock_dir.glob(f"{PORTS_WAITING_PREFIX}*")):
                flagged = time.monotonic()
            time.sleep(0.05)
    finally:
        released = time.monotonic()
        lock.release()
    assert session.wait(120) == 0, session.output()
    output = session.output()
    worker = "[gw0] " if xdist else ""
    assert f"sglworker: {worker}pytest_sglworker.compat: test_suite.py::TestW_WaitsForThePort (setUpClass): port " \
           f"{port} of http://127.0.0.1:{port}: waiting for a free block of 4 ports in {port}-{port + 3}" in output, \
        output
    [stats] = json.loads(report.read_text())["workers"].values()
    assert flagged is not None and stats["lease_wait_seconds"] >= round(released - flagged, 3)
    assert stats["lease_wait_seconds"] > 0
    assert f"lease wait {stats['lease_wait_seconds']:.1f} s" in output
    assert _obs(pytester.path / "obs.jsonl")["W"]["port"] == port
