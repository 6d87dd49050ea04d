"""Groups launched ahead are handed over within the run (issue 43): the xdist worker that runs a configuration's
tests adopts the group another xdist worker of the run launched ahead, through the proofs warm adoption has; the
group is torn down, leased and logged as any other, and nothing outlives the run."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from session_helpers import _default_sigint

from pytest_sglworker.resources.warm_records import WarmRecord

SIM = ("-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b")

#: six configurations on sim:8 under -n 2. c0 (4 tests) goes to one xdist worker (the giver), c1 to the other (the
#: taker). The controller launches c2..c5 ahead on the free GPUs, two on each worker (by test counts, alternately).
#: The giver's first test waits until the controller has handed one of its launches ahead to the other worker (which
#: runs out of tests first): so the taker runs its own, then takes over a launch ahead of the giver and adopts its
#: group; without the hand-over, that first test fails at its deadline.
SUITE = '''
import json, os, time
from pathlib import Path
import pytest

DONE = Path(os.environ["HANDOVER_DONE"])

def handed(run_dir):
    for path in run_dir.glob("ahead-*.json"):
        try:
            if json.loads(path.read_text()).get("adopt"):
                return True
        except ValueError:
            pass
    return False

def adopted_here():  # this xdist worker adopted a group handed over within the run (its warm record says so)
    from pytest_sglworker.resources.warm_records import warm_records

    return any(e.record is not None and e.record.adopter is not None and e.record.adopter.pid == os.getpid()
               for e in warm_records(Path(os.environ["SGLWORKER_LOCK_DIR"])))

def wait_for_gate():
    gate = Path(os.environ["HANDOVER_GATE"])
    deadline = time.monotonic() + 120
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.02)

def answered(run_dir):  # a giver's answer: its group went to the run
    for path in run_dir.glob("handed-*.json"):
        try:
            if json.loads(path.read_text()).get("handed") is True:
                return True
        except ValueError:
            pass
    return False

@pytest.mark.sgl_worker(args=["--max-total-tokens", "4096"])
@pytest.mark.parametrize("i", range(4))
def test_c0(sgl_worker, i, request):
    if i == 0:
        run_dir = Path(request.config.workerinput["sglworker_collection_map"])
        deadline = time.monotonic() + 120
        while not handed(run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handed(run_dir), "no configuration launched ahead here was handed to the other xdist worker"
        if os.environ.get("HANDOVER_WHILE_RUNNING"):  # handed over by this worker while this very test runs
            deadline = time.monotonic() + 60
            while not answered(run_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert answered(run_dir), "the group launched ahead here was not handed over while this test ran"
    if i == 3 and os.environ.get("HANDOVER_GATE"):  # the run is still on when the test that started it acts on it
        wait_for_gate()
'''
for _n in range(1, 6):
    SUITE += f'''
@pytest.mark.sgl_worker(args=["--max-total-tokens", "{4096 + _n}"])
@pytest.mark.skipif(os.environ.get("HANDOVER_SKIP") == "c{_n}", reason="skipped on purpose")
@pytest.mark.parametrize("i", range(3))
def test_c{_n}(sgl_worker, i):
    assert sgl_worker.client.get("/health").status_code == 200
    if i == 0 and os.environ.get("HANDOVER_GATE") and adopted_here():
        wait_for_gate()  # the act (a kill, an interrupt) lands in this test, however fast its process runs
    (DONE / f"done-{_n}-{{i}}").write_text(os.environ["PYTEST_XDIST_WORKER"] + " " + str(sgl_worker.pid))
    assert os.environ.get("HANDOVER_FAIL") != "c{_n}", "failing on purpose"
'''


@pytest.fixture
def handover(sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    done = tmp_path / "done"
    done.mkdir()
    monkeypatch.setenv("HANDOVER_DONE", str(done))
    monkeypatch.setenv("SGLSIM_RECORD", str(tmp_path / "sim-record.jsonl"))
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "1.0")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    return tmp_path


def _sims(record: Path) -> tuple[list[int], list[int]]:
    """The simulated engines the run started, and those that exited."""
    started, exited = [], []
    for line in record.read_text().splitlines():
        event = json.loads(line)
        (started if event["event"] == "start" else exited if event["event"] == "exit" else []).append(event["pid"])
    return started, exited


def _nothing_left(tmp_path: Path, started: list[int]) -> None:
    """Every engine started ended, every warm record and keeper with it (the keepers' exit is waited for: the
    kernel reaps them after their last action)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        keepers = [p for p in psutil.process_iter(["cmdline"])
                   if "pytest_sglworker.resources.warm_keeper" in " ".join(p.info["cmdline"] or ())
                   and str(tmp_path) in " ".join(p.info["cmdline"] or ())]
        records = list((tmp_path / "locks").glob("warm-*.json"))
        if not alive and not keepers and not records:
            return
        time.sleep(0.05)
    raise AssertionError(f"left running: engines {alive}, keepers {keepers}, records {records}")


