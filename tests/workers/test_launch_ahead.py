"""Launch ahead (``--sgl-launch-ahead``): while the tests of one configuration run, the next configuration's
workers start on free GPUs, so that they are ready when their first test begins. Real sessions against the
simulated engine; every test also checks that nothing is left running (tests/conftest.py)."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.plugin import timeline

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "-p", "no:cacheprovider", "-p", "no:randomly"]

SUITE = """
import time
import pytest

A = pytest.mark.sgl_worker(args=["--max-total-tokens", "1024"])
B = pytest.mark.sgl_worker(args=["--max-total-tokens", "2048"])

@A
def test_a1(sgl_worker): time.sleep(1.5)

@A
def test_a2(sgl_worker): time.sleep(1.5)

@B
def test_b1(sgl_worker): pass

@B
def test_b2(sgl_worker): pass
"""


def _report(pytester: pytest.Pytester) -> dict[str, Any]:
    return json.loads((pytester.path / "report.json").read_text())  # type: ignore[no-any-return]


def _timeline(launches: dict[str, dict[str, Any]]) -> str:
    """The launches' times and their tests' calls, in seconds from the first lease request: what a failed
    ordering assertion shows."""
    t0 = min(r["t_lease_requested"] for r in launches.values())
    lines = []
    for name, r in launches.items():
        times = " ".join(f"{k[2:]}={r[k] - t0:.2f}" for k in timeline._TIME_KEYS if r.get(k) is not None)
        tests = ", ".join(f"{t['nodeid'].split('::')[-1]} {t['t_start'] - t0:.2f}-{t['t_end'] - t0:.2f}"
                          for t in r["tests"])
        lines.append(f"  {name}: {times}; tests: {tests}")
    return "\n".join(lines)


def test_the_next_configuration_is_ready_when_its_first_test_begins(pytester: pytest.Pytester,
                                                                     sim_env: dict[str, str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "2")
    pytester.makepyfile(SUITE)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-gpus", "sim:2", "--sgl-report", "report.json", timeout=120)
    result.assert_outcomes(passed=4)
    launches = {r["label"].split()[-1]: r for r in _report(pytester)["launches"]}
    b = launches["2048"]
    first_b = min(t["t_start"] for t in b["tests"])
    assert b["t_ready"] <= first_b, "B was not ready when its first test began"
    assert b["t_leased"] < max(t["t_end"] for t in launches["1024"]["tests"])  # started during A's tests
    result.stdout.fnmatch_lines(["qwen3-0.6b --max-total-tokens 2048: 1 launched, 1 reused*"])


def test_launches_ahead_start_with_the_first_startup_and_when_a_gpu_comes_free(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Three configurations on two GPUs, startups long next to the tests, B's the longest. B starts alongside
    A's startup (A's own launch holds its lease: the other GPU is free), not once A is ready; C starts when A's
    last test is torn down and its GPU comes free, not once B's first test has its worker."""
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "1.5")
    pytester.makepyfile("""
        import pytest

        A = pytest.mark.sgl_worker(args=["--max-total-tokens", "1024"])
        B = pytest.mark.sgl_worker(args=["--max-total-tokens", "2048"], env={"SGLSIM_STARTUP_SECONDS": "5"})
        C = pytest.mark.sgl_worker(args=["--max-total-tokens", "3072"])

        @A
        def test_a1(sgl_worker): pass

        @A
        def test_a2(sgl_worker): pass

        @B
        def test_b1(sgl_worker): pass

        @C
        def test_c1(sgl_worker): pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-gpus", "sim:2", "--sgl-report", "report.json",
                                           timeout=120)  # the default, --sgl-launch-ahead 1
    result.assert_outcomes(passed=4)
    launches = {re.search(r"--max-total-tokens (\d+)", r["label"]).group(1): r  # type: ignore[union-attr]
                for r in _report(pytester)["launches"]}
    a, b, c = launches["1024"], launches["2048"], launches["3072"]
    assert len(launches) == 3
    # Each comparison is between two times the session's main thread took in turn, so that it holds whatever
    # the machine's load: a lease of a launch ahead is taken there (and its record says so), as are a
    # launch's readiness, a group's release and the start of a test's call (pytest's CallInfo.start).
    when = _timeline({"A": a, "B": b, "C": c})
    assert b["t_leased"] < a["t_ready"], f"B waited for A to be ready before it started\n{when}"
    assert a["t_released"] <= c["t_leased"], f"C started before a GPU was free\n{when}"
    b1 = min(t["t_start"] for t in b["tests"])
    assert c["t_leased"] < b1, f"C waited for B's first test to have its worker instead of starting when A's GPU " \
                               f"came free\n{when}"
    assert c["t_ready"] <= min(t["t_start"] for t in c["tests"]), when


def test_outcomes_are_the_same_with_and_without_launch_ahead(pytester: pytest.Pytester,
                                                             sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import pytest

        A = pytest.mark.sgl_worker(args=["--max-total-tokens", "1024"])
        B = pytest.mark.sgl_worker(args=["--max-total-tokens", "2048"])
        CRASH = pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "crash_oom"})

        @A
        def test_a_passes(sgl_worker): pass

        @A
        def test_a_fails(sgl_worker): raise AssertionError("a router bug")

        @CRASH
        def test_crash(sgl_worker): pass

        @B
        def test_b(sgl_worker): pass

        @pytest.mark.sgl_worker(fresh=True)
        def test_fresh(sgl_worker): pass

        def test_plain(): pass
    """)
    outcomes = []
    for ahead in ("0", "2"):
        result = pytester.runpytest_subprocess(*SIM, "--sgl-gpus", "sim:4", "--sgl-launch-ahead", ahead, "-rA",
                                               timeout=120)
        outcomes.append(sorted(line.split(" - ")[0] for line in result.outlines
                               if line.startswith(("PASSED ", "FAILED ", "ERROR "))))
    assert outcomes[0] == outcomes[1], outcomes
    assert len(outcomes[0]) == 6


