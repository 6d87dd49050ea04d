"""Shared fixtures of the project's own tests.

Every test is checked for leftovers: each test runs with a unique ``SGLWORKER_TEST_MARK`` in its
environment, which every process it starts inherits (inner pytest sessions, workers, escaped children);
any such process still alive after the test fails it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from port_grab import PORT_RANGE_ENV, xdist_port_slice
from second_user import SecondUser, interpreter, make_second_user, shared_base, unavailable

pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    """Compile the package's bytecode once, in the controller, before any test starts a process. With
    ``PYTHONDONTWRITEBYTECODE`` set (as on CI machines and in many containers) Python never writes it, so in a
    fresh clone every process the suite starts (inner pytest sessions, simulated engines, watchdogs, keepers:
    thousands) compiled the plugin from source again: about 0.5 s each on a loaded 2-core machine. Python still
    reads bytecode that exists, and the timestamps keep it in step with the sources."""
    # pytester gives every inner session a HOME of its own; the optional installs of the README's commands (the real
    # CPU engine, the router's vocabulary) live in the user's cache directory of the real HOME, which
    # XDG_CACHE_HOME keeps naming for them (platformdirs reads it first).
    os.environ.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    if hasattr(config, "workerinput"):
        # the inner sessions of each xdist worker reserve ports in a slice of their own (port_grab.xdist_port_slice)
        share = xdist_port_slice(config.workerinput["workerid"], int(config.workerinput["workercount"]))
        if share is not None:
            os.environ.setdefault(PORT_RANGE_ENV, share)
        return
    import compileall

    import pytest_sglworker

    compileall.compile_dir(str(Path(pytest_sglworker.__file__).parent), quiet=1)


#: plugins of this environment that no inner session uses; their imports were most of an inner session's start here
#: (0.54 s -> 0.32 s for a session of one test), and the suite starts well over a thousand pytest processes
LEAN_ADDOPTS = " ".join(f"-p no:{name}" for name in ("hypothesispytest", "anyio"))


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytest's own, with the unused plugins left out of every session it runs (pytester clears ``PYTEST_ADDOPTS``
    for them; a test may set it again, or clear it, itself)."""
    monkeypatch.setenv("PYTEST_ADDOPTS", LEAN_ADDOPTS)
    return pytester


MARK = "SGLWORKER_TEST_MARK"


def _marked_processes(mark: str) -> dict[int, str]:
    found: dict[int, str] = {}
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.pid == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARK) == mark:
                found[proc.pid] = " ".join(proc.info["cmdline"] or ())
        except (psutil.Error, OSError):
            continue
    return found


def leftover_processes(mark: str, timeout: float = 10.0) -> dict[int, str]:
    """Processes started under ``mark`` that are still alive after waiting up to ``timeout`` for them."""
    deadline = time.monotonic() + timeout
    while True:
        left = _marked_processes(mark)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _no_leftover_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    yield
    left = leftover_processes(mark)
    for pid in left:  # clean up so that one failure does not cascade
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not left, f"processes left running after the test: {left}"


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


@pytest.fixture
def second_user() -> Iterator[SecondUser]:
    """A real unprivileged user (``useradd``), removed at the end (tests/second_user.py); its own directory, and a
    root-owned one (``.base``, 0755) around it for what the test shares with it. Skips when not root."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    base = shared_base(Path(tempfile.mkdtemp(prefix="sglworker-users-")))
    try:
        with make_second_user(base) as user:
            why = interpreter(user)
            if why is not None:
                pytest.skip(why)
            yield user
    finally:
        shutil.rmtree(base, ignore_errors=True)