def test_a_group_launched_ahead_by_one_xdist_worker_is_adopted_by_the_other(
        pytester: pytest.Pytester, handover: Path) -> None:
    pytester.makepyfile(test_handover=SUITE)
    report = handover / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "-v", "--sgl-gpus", "sim:8", "--sgl-report", str(report),
                                           "--sgl-keep-logs", timeout=180)
    result.assert_outcomes(passed=19)
    started, exited = _sims(handover / "sim-record.jsonl")
    assert len(started) == 6, started  # each configuration's engine launched once
    data = json.loads(report.read_text())
    launches: list[dict[str, Any]] = data["launches"]
    handed = [r for r in launches if r["outcome"] == "handed_over"]
    adopted = [r for r in launches if r["outcome"] == "adopted"]
    assert handed and {r["pid"] for r in adopted} >= {r["pid"] for r in handed}, launches
    by_pid = {r["pid"]: r for r in handed}  # every group launched ahead goes to the run, its launcher adopts it too
    taken = [r for r in adopted if r["xdist_worker"] != by_pid[r["pid"]]["xdist_worker"]]
    assert taken, "no group launched ahead by one xdist worker was adopted by the other"
    for record in taken:  # served there, its log in the run's log directory (the same file, linked)
        assert record["tests"], record
        log = Path(record["log_path"])
        assert log.is_file() and log.parent == Path(by_pid[record["pid"]]["log_path"]).parent
    assert "handed to another xdist worker" in result.stdout.str()
    assert "adopted" in result.stdout.str() and "started ahead in this run" in result.stdout.str()
    _nothing_left(handover, started)
    assert sorted(exited) == sorted(started)


def test_a_ready_group_is_handed_over_while_the_givers_own_test_runs(
        pytester: pytest.Pytester, handover: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The giver's follower thread hands a ready group over while the giver's own test runs: its first test waits for
    the giver's answer, and the other xdist worker adopts the group meanwhile. Before, the answer came only between the
    giver's tests (that test failed at its deadline, and the taker waited for the whole of it)."""
    pytester.makepyfile(test_handover=SUITE)
    monkeypatch.setenv("HANDOVER_WHILE_RUNNING", "1")
    report = handover / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "--sgl-gpus", "sim:8", "--sgl-report", str(report),
                                           timeout=180)
    result.assert_outcomes(passed=19)
    started, exited = _sims(handover / "sim-record.jsonl")
    assert len(started) == 6, started  # each configuration's engine launched once
    launches: list[dict[str, Any]] = json.loads(report.read_text())["launches"]
    givers = {r["pid"]: r["xdist_worker"] for r in launches if r["outcome"] == "handed_over"}
    taken = [r for r in launches if r["outcome"] == "adopted" and r["pid"] in givers
             and r["xdist_worker"] != givers[r["pid"]]]
    assert taken and all(r["tests"] for r in taken), launches
    _nothing_left(handover, started)
    assert sorted(exited) == sorted(started)


@pytest.mark.parametrize("fate", ["failed", "skipped"])
def test_nothing_outlives_the_run_when_the_adopting_test_fails_or_is_skipped(
        pytester: pytest.Pytester, handover: Path, monkeypatch: pytest.MonkeyPatch, fate: str) -> None:
    pytester.makepyfile(test_handover=SUITE)
    if fate == "failed":
        monkeypatch.setenv("HANDOVER_FAIL", "c5")
    else:  # c5's tests never ask for its group (launched ahead, maybe handed over, or not)
        monkeypatch.setenv("HANDOVER_SKIP", "c5")
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "--sgl-gpus", "sim:8", timeout=180)
    if fate == "failed":
        result.assert_outcomes(passed=16, failed=3)
    else:
        result.assert_outcomes(passed=16, skipped=3)
    started, _ = _sims(handover / "sim-record.jsonl")
    _nothing_left(handover, started)