def test_a_launch_ahead_that_fails_is_reported_on_the_test_that_needed_it(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # room for the short summary's message
    pytester.makepyfile("""
        import time
        import pytest

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "1024"])
        def test_first(sgl_worker): time.sleep(1)

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "crash_oom"})
        def test_needs_the_broken_one(sgl_worker): pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-gpus", "sim:2", "--sgl-report", "report.json", timeout=120)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*exited during startup with code -9 (SIGKILL)*",
                                 "ERROR *test_needs_the_broken_one* - Failed: worker qwen3-0.6b: CUDA out of memory*"])
    crashed = [r for r in _report(pytester)["launches"] if r["outcome"] == "startup_failed"]
    first = next(r for r in _report(pytester)["launches"] if r["outcome"] != "startup_failed")
    assert len(crashed) == 1 and crashed[0]["t_leased"] < max(t["t_end"] for t in first["tests"])


def test_nothing_launched_ahead_outlives_the_session(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(record))
    pytester.makepyfile("""
        import os
        import time
        import pytest

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "1024"])
        def test_stops_the_run(sgl_worker):
            # until the next two, launched ahead, have started (their engines record their start), however long a
            # loaded machine takes to start them
            deadline = time.monotonic() + 100
            while time.monotonic() < deadline:
                with open(os.environ["SGLSIM_RECORD"]) as fh:
                    if sum('"event": "start"' in line for line in fh) >= 3:
                        break
                time.sleep(0.05)
            raise AssertionError("-x ends the run here")

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "2048"], env={"SGLSIM_STARTUP_SECONDS": "0.2"})
        def test_never_runs(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "4096"], env={"SGLSIM_STARTUP_SECONDS": "300"})
        def test_never_runs_either(sgl_worker): pass
    """)
    # the session has 240 s: waiting for the 300 s startup ahead instead of calling it off would fail it
    result = pytester.runpytest_subprocess(*SIM, "--sgl-gpus", "sim:4", "--sgl-launch-ahead", "2", "-x", timeout=240)
    result.assert_outcomes(failed=1)
    events = [json.loads(line) for line in record.read_text().splitlines()]
    started = {e["pid"] for e in events if e["event"] == "start"}
    assert len(started) == 3  # both were launched ahead (and stopped: the autouse guard checks)
    ready = {e["pid"] for e in events if e["event"] == "ready"}
    ended = {e["pid"]: e.get("reason") for e in events if e["event"] == "exit"}
    unready = started - ready  # the 300 s startup never finishes (the 0.2 s one may not have either)
    assert unready and all(ended.get(pid) == "SIGTERM" for pid in unready), events  # ended during startup


def test_ctrl_c_while_workers_are_launched_ahead_leaves_nothing(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                                tmp_path: Path) -> None:
    import subprocess
    import sys

    pytester.makepyfile("""
        import os, time
        import pytest

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "1024"])
        def test_long(sgl_worker):
            open(os.environ["STARTED"], "w").close()
            time.sleep(60)

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "2048"], env={"SGLSIM_STARTUP_SECONDS": "20"})
        def test_next(sgl_worker): pass
    """)
    started = tmp_path / "started"
    import os

    from session_helpers import _default_sigint

    # SIGINT at its default in the inner session: under a background job of a non-interactive shell (a CI
    # script) it would start ignored, and the Ctrl-C below would do nothing
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *SIM, "--sgl-gpus", "sim:2"], cwd=pytester.path,
                            env={**os.environ, "STARTED": str(started)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    # the launch ahead is under way (a 20 s startup) once its worker has a log of its own
    logs = Path(sim_env["SGLWORKER_LOG_DIR"])
    while len(list(logs.glob("sglang-worker-*.log"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists() and len(list(logs.glob("sglang-worker-*.log"))) == 2, "no launch ahead under way"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "Traceback" not in out.split("KeyboardInterrupt")[0][-200:]
