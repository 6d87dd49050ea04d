"""Shared fixtures of the project's own tests.

Every test is checked for leftovers: a worker process (anything carrying the SGLWORKER_OWNER marker, or
running the simulated engine) that appeared during the test and is still alive afterwards fails the test.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest

pytest_plugins = ["pytester"]


def _worker_processes() -> dict[tuple[int, float], str]:
    found: dict[tuple[int, float], str] = {}
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        try:
            if proc.pid == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or ())
            marked = "pytest_sglworker.sim" in cmdline or "sglang.launch_server" in cmdline
            if not marked:
                marked = "SGLWORKER_OWNER" in proc.environ() or "SGLSIM_ESCAPED" in proc.environ()
        except (psutil.Error, OSError):
            continue
        if marked:
            found[(proc.pid, proc.info["create_time"])] = cmdline
    return found


def leftover_processes(before: dict[tuple[int, float], str], timeout: float = 10.0) -> dict[tuple[int, float], str]:
    """Worker processes that were not there ``before``, after waiting up to ``timeout`` for them to go."""
    deadline = time.monotonic() + timeout
    while True:
        new = {k: v for k, v in _worker_processes().items() if k not in before}
        if not new or time.monotonic() >= deadline:
            return new
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _no_leftover_workers() -> Iterator[None]:
    before = _worker_processes()
    yield
    left = leftover_processes(before)
    for (pid, _), _cmd in left.items():  # clean up so that one failure does not cascade
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not left, f"worker processes left running after the test: {left}"


@pytest.fixture
def sim_env(tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment for inner pytest sessions: private log and lock dirs, a fast simulated startup."""
    env = {
        "SGLWORKER_LOG_DIR": str(os.path.join(tmp_path, "logs")),
        "SGLWORKER_LOCK_DIR": str(os.path.join(tmp_path, "locks")),
        "SGLSIM_STARTUP_SECONDS": "0.2",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env
