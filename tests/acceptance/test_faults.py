"""Faults the plugin must survive: interrupts, crashes, hostile input. No orphan, no leaked lease, no lost log.

Every scenario runs a real pytest session (``runpytest_subprocess``, or ``Popen`` of ``python -m pytest`` when
a signal must reach it) against real simulated-engine subprocesses, and checks afterwards:

- no process of ours is left: nothing carrying this test's ``SGLWORKER_TEST_MARK`` (workers, escaped
  children started with ``SGLSIM_FAULT=escape_child``, watchdogs, xdist workers);
- no lease is left: no GPU holder record (``gpu-*.json``) in the lock directory, every lock file unlocked,
  and a new session on ``--sgl-gpus sim:1`` gets the GPU at once (``--sgl-lease-timeout 1``);
- a failure carries the diagnosis and the log tail, and the log of a failed or interrupted worker is kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from port_grab import free_port_block, grab_launcher
from session_helpers import Session
from warm_helpers import wait_for

from pytest_sglworker.plugin import options as plugin_options

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1", "-p", "no:cacheprovider"]
MARK = "SGLWORKER_TEST_MARK"

NEXT_TEST = """
def test_next(sgl_worker):
    assert sgl_worker.client.get("/health").status_code == 200
"""

#: A test body that waits until its worker's escaped child is logged and writes the pids to ``pids.json``.
RECORD_PIDS = """
import json, os, re, time

def record_pids(worker, **extra):
    deadline = time.monotonic() + 20
    while "spawned scheduler pid=" not in worker.log_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int(re.search(r"spawned scheduler pid=(\\d+)", worker.log_text()).group(1))
    data = {"worker": worker.pid, "child": child, "port": worker.port, "pytest": os.getpid(), **extra}
    with open("pids.json.tmp", "w") as fh:
        json.dump(data, fh)
    os.replace("pids.json.tmp", "pids.json")
"""


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------


def _marked_alive() -> dict[int, str]:
    mark = os.environ[MARK]
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARK) == mark:
                found[proc.pid] = " ".join(proc.info["cmdline"] or ())
        except (psutil.Error, OSError):
            continue
    return found


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _unlocked(path: Path) -> bool:
    from filelock import FileLock, Timeout

    lock = FileLock(path, thread_local=False)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return False
    lock.release(force=True)
    return True


def assert_nothing_left(sim_env: dict[str, str], *, timeout: float = 10.0, pids: tuple[int, ...] = ()) -> None:
    """No process of this test alive, no holder record, no lock held."""
    wait_for(lambda: not _marked_alive(), timeout, "the processes of this test to end")
    for pid in pids:
        assert _gone(pid), f"pid {pid} still runs"
    lock_dir = Path(sim_env["SGLWORKER_LOCK_DIR"])
    if lock_dir.is_dir():
        assert sorted(p.name for p in lock_dir.glob("gpu-*.json")) == [], "a GPU holder record was left"
        held = [p.name for p in lock_dir.glob("*.lock") if not _unlocked(p)]
        assert held == [], f"locks still held: {held}"


def next_session_works(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """A new session on sim:1 gets the GPU at once and a healthy worker."""
    (pytester.path / "next").mkdir(exist_ok=True)
    (pytester.path / "next" / "test_next.py").write_text(NEXT_TEST)
    result = pytester.runpytest_subprocess("next", *SIM, "--sgl-lease-timeout", "1", *args, timeout=90)
    result.assert_outcomes(passed=1)
    return result


@pytest.fixture
def session_factory(pytester: pytest.Pytester) -> Iterator[Callable[..., Session]]:
    sessions: list[Session] = []

    def start(*args: str) -> Session:
        sessions.append(Session(pytester, *args))
        return sessions[-1]

    yield start
    for session in sessions:
        session.kill()


def _read_pids(pytester: pytest.Pytester, session: Session, timeout: float = 30.0) -> dict[str, int]:
    path = pytester.path / "pids.json"
    wait_for(lambda: path.exists() or session.proc.poll() is not None, timeout, "the test to record its pids")
    assert path.exists(), f"the inner test did not start:\n{session.output()}"
    return json.loads(path.read_text())


def _logs(sim_env: dict[str, str]) -> list[Path]:
    return sorted(Path(sim_env["SGLWORKER_LOG_DIR"]).glob("sglang-worker-*.log"))


# --------------------------------------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------------------------------------


def test_ctrl_c_during_worker_startup(pytester: pytest.Pytester, sim_env: dict[str, str],
                                      session_factory: Callable[..., Session]) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child", "SGLSIM_STARTUP_SECONDS": "30"})
        def test_slow_start(sgl_worker):
            raise AssertionError("the worker cannot be ready: Ctrl-C comes during its 30 s startup")
    """)
    session = session_factory(*SIM)
    log_dir = Path(sim_env["SGLWORKER_LOG_DIR"])

    def escaped_child() -> int | None:
        for log in log_dir.glob("sglang-worker-*.log"):
            found = re.search(r"spawned scheduler pid=(\d+)", log.read_text(errors="replace"))
            if found:
                return int(found.group(1))
        return None

    wait_for(lambda: escaped_child() or session.proc.poll() is not None, 30, "the worker to start")
    child = escaped_child()
    assert child is not None, session.output()
    session.proc.send_signal(signal.SIGINT)
    assert session.wait(30) == pytest.ExitCode.INTERRUPTED
    out = session.output()
    assert "KeyboardInterrupt" in out and "Traceback" not in out, out
    assert_nothing_left(sim_env, pids=(child,))
    (log,) = _logs(sim_env)  # the interrupted worker's log is kept
    assert "Load weight begin" in log.read_text()
    next_session_works(pytester)


def test_ctrl_c_during_a_test(pytester: pytest.Pytester, sim_env: dict[str, str],
                              session_factory: Callable[..., Session]) -> None:
    pytester.makepyfile(RECORD_PIDS + textwrap.dedent("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child"})
        def test_waits(sgl_worker):
            record_pids(sgl_worker)
            deadline = time.monotonic() + 60
            while not os.path.exists("go") and time.monotonic() < deadline:
                time.sleep(0.05)
    """))
    session = session_factory(*SIM)
    pids = _read_pids(pytester, session)
    session.proc.send_signal(signal.SIGINT)
    assert session.wait(30) == pytest.ExitCode.INTERRUPTED
    out = session.output()
    # The interrupted test's worker is torn down before the pool closes, its log kept and named.
    assert "KeyboardInterrupt" in out and "Traceback" not in out and "INTERNALERROR" not in out, out
    assert f"log kept: {Path(sim_env['SGLWORKER_LOG_DIR'])}/sglang-worker-{pids['port']}.log" in out, out
    assert_nothing_left(sim_env, pids=(pids["worker"], pids["child"]))
    assert [p.name for p in _logs(sim_env)] == [f"sglang-worker-{pids['port']}.log"]
    next_session_works(pytester)


# --------------------------------------------------------------------------------------------------------
# pytest-timeout
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["signal", "thread"])
def test_test_killed_by_pytest_timeout(pytester: pytest.Pytester, sim_env: dict[str, str], method: str) -> None:
    pytest.importorskip("pytest_timeout", reason="pytest-timeout is not installed")
    pytester.makepyfile(RECORD_PIDS + textwrap.dedent("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child"})
        def test_hangs(sgl_worker):
            record_pids(sgl_worker)
            time.sleep(60)
    """))
    # timeout_func_only: the 3 s are the test's own, not the worker's startup (slow on a loaded machine). The test
    # sleeps 60 s, as long as the session is given: only pytest-timeout can end it ("Timeout" below).
    result = pytester.runpytest_subprocess(*SIM, "--timeout", "3", "--timeout-method", method,
                                           "-o", "timeout_func_only=true", timeout=60)
    pids = json.loads((pytester.path / "pids.json").read_text())
    out = result.stdout.str() + result.stderr.str()
    assert "Timeout" in out
    if method == "signal":
        # The test fails; its teardown runs; the failure carries the worker's section and its log is kept.
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines([
            f"*- sglang worker qwen3-0.6b 127.0.0.1:{pids['port']} -*",
            "log: *sglang-worker-*.log",
            "last lines of the log*:",
            "*The server is fired up and ready to roll!*",
        ])
        assert "log kept: " in result.stdout.str()
    else:
        # The thread method dumps the stacks and ends the process with os._exit(1): no teardown at all. The
        # session watchdog kills the workers and removes the lease record of its dead session.
        assert result.ret == 1
    assert_nothing_left(sim_env, pids=(pids["worker"], pids["child"]))
    assert len(_logs(sim_env)) == 1  # kept in both cases
    next_session_works(pytester)