def _act_once_handed(pytester: pytest.Pytester, handover: Path, monkeypatch: pytest.MonkeyPatch,
                     act: Callable[[WarmRecord, int], bool]) -> tuple[int, str]:
    """Run SUITE under ``-n 2`` as a process group of its own, with its signals at their defaults (a suite run as a
    shell's background job inherits SIGINT ignored, which the plugin rightly respects). Its last c0 test, and the
    first test of a group adopted within the run, wait for a gate, so that the run is still on, and the adopter still
    in a test of the group, while ``act(record, run_pid)`` is called for each record of a group handed to the run,
    until it returns True; then the gate opens. (Without the adopter's wait, a loaded machine let the adopter's
    tests end before the act, and a kill of the adopter landed between two tests.) Returns the run's exit status and
    output."""
    import signal
    import subprocess
    import sys

    from pytest_sglworker.resources.warm_records import warm_records

    pytester.makepyfile(test_handover=SUITE)
    gate = handover / "gate"
    monkeypatch.setenv("HANDOVER_GATE", str(gate))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *SIM, "-n", "2", "--sgl-gpus", "sim:8"],
                            cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
        deadline, acted = time.monotonic() + 120, False
        while not acted and time.monotonic() < deadline and proc.poll() is None:
            records = [e.record for e in warm_records(handover / "locks")]
            acted = any(act(r, proc.pid) for r in records if r is not None and r.run is not None)
            time.sleep(0.01)
        assert acted, "no group was handed to the run while it was on"
        gate.touch()
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return proc.returncode, output.decode(errors="replace")


@pytest.mark.parametrize("whom", ["group", "controller"])
def test_nothing_outlives_an_interrupted_run(pytester: pytest.Pytester, handover: Path,
                                            monkeypatch: pytest.MonkeyPatch, whom: str) -> None:
    """Once a group launched ahead is handed to the run (its record in the lock directory), Ctrl-C on the run (SIGINT to
    its process group), or a SIGINT to the xdist controller alone (``kill -INT``, which its xdist workers do not get:
    xdist ends them as the controller stops): the run ends, and with it every engine, keeper and record."""
    import signal

    def interrupt(record: WarmRecord, run: int) -> bool:
        if whom == "group":
            os.killpg(run, signal.SIGINT)
        else:
            os.kill(run, signal.SIGINT)
        return True

    status, text = _act_once_handed(pytester, handover, monkeypatch, interrupt)
    assert status != 0, text[-3000:]
    started, _ = _sims(handover / "sim-record.jsonl")
    _nothing_left(handover, started)


@pytest.mark.parametrize("whom", ["giver", "adopter"])
def test_nothing_outlives_an_xdist_worker_killed_during_the_hand_over(
        pytester: pytest.Pytester, handover: Path, monkeypatch: pytest.MonkeyPatch, whom: str) -> None:
    """Once a group launched ahead is handed to the run, SIGKILL of the xdist worker that kept it (the giver) or of the
    one that adopts it: no teardown of its own runs there. xdist reports the crash and goes on; the run ends, and with
    it every engine, keeper and record (the keepers' watch on the run, not the dead worker's cleanup)."""
    import signal

    def kill(record: WarmRecord, run: int) -> bool:
        party = record.kept_by if whom == "giver" else record.adopter
        if party is None or party.pid == run or not psutil.pid_exists(party.pid):
            return False
        os.kill(party.pid, signal.SIGKILL)
        return True

    _, text = _act_once_handed(pytester, handover, monkeypatch, kill)
    # the run went on: the test it crashed in fails, every other test passes (19 when the crash came in the teardown
    # of a test whose call had passed: xdist reports both)
    assert "crashed while running" in text and re.search(r"\b1 failed, 1[89] passed in", text), text[-3000:]
    if whom == "adopter":  # in the adopted group's first test, which waits for the act
        assert re.search(r"crashed while running '\S*test_c[1-5]\[\S*-0\]'", text), text[-3000:]
    started, _ = _sims(handover / "sim-record.jsonl")
    _nothing_left(handover, started)