# --------------------------------------------------------------------------------------------------------
# Crashed xdist worker, SIGKILLed session
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["os._exit(3)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_xdist_worker_dies_during_a_test(pytester: pytest.Pytester, sim_env: dict[str, str], how: str) -> None:
    pytester.makepyfile(RECORD_PIDS + textwrap.dedent(f"""
        import signal
        import pytest

        @pytest.mark.sgl_worker(env={{"SGLSIM_FAULT": "escape_child"}})
        def test_a_worker_process_dies(sgl_worker):
            record_pids(sgl_worker)
            {how}

        def test_b_next_test_works(sgl_worker):
            assert sgl_worker.client.get("/health").status_code == 200
    """))
    result = pytester.runpytest_subprocess(*SIM, "-n", "1", timeout=90)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*worker 'gw0' crashed while running*test_a_worker_process_dies*"])
    pids = json.loads((pytester.path / "pids.json").read_text())
    assert_nothing_left(sim_env, pids=(pids["worker"], pids["child"], pids["pytest"]))
    next_session_works(pytester)


def test_sigkill_of_pytest_the_watchdog_kills_the_workers(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                          session_factory: Callable[..., Session]) -> None:
    pytester.makepyfile(RECORD_PIDS + textwrap.dedent("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child"})
        def test_runs(sgl_worker):
            record_pids(sgl_worker)
            time.sleep(60)
    """))
    session = session_factory(*SIM)
    pids = _read_pids(pytester, session)
    session.proc.kill()
    session.wait(10)
    # Without the watchdog both would live on (the worker serves forever; nobody is left to stop it).
    wait_for(lambda: _gone(pids["worker"]) and _gone(pids["child"]), 30, "the watchdog to kill the workers")
    assert_nothing_left(sim_env)  # the watchdog also removed the dead session's GPU holder record
    assert len(_logs(sim_env)) == 1  # the log of the killed session's worker is kept
    next_session_works(pytester)


def test_janitor_cleans_up_after_a_session_whose_watchdog_died_too(
    pytester: pytest.Pytester, sim_env: dict[str, str], session_factory: Callable[..., Session]
) -> None:
    pytester.makepyfile(RECORD_PIDS + textwrap.dedent("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child"})
        def test_runs(sgl_worker):
            record_pids(sgl_worker)
            time.sleep(60)
    """))
    session = session_factory(*SIM)
    pids = _read_pids(pytester, session)
    (watchdog,) = [p for p in psutil.Process(session.proc.pid).children()
                   if "pytest_sglworker.resources.reaper" in " ".join(p.cmdline())]
    watchdog.kill()
    wait_for(lambda: _gone(watchdog.pid), 5, "the watchdog to die")
    session.proc.kill()
    session.wait(10)
    # Orphans now: nothing of the session is left to end the worker and its escaped child, and the holder record
    # names the dead session. (Whether they still run is not this test's to say: janitors are machine-wide, and
    # another session started meanwhile on this machine may already have ended them; it did once, under load.)
    assert len(list(Path(sim_env["SGLWORKER_LOCK_DIR"]).glob("gpu-*.json"))) == 1
    result = next_session_works(pytester)
    out = result.stdout.str()
    # The lease record is this test's own (its private lock directory): only the next session's janitor removes it.
    # The orphans are ended by a janitor: the next session's, or (janitors are machine-wide) that of another session
    # started meanwhile on this machine, so which one's report lists them is not this test's to say; that the
    # janitor's report lists what it ended is held by tests/resources/test_reaper.py, where only one janitor can.
    assert re.search(r"cleaned up after earlier sessions: (?:killed \d+ worker process\(es\) of dead sessions "
                     r"\(pids [\d, ]+\); )?removed 1 GPU lease record\(s\) of dead sessions", out), out
    assert _gone(pids["worker"]) and _gone(pids["child"]), out
    assert_nothing_left(sim_env, pids=(pids["worker"], pids["child"]))


# --------------------------------------------------------------------------------------------------------
# A worker that dies during a test
# --------------------------------------------------------------------------------------------------------


def test_worker_death_during_tests(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    """Each way of dying is reported with code, diagnosis and tail; the next test gets a fresh worker."""
    pytester.makepyfile(RECORD_PIDS + textwrap.dedent("""
        import signal
        import pytest

        DIE = pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_after=1,escape_child"})
        SEEN = []

        def _die_by_request(worker):
            record_pids(worker)
            SEEN.append(worker.pid)
            worker.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
            worker.process.wait(10)

        @DIE
        def test_1_dies_test_passes(sgl_worker):
            _die_by_request(sgl_worker)

        @DIE
        def test_2_dies_test_fails(sgl_worker):
            _die_by_request(sgl_worker)
            assert False, "the router saw a connection reset"

        @DIE
        def test_3_next_test_gets_a_fresh_worker(sgl_worker):
            assert sgl_worker.pid not in SEEN
            assert sgl_worker.client.get("/health").status_code == 200

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child"})
        def test_4_terminated_from_outside(sgl_worker):
            record_pids(sgl_worker)
            os.kill(sgl_worker.pid, signal.SIGTERM)
            sgl_worker.process.wait(10)

        IDLE = []

        def test_5_pooled_worker(sgl_worker):
            IDLE.append(sgl_worker.pid)

        def test_6_kills_it_while_idle():
            os.kill(IDLE[0], signal.SIGKILL)
            time.sleep(0.3)

        def test_7_dead_idle_worker_is_replaced(sgl_worker):
            assert sgl_worker.pid != IDLE[0]
            assert sgl_worker.client.get("/health").status_code == 200
    """))
    # the sim logs its escaped child early, before its capture bars: a longer tail reaches it
    result = pytester.runpytest_subprocess(*SIM, "--sgl-reorder", "off", "--sgl-tail-lines", "150", timeout=90)
    # 1 and 4 pass but error at teardown; 2 fails; 3, 5, 6, 7 pass
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("failed"), outcomes.get("errors")) == (6, 1, 2), outcomes
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_1_dies_test_passes*",
        "*worker qwen3-0.6b exited with code -9 (SIGKILL) during the test: * (on 127.0.0.1:*",
        "log: *sglang-worker-*.log",
        "last lines of the log*:",
        "*spawned scheduler pid=*",
    ])
    result.stdout.fnmatch_lines([  # the death leads the failed test's report, its assertion follows
        "*_ test_2_dies_test_fails*",
        "worker qwen3-0.6b exited with code -9 (SIGKILL) during the test: RuntimeError: simulated death after 1 "
        "requests* (on 127.0.0.1:*",
        "log: *sglang-worker-*.log",
        "what the test met, in its own frames*",
        "*the router saw a connection reset*",
        "*- sglang worker qwen3-0.6b 127.0.0.1:* exited with code -9 (SIGKILL) during the test -*",
        "last lines of the log*:",
    ])
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_4_terminated_from_outside*",
        "*exited with code 0 during the test*",
        "*SIGTERM received*",
    ])
    result.stdout.fnmatch_lines([
        "*worker qwen3-0.6b: * — died while idle in the pool; replacing it (on 127.0.0.1:*",
        "advice: *",
    ])
    assert "INTERNALERROR" not in out
    assert len(re.findall(r"log kept: ", out)) == 4, out  # the four dead workers' logs
    assert_nothing_left(sim_env)


# --------------------------------------------------------------------------------------------------------
# A port taken between reservation and bind
# --------------------------------------------------------------------------------------------------------

GRAB_LAUNCHER = grab_launcher("pytest_sglworker.sim")


@pytest.mark.parametrize("leaves", [False, True], ids=["taker-stays", "taker-leaves"])
def test_port_taken_between_reservation_and_bind_is_retried_on_another_block(
    pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, leaves: bool
) -> None:
    """The retry takes another block, whether the taker still listens there (the block's check refuses it) or has
    left by then (it listens no more once the engine's log shows the failed bind): the block a retry names last
    would otherwise be this process's first again."""
    pytester.makepyfile(grab_launcher=GRAB_LAUNCHER)
    flag = pytester.path / "grabbed"
    monkeypatch.setenv("GRAB_FLAG", str(flag))
    if leaves:
        monkeypatch.setenv("GRAB_LEAVE", "1")
    pytester.makepyfile(test_grab="""
        import os

        def test_serves_on_another_port(sgl_worker):
            grabbed = int(open(os.environ["GRAB_FLAG"]).read().split()[0])
            assert sgl_worker.port != grabbed
            assert sgl_worker.client.get("/health").status_code == 200
    """)
    launcher = f"{sys.executable} {pytester.path / 'grab_launcher.py'}"
    try:
        result = pytester.runpytest_subprocess(*SIM, "--sgl-launcher", launcher, "test_grab.py", timeout=90)
        result.assert_outcomes(passed=1)
        port, foreign = (int(x) for x in flag.read_text().split())
        # The foreign listener really held the first port: the engine's bind failed there and was retried.
        first_log = Path(sim_env["SGLWORKER_LOG_DIR"]) / f"sglang-worker-{port}.log"
        text = first_log.read_text()
        assert "error while attempting to bind on address ('127.0.0.1', " + str(port) in text
        assert "address already in use" in text.lower()
        if not leaves:
            assert not _gone(foreign)  # nobody of ours touched the foreign process
    finally:
        if flag.exists():
            with contextlib.suppress(psutil.Error):
                psutil.Process(int(flag.read_text().split()[1])).kill()
    assert_nothing_left(sim_env)


# --------------------------------------------------------------------------------------------------------
# Clear errors before launch
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a small tmpfs (root only; skipped where mounting is not allowed)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                              text=True) if os.geteuid() == 0 else None
        if done is None or done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() if done else 'not root'}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _clear_error_before_launch(pytester: pytest.Pytester, sim_env: dict[str, str], *args: str,
                               expect: list[str]) -> pytest.RunResult:
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess(*args, timeout=60)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(expect)
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out
    log_dir = Path(sim_env["SGLWORKER_LOG_DIR"])
    assert not log_dir.is_dir() or not list(log_dir.glob("*.log")), "nothing may be launched"
    assert_nothing_left(sim_env)
    return result


def test_unwritable_log_dir(pytester: pytest.Pytester, sim_env: dict[str, str], tmpfs: Callable[[str], Path],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    point = tmpfs("size=1m,mode=0755")
    (point / "logs").mkdir(mode=0o700)
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
    monkeypatch.setenv("SGLWORKER_LOG_DIR", str(point / "logs"))
    _clear_error_before_launch(pytester, {**sim_env, "SGLWORKER_LOG_DIR": str(point / "logs")}, *SIM,
                               expect=[f"*log directory {point / 'logs'} is not writable*"])


def test_full_log_dir(pytester: pytest.Pytester, sim_env: dict[str, str], tmpfs: Callable[[str], Path],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    point = tmpfs("size=256k,mode=0755")
    logs = point / "logs"
    logs.mkdir(mode=0o700)
    with open(point / "filler", "wb") as fh:
        try:
            fh.write(b"\0" * (1024 * 1024))
        except OSError:
            pass
    monkeypatch.setenv("SGLWORKER_LOG_DIR", str(logs))
    _clear_error_before_launch(pytester, {**sim_env, "SGLWORKER_LOG_DIR": str(logs)}, *SIM,
                               expect=[f"*log directory {logs} is full (0 KiB free*"])


@pytest.mark.parametrize("kind", ["missing", "not executable"])
def test_bad_launcher_executable(pytester: pytest.Pytester, sim_env: dict[str, str], kind: str) -> None:
    path = pytester.path / "engine.sh"
    if kind == "not executable":
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o644)
    problem = "not found" if kind == "missing" else "is not executable"
    _clear_error_before_launch(pytester, sim_env, *SIM, "--sgl-launcher", f"{path} --serve",
                               expect=[f"*launcher '{path}' {problem}*"])


def test_sglang_not_installed_is_an_error_before_launch(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    """The default launcher, ``<python> -m sglang.launch_server``, with a python that lacks sglang."""
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed in this environment")
    _clear_error_before_launch(
        pytester, sim_env, "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1", "-p", "no:cacheprovider",
        expect=[f"*{sys.executable} cannot import 'sglang', so '{sys.executable} -m sglang.launch_server' "
                "cannot start: sglang is not installed for that python*"],
    )


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def test_nvml_failing(pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    if _nvml_works():
        pytest.skip("NVML works on this machine")
    pytester.makepyfile("def test_x(sgl_worker): pass")
    # GPUs asked for explicitly: a usage error naming where the value came from, before anything launches.
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b", "--sgl-gpus", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sgl-gpus: NVML is not available*"])
    monkeypatch.setenv("SGLWORKER_GPUS", "0")
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*SGLWORKER_GPUS: NVML is not available*"])
    monkeypatch.delenv("SGLWORKER_GPUS")
    # The same under xdist, where a worker process cannot stop the session: each worker test fails with it.
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-gpus", "0", "-n", "1")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*--sgl-gpus: NVML is not available*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    # Not asked for: the worker tests skip with the reason.
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*no GPU inventory: NVML is not available*"])
    assert_nothing_left(sim_env)


# --------------------------------------------------------------------------------------------------------
# Invalid values: every option, from every source; every marker argument
# --------------------------------------------------------------------------------------------------------

#: option name -> (bad value, fragment of the message); "{file}" is a regular file, "{dir}" a directory.
BAD_VALUES: dict[str, tuple[str, str]] = {
    "engine": ("gpu", "'gpu' is not an engine; choose 'real' or 'sim'"),
    "launcher": ("'unbalanced", "cannot split launcher"),
    "log-dir": ("{file}", "exists and is not a directory"),
    "lock-dir": ("{file}", "exists and is not a directory"),
    "startup-timeout": ("nan", "must be greater than 0"),
    "lease-timeout": ("-5", "must be greater than 0"),
    "gpus": ("sim:0", "a simulated inventory needs at least one GPU"),
    "port-range": ("20000-20002", "less than one worker's block of 4"),
    "keep-logs": ("maybe", "is not 'on' or 'off'"),
    "reuse": ("maybe", "is not 'on' or 'off'"),
    "reorder": ("sideways", "is not 'on' or 'off'"),
    "dist": ("sideways", "is not 'auto', 'on' or 'off'"),
    "report": ("{dir}", "is a directory"),
    "tail-lines": ("-3", "must be 0 or more"),
    "card": ("B200-1T", "unknown GPU card"),
    "router-launcher": ("'unbalanced", "cannot split launcher"),
    "timeline": ("{dir}", "is a directory"),
    "trace": ("{dir}", "is a directory"),
    "log-retention-count": ("-1", "must be 0 or more"),
    "log-retention-policy": ("some", "is not a retention policy; choose 'all', 'failed' or 'none'"),
    "launch-ahead": ("many", "is not an integer"),
    "shard": ("3/2", "there is no shard 3 of 2"),
    "shard-report": (" , ", "no path given"),
    "cluster": ("yarn", "is not a cluster; choose 'ray'"),
    "keep-warm": ("soon", "is not a TTL: give 'on', 'off', or a duration"),
}
#: options whose bad value is only seen when a worker is needed: a clear error on each worker test.
PER_TEST = {"log-dir", "lock-dir"}


def test_every_option_has_a_bad_value_here() -> None:
    assert {opt.name for opt in plugin_options.OPTIONS} == set(BAD_VALUES)


def _option_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str, env: str, ini: str,
                source: str, value: str) -> tuple[pytest.RunResult, str]:
    (pytester.path / "a_file").write_text("")
    (pytester.path / "a_dir").mkdir(exist_ok=True)
    value = value.format(file=pytester.path / "a_file", dir=pytester.path / "a_dir")
    pytester.makepyfile("def test_x(sgl_worker): pass")
    args = ["-p", "no:cacheprovider", "-p", "no:xdist"]
    if name != "model":
        args += ["--sgl-model", "qwen3-0.6b"]
    if name != "engine":
        args += ["--sgl-engine", "sim"]
    if source == "cli":
        flag = "--sgl-model" if name == "model" else f"--sgl-{name}"
        args.append(f"{flag}={value}")
        label = flag
    elif source == "env":
        monkeypatch.setenv(env, value)
        label = env
    else:
        monkeypatch.delenv(env, raising=False)  # the environment would win over the ini file
        pytester.makeini(f"[pytest]\n{ini} = {value}\n")
        label = f"ini {ini}"
    return pytester.runpytest(*args), label


@pytest.mark.parametrize("source", ["cli", "env", "ini"])
@pytest.mark.parametrize("opt", plugin_options.OPTIONS, ids=lambda opt: opt.name)
def test_invalid_option_value(pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                              opt: plugin_options._Opt, source: str) -> None:
    value, fragment = BAD_VALUES[opt.name]
    result, label = _option_run(pytester, monkeypatch, opt.name, opt.env, opt.ini, source, value)
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    if opt.name in PER_TEST:
        result.assert_outcomes(errors=1)
        assert fragment in out
    elif opt.name == "keep-logs" and source == "cli":  # a flag: argparse refuses a value
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert "--sgl-keep-logs: ignored explicit argument 'maybe'" in out
    else:
        assert result.ret == pytest.ExitCode.USAGE_ERROR, out
        assert f"{label}: invalid value" in out and fragment in out, out
    assert_nothing_left(sim_env)


@pytest.mark.parametrize("source", ["cli", "env", "ini"])
def test_unknown_model_from_every_source(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                         source: str) -> None:
    result, label = _option_run(pytester, monkeypatch, "model", "SGLWORKER_MODELS", "sgl_models", source, "nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{label}: unknown model(s) 'nope'; known: *"])


@pytest.mark.parametrize(
    ("arg", "expect"),
    [
        ("--sgl-log-dir=", ["*--sgl-log-dir: invalid value '': the path is empty*"]),
        ("--sgl-lock-dir= ", ["*--sgl-lock-dir: invalid value ' ': the path is empty*"]),
        ("--sgl-report=", ["*--sgl-report: invalid value '': the path is empty*"]),
        ("--sgl-startup-timeout=0", ["*--sgl-startup-timeout: invalid value '0': '0' must be greater than 0*"]),
        ("--sgl-port-range=70000-80000", ["*--sgl-port-range: invalid value*ports lie between 1 and 65535*"]),
        ("--sgl-gpus=nvidia", ["*--sgl-gpus: invalid value 'nvidia'*"]),
    ],
)
def test_more_invalid_values(pytester: pytest.Pytester, arg: str, expect: list[str]) -> None:
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim", arg)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(expect)


def test_unwritable_report_path_is_an_error_line_not_a_crash(pytester: pytest.Pytester,
                                                              sim_env: dict[str, str]) -> None:
    (pytester.path / "a_file").write_text("")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim",
                                           f"--sgl-report={pytester.path / 'a_file' / 'report.json'}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["sglworker: ERROR: cannot write the run report to *a_file/report.json (--sgl-report)*"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


#: (decorators, fixture, fragment of the error)
BAD_MARKERS: list[tuple[str, str, str]] = [
    ('@pytest.mark.sgl_worker("positional")', "sgl_worker", "takes keyword arguments only"),
    ("@pytest.mark.sgl_worker(bogus=1)", "sgl_worker", "unknown argument(s) bogus"),
    ('@pytest.mark.sgl_worker(args="--max-total-tokens 64")', "sgl_worker", "not the string"),
    ("@pytest.mark.sgl_worker(args=[1, 2])", "sgl_worker", "must contain strings only"),
    ("@pytest.mark.sgl_worker(args=5)", "sgl_worker", "must be a list of arguments, got 5"),
    ('@pytest.mark.sgl_worker(args={"--port": "1"})', "sgl_worker", "must be a list of arguments"),
    ('@pytest.mark.sgl_worker(env="A=1")', "sgl_worker", "must be a dict of strings to strings"),
    ('@pytest.mark.sgl_worker(env={"A": 1})', "sgl_worker", "must be a dict of strings to strings"),
    ('@pytest.mark.sgl_worker(fresh="yes")', "sgl_worker", "must be True or False"),
    ("@pytest.mark.sgl_worker(startup_timeout=-1)", "sgl_worker", "must be a positive number of seconds"),
    ('@pytest.mark.sgl_worker(startup_timeout="5")', "sgl_worker", "must be a positive number of seconds"),
    ('@pytest.mark.sgl_worker(startup_timeout=float("nan"))', "sgl_worker", "must be a positive number of seconds"),
    ('@pytest.mark.sgl_worker(startup_timeout=float("inf"))', "sgl_worker", "must be a positive number of seconds"),
    ("@pytest.mark.sgl_worker(startup_timeout=True)", "sgl_worker", "must be a positive number of seconds"),
    ('@pytest.mark.sgl_worker(allow_foreign_host="")', "sgl_worker", "must be a non-empty reason string"),
    ("@pytest.mark.sgl_worker(allow_foreign_host=True)", "sgl_worker", "must be a non-empty reason string"),
    ('@pytest.mark.sgl_worker(args="x")', "sgl_spawn_worker", "not the string"),
    ("@pytest.mark.sgl_requires(None)", "sgl_model", "sgl_requires takes feature names (non-empty strings), got None"),
    ("@pytest.mark.sgl_requires(42)", "sgl_worker", "got 42"),
    ('@pytest.mark.sgl_requires("")', "sgl_model", "got ''"),
    ('@pytest.mark.sgl_requires(["chat", 1])', "sgl_model", "got 1"),
    ('@pytest.mark.sgl_requires(feature="chat")', "sgl_model", "takes feature names only, got keyword(s) feature"),
    ("@pytest.mark.sgl_budget_opt_out()", "sgl_worker", "sgl_budget_opt_out needs a reason"),
    ('@pytest.mark.sgl_budget_opt_out(reason="  ")', "sgl_worker", "sgl_budget_opt_out needs a reason"),
    ("@pytest.mark.sgl_budget_opt_out(reason=3)", "sgl_worker", "sgl_budget_opt_out needs a reason"),
    ('@pytest.mark.sgl_budget_opt_out("why", bogus=1)', "sgl_worker", "sgl_budget_opt_out takes one reason only"),
    ('@pytest.mark.sgl_budget_opt_out("why", "else")', "sgl_spawn_worker", "sgl_budget_opt_out takes one reason"),
]


def test_invalid_marker_arguments_fail_their_test_only(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    lines = ["import pytest", ""]
    for i, (decorator, fixture, _) in enumerate(BAD_MARKERS):
        lines += [decorator, f"def test_{i}({fixture}): pass", ""]
    lines += ["def test_fine(sgl_model): pass"]
    pytester.makepyfile("\n".join(lines))
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim", "-p", "no:xdist")
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out
    result.assert_outcomes(passed=1, errors=len(BAD_MARKERS))
    errors = {r.nodeid.split("::")[1].split("[")[0]: str(r.longrepr)
              for r in result.reprec.getreports("pytest_runtest_logreport") if r.when == "setup" and r.failed}
    for i, (decorator, _, fragment) in enumerate(BAD_MARKERS):
        assert fragment in errors.get(f"test_{i}", ""), (decorator, errors.get(f"test_{i}"))
        assert "Traceback" not in errors[f"test_{i}"]
    assert_nothing_left(sim_env)


# --------------------------------------------------------------------------------------------------------
# Scale
# --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_short_soak_leaks_nothing(tmp_path: Path) -> None:
    """bench/soak.py at a small scale: 40 launches and teardowns under -n 2 on sim:2, nothing leaked."""
    soak = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    figures_path = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(soak), "--launches", "40", "--json", str(figures_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(figures_path.read_text())
    assert figures["launches"] == 40 and figures["tests_sampled"] == 40
    for leak in ("leaked_processes", "leaked_ports", "leaked_lease_records", "held_locks", "leftover_logs"):
        assert not figures[leak], (leak, figures[leak])
    assert all(f["fd_growth"] == 0 for f in figures["fd_growth"].values()), figures["fd_growth"]
    # The detectors are not blind: a run that leaks an fd per launch and a process per xdist worker fails.
    done = subprocess.run([sys.executable, str(soak), "--launches", "8", "--inject-leak", "--grace", "1",
                           "--json", str(figures_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    figures = json.loads(figures_path.read_text())
    assert len(figures["leaked_processes"]) == 2
    assert all(f["fd_growth"] > 0 for f in figures["fd_growth"].values()), figures["fd_growth"]
    shutil.rmtree(re.search(r"work directory kept: (\S+)", done.stderr).group(1), ignore_errors=True)


# --------------------------------------------------------------------------------------------------------
# Issue #12: hostile engines, hostile values, full disks, frozen and escaping workers
# --------------------------------------------------------------------------------------------------------

TRICKLE_ENGINE = r'''
"""An engine that accepts every request and trickles its answer forever: after "HTTP/1.1 200 OK" one header
line (TRICKLE_MODE=headers) or one body byte of a 1 MB body (TRICKLE_MODE=body) every 0.5 s."""
import os, socket, sys, threading, time

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
mode = os.environ.get("TRICKLE_MODE", "headers")
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen(64)
print(f"trickling engine on port {port} ({mode})", flush=True)


def serve(conn):
    with conn:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            if mode == "body":
                conn.sendall(b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
            n = 0
            while True:
                time.sleep(0.5)
                conn.sendall(f"X-Trickle-{n}: still coming\r\n".encode() if mode == "headers" else b" ")
                n += 1
        except OSError:
            pass


while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''


@pytest.mark.parametrize("mode", ["headers", "body"])
def test_trickled_health_answer_cannot_hold_the_startup_past_its_deadline(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Item 1: every probe is bounded by a whole-request deadline, so the startup deadline holds whatever the
    engine does on the wire (a per-read timeout would be reset by every trickled byte, forever)."""
    pytester.makepyfile(trickle_engine=TRICKLE_ENGINE)
    pytester.makepyfile(test_trickle="def test_x(sgl_worker):\n    raise AssertionError('never healthy')\n")
    monkeypatch.setenv("TRICKLE_MODE", mode)
    timeout = 3
    # A probe bounded per read would never end (the trickle is endless): the session would run into its 60 s
    # timeout and never say "did not become healthy". With a whole-request deadline, the startup deadline ends it.
    result = pytester.runpytest_subprocess(
        *SIM, "--sgl-launcher", f"{sys.executable} {pytester.path / 'trickle_engine.py'}",
        "--sgl-startup-timeout", str(timeout), "-vv", "test_trickle.py", timeout=60)
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([f"*worker qwen3-0.6b did not become healthy within {timeout} s "
                                 "(last health answer: no complete answer to GET /ready in time)*"])
    assert "INTERNALERROR" not in out and "Traceback" not in out
    assert_nothing_left(sim_env)


@pytest.mark.parametrize("spec", ['ModelSpec("bad", "org/bad", float("nan"))',
                                  '{"bad": {"model": "org/bad", "memory_gb": float("inf")}}'])
def test_non_finite_memory_spec_is_a_usage_error_not_a_crash(pytester: pytest.Pytester, spec: str) -> None:
    """Item 3: nan/inf passed ``memory_gb <= 0`` and crashed collection in round(); refused where specs are made."""
    register = f"registry.add({spec})" if spec.startswith("ModelSpec") else f"registry.update({spec})"
    pytester.makeconftest(f"""
        from pytest_sglworker import ModelSpec

        def pytest_sglworker_register_specs(registry):
            {register}
    """)
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess("--sgl-engine", "sim", "--sgl-model", "bad", "-p", "no:cacheprovider",
                                           timeout=60)
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    value = "nan" if "nan" in spec else "inf"
    result.stderr.fnmatch_lines([f"*pytest_sglworker_register_specs in *conftest.py: model spec 'bad': "
                                 f"'memory_gb' must be a positive number (finite, in GiB), got {value}*"])


FREEZE_TESTS = """
import json, os, signal, time

SEEN = {}

def test_1_freezes_its_pooled_worker(sgl_worker):
    SEEN["pid"] = sgl_worker.pid
    os.kill(sgl_worker.pid, signal.SIGSTOP)

def test_2_gets_a_fresh_healthy_worker(sgl_worker):
    assert sgl_worker.pid != SEEN["pid"]
    assert sgl_worker.client.get("/health", timeout=5).status_code == 200
    with open("freeze.json", "w") as fh:
        json.dump({"old": SEEN["pid"], "new": sgl_worker.pid}, fh)
"""


def test_frozen_pooled_worker_is_replaced_quickly_not_handed_on(pytester: pytest.Pytester,
                                                                 sim_env: dict[str, str]) -> None:
    """Item 5: a SIGSTOPped worker accepts connections but answers nothing; the reuse check probes its health
    with a short whole-request deadline, so the next test gets a fresh worker (not a ReadTimeout after 90 s),
    and the stopped one is torn down at once (SIGCONT with its SIGTERM), not after 15 s more."""
    pytester.makepyfile(test_freeze=FREEZE_TESTS)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-reorder", "off", "-p", "no:randomly", timeout=120)
    result.assert_outcomes(passed=2)
    seen = json.loads((pytester.path / "freeze.json").read_text())
    out = result.stdout.str()
    # The reuse probe's short whole-request deadline found it (below), never the 90 s read timeout; that the
    # stopped worker's teardown resumes it with its SIGTERM is held by tests/resources/test_reaper.py.
    # It says why: the worker is alive but does not answer (not "died"): the pool finds it when the test gives it
    # back and reads its runtime faults, to set back what the test changed.
    result.stdout.fnmatch_lines([f"*worker qwen3-0.6b*does not answer (frozen or wedged) (GET /_sim/faults: no "
                                 f"complete answer*; retiring it (on 127.0.0.1:*, pid {seen['old']}*"])
    assert "died while idle" not in out
    assert "INTERNALERROR" not in out and "ReadTimeout" not in out
    assert_nothing_left(sim_env, pids=(seen["old"], seen["new"]))


DEAF_ENGINE = r'''
"""A healthy engine that misses its first SIGTERM, as a multi-threaded engine does when, resumed by SIGCONT, the
signal lands on a thread other than the one that acts on it (the simulated engine did, in 1 of 10 to 20
teardowns of a stopped worker, until its main thread waited on Python's signal wakeup pipe). The second SIGTERM
ends it."""
import json, os, signal, socket, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
seen = []


def on_term(signum, frame):
    seen.append(time.monotonic())
    if len(seen) >= 2:
        with open(f"{os.environ['DEAF_TERMS']}.{os.getpid()}", "w") as fh:
            json.dump(seen, fh)
        os._exit(0)


signal.signal(signal.SIGTERM, on_term)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
server.daemon_threads = True
print("The server is fired up and ready to roll!", flush=True)
server.serve_forever()
'''


@pytest.mark.slow
def test_stopped_worker_that_misses_its_first_sigterm_is_torn_down_in_seconds(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 5: the teardown of a stopped worker must not take 10 to 15 s extra. It waited the whole term_timeout
    (10 s) whenever the engine missed the first SIGTERM; now the SIGTERM is sent once more after a second."""
    import inspect

    from pytest_sglworker.workers.process import ManagedProcess

    monkeypatch.setenv("DEAF_TERMS", str(pytester.path / "deaf-terms.json"))
    pytester.makepyfile(deaf_engine=DEAF_ENGINE)
    pytester.makepyfile(test_freeze=FREEZE_TESTS)
    result = pytester.runpytest_subprocess(
        *SIM, "--sgl-launcher", f"{sys.executable} {pytester.path / 'deaf_engine.py'}", "--sgl-reorder", "off",
        "-p", "no:randomly", "test_freeze.py", timeout=120)
    result.assert_outcomes(passed=2)
    seen = json.loads((pytester.path / "freeze.json").read_text())
    assert_nothing_left(sim_env, pids=(seen["old"], seen["new"]))
    # The stopped worker's second SIGTERM (the one that ended it) came from the resend, before its teardown's grace
    # was over, where otherwise only the group's SIGTERM after that grace would have ended it.
    grace = inspect.signature(ManagedProcess.stop).parameters["term_timeout"].default
    first, second = json.loads((pytester.path / f"deaf-terms.json.{seen['old']}").read_text())
    assert second - first < grace, (second - first, grace)


ESCAPING_ENGINE = r'''
"""A healthy engine whose grandchild escapes: it calls setsid, drops the ownership marker (a new process with a
clean environment: /proc/<pid>/environ never changes after exec) and inherits the worker's listening socket
(ESCAPE=socket) or opens a listener of its own on the block's spare port (ESCAPE=spare). It writes its pid to
ESCAPEE_PID_FILE and ends by itself after 120 s."""
import json, os, socket, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
mode = os.environ["ESCAPE"]
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))
sock.listen(64)

ESCAPEE = """
import os, socket, sys, time
fd, mode, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if mode == "socket":
    held = socket.socket(fileno=fd)          # the worker's own listening socket
else:
    os.close(fd)
    held = socket.socket()
    held.bind(("127.0.0.1", port + 2))       # a port of the block, on a socket of its own
    held.listen(1)
with open(os.environ["ESCAPEE_PID_FILE"] + ".tmp", "w") as fh:
    fh.write(str(os.getpid()))
os.replace(os.environ["ESCAPEE_PID_FILE"] + ".tmp", os.environ["ESCAPEE_PID_FILE"])
time.sleep(120)
"""
SPAWNER = """
import os, subprocess, sys
fd = int(sys.argv[1])
env = {k: v for k, v in os.environ.items() if k != "SGLWORKER_OWNER"}
subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[1:2], *sys.argv[3:]], pass_fds=(fd,), env=env,
                 start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
"""
# The spawner exits at once: the escapee is re-parented, no descendant of the worker any more.
subprocess.run([sys.executable, "-c", SPAWNER, str(sock.fileno()), ESCAPEE, mode, str(port)],
               pass_fds=(sock.fileno(),), check=True)
# Ready only once the escapee is in place (its pid file is written after it closed the inherited socket, or kept
# it): else, on a loaded machine, the teardown could meet it still starting, holding the HTTP port it was handed.
import time
deadline = time.monotonic() + 60
while not os.path.exists(os.environ["ESCAPEE_PID_FILE"]):
    if time.monotonic() > deadline:
        sys.exit("the escapee never wrote its pid file")
    time.sleep(0.05)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"model_path": "org/escaping"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", port), Handler, bind_and_activate=False)
server.socket.close()
server.socket = sock
print("The server is fired up and ready to roll!", flush=True)
server.serve_forever()
'''


def _listeners(port: int) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in proc.net_connections("tcp")):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def _end(pid: int) -> None:
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("escape", ["socket", "spare"])
def test_escaped_listener_does_not_keep_the_workers_port(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                          monkeypatch: pytest.MonkeyPatch, escape: str) -> None:
    """Item 6: a grandchild that calls setsid, drops the marker and keeps LISTEN on a port of the worker's block
    survives teardown; today the test passes silently and the port stays taken."""
    pytester.makepyfile(escaping_engine=ESCAPING_ENGINE)
    pytester.makepyfile(test_escape="""
        import json

        def test_uses_the_worker(sgl_worker):
            with open("port.json", "w") as fh:
                json.dump({"port": sgl_worker.port}, fh)
            assert sgl_worker.client.get("/health").status_code == 200
    """)
    pid_file = pytester.path / "escapee.pid"
    monkeypatch.setenv("ESCAPEE_PID_FILE", str(pid_file))
    monkeypatch.setenv("ESCAPE", escape)
    result = pytester.runpytest_subprocess(
        *SIM, "--sgl-launcher", f"{sys.executable} {pytester.path / 'escaping_engine.py'}", "test_escape.py",
        timeout=90)
    escapee = int(pid_file.read_text()) if pid_file.exists() else None
    port = json.loads((pytester.path / "port.json").read_text())["port"]
    listened = port if escape == "socket" else port + 2
    still = _listeners(listened)
    survived = escapee is not None and not _gone(escapee)
    if escapee is not None:
        _end(escapee)  # ours to end, by pid, whatever the plugin did
    result.assert_outcomes(passed=1)
    assert escapee is not None, result.stdout.str()
    out = result.stdout.str()
    if escape == "socket":  # it holds the worker's own socket: provably ours, killed
        assert not survived and still == [], (still, out)
        assert f"{escapee}" in out and f"{port}" in out, out
    else:  # a socket of its own, not provably ours: left alone, the block quarantined, a warning
        assert still == [escapee]
        assert f"{listened}" in out and "quarantin" in out, out


def test_report_on_a_full_disk_is_whole_or_absent(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                   tmpfs: Callable[[str], Path]) -> None:
    """Item 8: a full disk left a 0-byte --sgl-report; the earlier report must stay whole (the report writer goes
    through state.atomic_write)."""
    point = tmpfs("size=64k,mode=0755")
    report = point / "report.json"
    report.write_text('{"schema": "pytest-sglworker/report/v1", "earlier": true}\n')
    with open(point / "filler", "wb") as fh, contextlib.suppress(OSError):
        fh.write(b"\0" * (1024 * 1024))
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim",
                                           f"--sgl-report={report}", "-p", "no:cacheprovider", timeout=60)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"sglworker: ERROR: cannot write the run report to {report} (--sgl-report): *"])
    assert json.loads(report.read_text()) == {"schema": "pytest-sglworker/report/v1", "earlier": True}
    assert [p.name for p in point.iterdir() if p.name.endswith(".tmp")] == []


def test_record_of_a_live_process_without_the_lock_does_not_stall_the_lease(pytester: pytest.Pytester,
                                                                            sim_env: dict[str, str]) -> None:
    """Item 9: a holder record naming a live pid (here this very test process) that holds no lock made the
    declared GPU look full until the lease timeout. The lock is the truth."""
    import socket

    lock_dir = Path(sim_env["SGLWORKER_LOCK_DIR"])
    lock_dir.mkdir(mode=0o700, parents=True)
    (lock_dir / "gpu-sim-1x80-0.json").write_text(json.dumps({
        "pid": os.getpid(), "hostname": socket.gethostname(), "holder": "a session that forgot its record",
        "since": time.time(), "uuid": "GPU-sim-000000000000", "memory_mib": 81920, "index": 0,
        "namespace": "sim-1x80", "gpus": [0]}))
    pytester.makepyfile(NEXT_TEST)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-lease-timeout", "20", timeout=90)
    result.assert_outcomes(passed=1)  # a stalled lease would have timed out: an error, not a pass
    assert "waiting for 1 GPU" not in result.stdout.str()
    assert_nothing_left(sim_env)


def _free_block() -> tuple[int, int]:
    low = free_port_block()
    return low, low + 3


def test_a_second_session_queues_for_the_only_port_block(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                         session_factory: Callable[..., Session]) -> None:
    """Item 9: with one port block, a second session failed all its tests in 0.3 s instead of waiting for the
    block the way it waits for a GPU lease."""
    low, high = _free_block()
    pytester.makepyfile(test_holder=RECORD_PIDS + textwrap.dedent("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child"})
        def test_holds_the_block(sgl_worker):
            record_pids(sgl_worker)
            deadline = time.monotonic() + 60
            while not os.path.exists("go") and time.monotonic() < deadline:
                time.sleep(0.05)
    """))
    (pytester.path / "second").mkdir()
    (pytester.path / "second" / "test_second.py").write_text(NEXT_TEST)
    args = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:2", "-p", "no:cacheprovider",
            "--sgl-port-range", f"{low}-{high}", "--sgl-lease-timeout", "60"]
    first = session_factory("test_holder.py", *args)
    _read_pids(pytester, first)
    second = session_factory("second", *args)
    lock_dir = Path(sim_env["SGLWORKER_LOCK_DIR"])
    wait_for(lambda: list(lock_dir.glob(f"waiting-ports-{second.proc.pid}")) or second.proc.poll() is not None,
              30, "the second session to wait for the block")
    queued = second.proc.poll() is None
    (pytester.path / "go").write_text("")
    assert first.wait(60) == 0, first.output()
    code = second.wait(60)
    assert_nothing_left(sim_env)
    assert queued, second.output()
    assert code == 0, second.output()
    assert "waiting for a free block of 4 ports" in second.output()


@pytest.mark.slow
def test_health_endpoint_slower_than_one_probe_is_still_counted_healthy(pytester: pytest.Pytester,
                                                                       sim_env: dict[str, str]) -> None:
    """Item 9: every health answer takes 7 s, longer than the first probe's 5 s; the probe time doubles, so the
    worker is healthy well before the 60 s deadline (it was never counted healthy with a fixed 5 s)."""
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "slow_health=7"})
        def test_slow(sgl_worker):
            assert sgl_worker.client.get("/health").status_code == 200
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-startup-timeout", "60", timeout=120)
    result.assert_outcomes(passed=1)  # never counted healthy, it would have failed its 60 s startup deadline
    assert_nothing_left(sim_env)


@pytest.mark.parametrize("error", ['RuntimeError("spec server unreachable")', 'KeyError("models")'])
def test_register_specs_hook_that_raises_is_a_usage_error(pytester: pytest.Pytester, error: str) -> None:
    """Item 4 (plugin.py): a raising pytest_sglworker_register_specs ends the session as a usage error."""
    pytester.makeconftest(f"""
        def pytest_sglworker_register_specs(registry):
            raise {error}
    """)
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess("--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b",
                                           "-p", "no:cacheprovider", timeout=60)
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out
    kind, detail = error.split("(")[0], error.split('"')[1]
    result.stderr.fnmatch_lines([f"*pytest_sglworker_register_specs in *conftest.py*{kind}*{detail}*"])


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_to_pytest_is_an_orderly_interrupt(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                   session_factory: Callable[..., Session], signame: str) -> None:
    """Item 7 (plugin.py): a CI runner that cancels a job sends SIGTERM (a closed terminal, SIGHUP)."""
    pytester.makepyfile(RECORD_PIDS + textwrap.dedent("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child"})
        def test_waits(sgl_worker):
            record_pids(sgl_worker)
            deadline = time.monotonic() + 60
            while not os.path.exists("go") and time.monotonic() < deadline:
                time.sleep(0.05)
    """))
    report = pytester.path / "report.json"
    session = session_factory(*SIM, f"--sgl-report={report}")
    pids = _read_pids(pytester, session)
    session.proc.send_signal(getattr(signal, signame))
    code = session.wait(30)
    # Whatever happened, nothing may be left: today the session watchdog cleans up after the killed session.
    assert_nothing_left(sim_env, timeout=15, pids=(pids["worker"], pids["child"]))
    out = session.output()
    signum = int(getattr(signal, signame))
    assert code == 128 + signum, (code, out)  # as for a process the signal ended, not pytest's 2
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    assert signame in out, out
    assert f"log kept: {Path(sim_env['SGLWORKER_LOG_DIR'])}/sglang-worker-{pids['port']}.log" in out, out
    written = json.loads(report.read_text())
    assert written["exitstatus"] == 128 + signum and written["interrupted"] is True, written


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupt_during_pytests_session_start_still_ends_the_session_in_order(
        pytester: pytest.Pytester, sim_env: dict[str, str], session_factory: Callable[..., Session],
        signame: str) -> None:
    """pytest skips pytest_sessionfinish when an interrupt lands in its session start (seen in a loaded CI run:
    a Ctrl-C while xdist started its workers): the exit status is still the signal's and the report is written,
    marked interrupted. The signal is sent from a conftest's pytest_sessionstart, so it lands there every time."""
    pytester.makeconftest(textwrap.dedent(f"""
        import os
        import signal

        def pytest_sessionstart(session):
            os.kill(os.getpid(), signal.{signame})
    """))
    pytester.makepyfile("""
        def test_never_runs(sgl_worker):
            raise AssertionError("the session was interrupted before its tests")
    """)
    report = pytester.path / "report.json"
    session = session_factory(*SIM, f"--sgl-report={report}")
    code = session.wait(60)
    out = session.output()
    signum = int(getattr(signal, signame))
    expected = int(pytest.ExitCode.INTERRUPTED) if signame == "SIGINT" else 128 + signum
    assert code == expected, out
    assert "INTERNALERROR" not in out and "test_never_runs" not in out, out
    written = json.loads(report.read_text())
    assert written["exitstatus"] == expected and written["interrupted"] is True, written
    assert written["launches"] == [], written
    assert_nothing_left(sim_env, timeout=15)


def _interrupted_while_xdist_starts(pytester: pytest.Pytester, session_factory: Callable[..., Session],
                                    conftest: str, expected: int) -> str:
    """A session under ``-n 2`` whose ``conftest`` interrupts it while xdist sets its workers up: it must end with
    ``expected``, its report marked interrupted, no test run. Returns its output."""
    pytester.makeconftest(conftest)
    pytester.makepyfile("""
        def test_never_runs(sgl_worker):
            raise AssertionError("the session was interrupted before its tests")
    """)
    report = pytester.path / "report.json"
    session = session_factory(*SIM, "-n", "2", f"--sgl-report={report}")
    code = session.wait(60)
    out = session.output()
    assert code == expected and "test_never_runs" not in out, out
    written = json.loads(report.read_text())
    assert written["exitstatus"] == expected and written["interrupted"] is True, written
    return out


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupt_that_lands_on_an_instruction_without_a_line_while_xdist_starts_still_ends_in_order(
        pytester: pytest.Pytester, sim_env: dict[str, str], session_factory: Callable[..., Session],
        signame: str) -> None:
    """The stress tier's Ctrl-C at 1.9 s (seed 1) landed while xdist started its workers, on an instruction with no
    source line (CPython makes many; ``re``'s parser, which the session start runs a lot of, is full of them): pytest's
    terminal reporter failed rendering that traceback entry (``TypeError: unsupported operand type(s) for -:
    'NoneType' and 'int'``), which escaped pytest: exit status 1 and no run report. Here a conftest's
    ``pytest_xdist_setupnodes`` (the controller, as xdist sets its workers up) sends the signal from code compiled
    without line numbers, so that it lands there every time."""
    conftest = textwrap.dedent(f"""
        import os
        import signal

        _NO_LINES = compile("os.kill(os.getpid(), signal.{signame})\\nsignal.getsignal(signal.SIGINT)\\n",
                            "<no lines>", "exec").replace(co_linetable=b"")

        def pytest_xdist_setupnodes(config, specs):
            exec(_NO_LINES, {{"os": os, "signal": signal}})
    """)
    signum = int(getattr(signal, signame))
    expected = int(pytest.ExitCode.INTERRUPTED) if signame == "SIGINT" else 128 + signum
    out = _interrupted_while_xdist_starts(pytester, session_factory, conftest, expected)
    assert "TypeError" not in out and "INTERNALERROR" not in out, out
    assert_nothing_left(sim_env, timeout=15)


def test_a_ctrl_c_whose_interrupt_xdist_lost_still_ends_the_run_as_interrupted(
        pytester: pytest.Pytester, sim_env: dict[str, str], session_factory: Callable[..., Session]) -> None:
    """A terminal's Ctrl-C reaches the whole process group: an xdist worker spawned a moment before dies of it first,
    and the controller's execnet then fails reading from it (``EOFError: couldn't load message header``) while the
    controller's own KeyboardInterrupt is lost on the way: pytest ended that run with INTERNALERROR (exit 3) and no
    report. Here the controller's ``pytest_xdist_setupnodes`` receives a SIGINT whose KeyboardInterrupt is lost in
    the same way, then meets the same EOFError: the run must end as the interrupt it was (exit 2, report marked
    interrupted, nothing left)."""
    conftest = textwrap.dedent("""
        import os
        import signal

        def pytest_xdist_setupnodes(config, specs):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                signal.getsignal(signal.SIGINT)  # the handler runs at the next instruction
            except KeyboardInterrupt:
                pass  # lost, as execnet loses it when its worker died of the same Ctrl-C
            raise EOFError("couldn't load message header, expected 9 bytes, got 0")
    """)
    _interrupted_while_xdist_starts(pytester, session_factory, conftest, int(pytest.ExitCode.INTERRUPTED))
    assert_nothing_left(sim_env, timeout=15)


@pytest.mark.slow
def test_short_hostile_soak_reports_every_failure_and_leaks_nothing(tmp_path: Path) -> None:
    """bench/soak.py --hostile at a small scale, without the escaped listener (see the next test): trickling,
    frozen, crashing and dying engines among healthy ones under -n 2; every failure reported as its kind
    must be, no startup past its deadline, nothing leaked."""
    soak = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    figures_path = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(soak), "--hostile", "--launches", "24", "--kinds",
                           "trickle,frozen,crash,die,healthy,escape_child", "--json", str(figures_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(figures_path.read_text())
    assert figures["launch_attempts"] == 24 and figures["tests"] == 24
    assert figures["failures_reported_correctly"] == figures["expected_failures"] == 12
    assert figures["longest_past_deadline_s"] <= 2.0
    for leak in ("leaked_processes", "leaked_ports", "leaked_lease_records", "held_locks", "leftover_logs"):
        assert not figures[leak], (leak, figures[leak])


@pytest.mark.slow
def test_short_hostile_soak_with_escaped_listeners_leaks_nothing(tmp_path: Path) -> None:
    soak = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    figures_path = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(soak), "--hostile", "--launches", "8", "--kinds", "escape,healthy",
                           "--grace", "2", "--json", str(figures_path)], capture_output=True, text=True, timeout=300)
    kept = re.search(r"work directory kept: (\S+)", done.stderr)
    if kept:
        shutil.rmtree(kept.group(1), ignore_errors=True)
    figures = json.loads(figures_path.read_text())
    assert figures["leaked_processes"] == {} and figures["leaked_ports"] == [], figures
    assert done.returncode == 0, done.stdout + done.stderr


def test_pooled_worker_with_a_slow_health_endpoint_is_still_reused(pytester: pytest.Pytester,
                                                                   sim_env: dict[str, str]) -> None:
    """Item 5's reuse check must not mistake slow for frozen: a worker whose health answer takes 2.5 s (the real
    engine's /health_generate on a loaded CPU runner can) was relaunched for every test, and counted as dead."""
    pytester.makepyfile("""
        import pytest

        SLOW = pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "slow_health=2.5"})
        SEEN = []

        @SLOW
        def test_a(sgl_worker):
            SEEN.append(sgl_worker.pid)

        @SLOW
        def test_b(sgl_worker):
            assert sgl_worker.pid == SEEN[0], "relaunched instead of reused"
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-reorder", "off", "-p", "no:randomly", timeout=120)
    assert_nothing_left(sim_env)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*1 launched, 1 reused*0 died*"])
