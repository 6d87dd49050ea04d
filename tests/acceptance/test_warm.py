"""Warm workers between runs (``--sgl-keep-warm``): a second session of an unchanged configuration adopts the
worker the first one left, and launches nothing; everything else (a changed configuration, a dead, frozen or busy
warm worker, an expired one) is refused or ended, and nothing outlives its TTL or a SIGKILL.

Every scenario runs real pytest sessions (``runpytest_subprocess``, or a ``Session`` process when a signal must
reach it) against the simulated engine, with private lock and log directories (``sim_env``). Waits are on
conditions with deadlines. Every test ends the warm workers it made (``--sgl-warm stop``, or a short TTL it waits
out): the autouse leftover check of ``tests/conftest.py`` fails a test that leaves one running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from warm_helpers import (
    gone,
    keeper_of,
    launches,
    lock_dir,
    pids,
    records,
    run,
    session,
    wait_for,
)

from pytest_sglworker.resources.warm_records import KEEPER_GRACE

# --------------------------------------------------------------------------------------------------------
# adoption
# --------------------------------------------------------------------------------------------------------


def test_second_run_adopts_the_warm_worker_and_launches_nothing(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                               warm: None) -> None:
    first, report1 = run(pytester, "r1", "--sgl-keep-warm=60")
    assert launches(report1) == 1 and len(report1["warm"]["kept"]) == 1 and report1["warm"]["keep_warm_seconds"] == 60
    first.stdout.fnmatch_lines(["*sglworker: kept warm until *(1m after its last use): w (pid *; keeper pid *); log *"])
    (record,) = records(sim_env)
    assert record.state == "warm" and record.keeper is not None and record.members[0].pid == pids(pytester)[0]
    # the keeper holds the GPU now: its holder record names it, with the group's session among its workers
    holder = json.loads((lock_dir(sim_env) / f"gpu-{record.namespace}-{record.gpus[0]}.json").read_text())
    assert holder["pid"] == record.keeper.pid and holder["workers"] == [f"{record.id}:"]

    listed = pytester.runpytest_subprocess("--sgl-warm", "list", "-p", "no:cacheprovider")
    assert listed.ret == 0
    listed.stdout.fnmatch_lines(["*w: warm, ends at * (in * s, 1m after its last use at *); adopted 0 time(s)",
                                 f"*keeper pid {record.keeper.pid}; GPU(s) *",
                                 f"*pid {record.members[0].pid}, port {record.members[0].port}, log *"])

    second, report2 = run(pytester, "r2", "--sgl-keep-warm=60")
    assert launches(report2) == 0, second.stdout.str()
    assert pids(pytester) == [record.members[0].pid] * 2  # the second run's test used the same process
    (adopted,) = report2["warm"]["adopted"]
    assert adopted["pids"] == [record.members[0].pid] and adopted["kept_by_pid"] == record.kept_by.pid
    second.stdout.fnmatch_lines(["*w: 0 launched, 1 reused*1 adopted warm*",
                                 "*sglworker: adopted warm w (pid *; kept warm since * by pytest pid *); its log "
                                 "continues in *"])
    log = Path(adopted["logs"][0]).read_text()
    assert "adopted by pytest pid" in log
    (again,) = records(sim_env)
    assert again.id == record.id and again.state == "warm" and again.uses == 1

    stopped = pytester.runpytest_subprocess("--sgl-warm", "stop", "-p", "no:cacheprovider")
    assert stopped.ret == 0
    stopped.stdout.fnmatch_lines([f"*ended w: pid {record.members[0].pid} (port *"])
    wait_for(lambda: gone(record.members[0].pid) and gone(record.keeper.pid), 60, "the warm group to end")
    assert not records(sim_env) and not list(lock_dir(sim_env).glob("gpu-*.json"))
    assert "warm worker ended: stopped by pytest --sgl-warm stop" in Path(adopted["logs"][0]).read_text()


def test_a_run_without_the_option_adopts_and_then_ends_it(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                          warm: None) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    _, report = run(pytester, "r2")
    assert launches(report) == 0 and len(report["warm"]["adopted"]) == 1 and report["warm"]["kept"] == []
    wait_for(lambda: gone(record.members[0].pid) and record.keeper and gone(record.keeper.pid), 60,
             "the adopted group to end with the session that did not keep it")
    assert not records(sim_env)


# --------------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------------


def test_changed_argv_is_refused(pytester: pytest.Pytester, sim_env: dict[str, str], warm: None,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARM_EXTRA_ARGS", "--max-running-requests 8")
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    monkeypatch.setenv("WARM_EXTRA_ARGS", "--max-running-requests 16")
    result, report = run(pytester, "r2")
    assert launches(report) == 1
    (refused,) = report["warm"]["refused"]
    assert refused["ended"] is True and "its argv differs" in refused["why"]
    assert "'--max-running-requests 16'" in refused["why"] and "(warm: '--max-running-requests 8')" in refused["why"]
    result.stdout.fnmatch_lines(["*warm w (pid *) not adopted: *its argv differs*; ended it"])
    assert gone(record.members[0].pid) and pids(pytester)[1] != record.members[0].pid


def test_changed_model_files_are_refused(pytester: pytest.Pytester, sim_env: dict[str, str], warm: None,
                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"0" * 64)
    monkeypatch.setenv("WARM_MODEL", str(model))
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    (model / "weights.bin").write_bytes(b"1" * 65)  # new weights: another size, another mtime
    _, report = run(pytester, "r2")
    (refused,) = report["warm"]["refused"]
    assert refused["why"] == "the model's files changed (size or mtime)" and launches(report) == 1
    assert gone(record.members[0].pid)


def test_dead_warm_worker_is_refused(pytester: pytest.Pytester, sim_env: dict[str, str], warm: None) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    keeper = keeper_of(record)
    keeper.suspend()  # so that it does not end the group itself when its worker dies: the next session must
    os.kill(record.members[0].pid, signal.SIGKILL)
    wait_for(lambda: gone(record.members[0].pid), 10, "the warm worker to die")
    _, report = run(pytester, "r2")
    (refused,) = report["warm"]["refused"]
    assert "is not the process its record names" in refused["why"] and "has exited" in refused["why"]
    assert launches(report) == 1
    wait_for(lambda: gone(keeper.pid), 60, "the frozen keeper to be ended")
    assert not records(sim_env)


def test_frozen_warm_worker_is_refused(pytester: pytest.Pytester, sim_env: dict[str, str], warm: None) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    psutil.Process(record.members[0].pid).suspend()
    result, report = run(pytester, "r2")
    (refused,) = report["warm"]["refused"]
    assert refused["why"] == f"member pid {record.members[0].pid} does not answer its readiness check (frozen or " \
                             "wedged)", result.stdout.str()
    assert launches(report) == 1
    wait_for(lambda: gone(record.members[0].pid), 60, "the frozen warm worker to be torn down")


def test_warm_worker_another_session_holds_is_left_to_it(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                         warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    gate = pytester.path / "gate"
    monkeypatch.setenv("WARM_GATE", str(gate))
    holder = session(pytester, monkeypatch, "--sgl-keep-warm=60", "--sgl-report", "a.json")
    try:
        wait_for(lambda: len(pids(pytester)) == 2 or holder.proc.poll() is not None, 60, "session A to adopt")
        assert pids(pytester)[1] == record.members[0].pid, holder.output()
        assert records(sim_env)[0].state == "adopted"
        monkeypatch.delenv("WARM_GATE")
        # session B, meanwhile: the warm group is A's; B launches its own on the other GPU and leaves A's alone
        _, report = run(pytester, "b")
        (refused,) = report["warm"]["refused"]
        assert refused["ended"] is False and refused["why"].startswith("in use by another session (pytest pid ")
        assert launches(report) == 1 and not gone(record.members[0].pid)
        gate.write_text("")
        assert holder.wait(60) == 0, holder.output()
    finally:
        gate.write_text("")
        holder.kill()
    (again,) = records(sim_env)
    assert again.id == record.id and again.state == "warm" and again.uses == 1  # A kept it warm again


# --------------------------------------------------------------------------------------------------------
# expiry
# --------------------------------------------------------------------------------------------------------


def test_keeper_ends_the_group_at_its_ttl_without_a_later_session(pytester: pytest.Pytester,
                                                                  sim_env: dict[str, str], warm: None) -> None:
    """The TTL counts from the hand-over to the keeper (the run report's ``until``), not from this test's clock:
    the group may well be gone before the inner session has even ended (a loaded machine takes seconds to end a
    pytest process), so everything the test needs comes from the report, never from a record it reads later."""
    _, report = run(pytester, "r1", "--sgl-keep-warm=3")
    (kept,) = report["warm"]["kept"]
    assert kept["ttl"] == 3 and kept["keeper_pid"] is not None, kept
    assert kept["until"] == pytest.approx(kept["kept_since"] + 3, abs=0.01), kept  # its last use (the hand-over)
    # the keeper ends it, for its TTL (its own log line says so), with no session to do it
    wait_for(lambda: all(gone(pid) for pid in [*kept["pids"], kept["keeper_pid"]]), 120, "the keeper to end the group")
    assert not records(sim_env) and not list(lock_dir(sim_env).glob("gpu-*.json"))
    (line,) = [x for x in Path(kept["logs"][0]).read_text().splitlines() if "warm worker ended" in x]
    until = time.strftime("%H:%M:%S", time.localtime(kept["until"]))
    assert line.endswith(f"warm worker ended: its TTL ran out (kept warm for 3 s after its last use, until {until})"), \
        line
    # not before its time: the line's own time (whole seconds) is the expiry's second or later (across midnight too)
    late = (_seconds_of_day(line.split()[1].rstrip("]")) - _seconds_of_day(until)) % 86400
    assert late < 43200, (line, until)


def test_the_reports_until_names_the_second_the_keepers_line_names() -> None:
    """The report's ``until`` is cut to the millisecond, never rounded up into the next second: the keeper's line
    formats the unrounded moment (once, in a loaded run, the two named 18:01:21 and 18:01:20)."""
    from pytest_sglworker.workers.warm import ms_below

    for moment in (1796660480.9996, 1796660480.0004, 1796660480.5):
        assert time.strftime("%H:%M:%S", time.localtime(ms_below(moment))) == \
            time.strftime("%H:%M:%S", time.localtime(moment)), moment
        assert moment - 0.001 < ms_below(moment) <= moment


def _seconds_of_day(hms: str) -> int:
    h, m, s = map(int, hms.split(":"))
    return h * 3600 + m * 60 + s


@pytest.mark.parametrize("keeper_fate", ["frozen", "killed"])
def test_a_later_session_ends_an_expired_group_its_keeper_did_not(pytester: pytest.Pytester,
                                                                  sim_env: dict[str, str], warm: None,
                                                                  keeper_fate: str) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    keeper = keeper_of(record)
    if keeper_fate == "frozen":
        keeper.suspend()
        # its expiry and the keeper's grace are past (written into its record, so that no wait on the clock is
        # needed, which a loaded machine turned into a group ended before the test could look at it)
        path = lock_dir(sim_env) / f"warm-{record.id}.json"
        content = json.loads(path.read_text())
        content["expires_at"] = time.time() - KEEPER_GRACE - 1.0
        path.write_text(json.dumps(content))
    else:
        keeper.kill()
        wait_for(lambda: gone(keeper.pid), 10, "the keeper to die")
    result, _ = run(pytester, "r2")
    out = result.stdout.str()
    why = "did not end it" if keeper_fate == "frozen" else "its keeper is gone"
    assert re.search(rf"cleaned up after earlier sessions: ended 1 warm worker group\(s\): w \(.*{why}", out), out
    wait_for(lambda: gone(record.members[0].pid) and gone(keeper.pid), 60, "the expired group and its keeper to end")
    assert not records(sim_env)


# --------------------------------------------------------------------------------------------------------
# SIGKILL, a wiped lock directory, untrusted records
# --------------------------------------------------------------------------------------------------------


def test_sigkilled_session_that_keeps_warm_leaves_nothing(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                          warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARM_GATE", str(pytester.path / "never"))
    killed = session(pytester, monkeypatch, "--sgl-keep-warm=60")
    try:
        wait_for(lambda: pids(pytester) or killed.proc.poll() is not None, 60, "the worker to start")
        (worker,) = pids(pytester)
        keepers = [p for p in psutil.Process(killed.proc.pid).children()
                   if "pytest_sglworker.resources.warm_keeper" in " ".join(p.cmdline())]
        assert len(keepers) == 1, killed.output()  # the group's keeper, started with it
        killed.proc.kill()
        killed.wait(10)
    finally:
        killed.kill()
    # Well before the group's 60 s TTL: the keeper ends it because its session died, not because it expired.
    wait_for(lambda: gone(worker) and gone(keepers[0].pid), 40, "the keeper to end the dead session's group")
    assert not records(sim_env)


def test_sigkilled_adopter_leaves_nothing(pytester: pytest.Pytester, sim_env: dict[str, str], warm: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    monkeypatch.setenv("WARM_GATE", str(pytester.path / "never"))
    adopter = session(pytester, monkeypatch, "--sgl-keep-warm=60")
    try:
        wait_for(lambda: len(pids(pytester)) == 2 or adopter.proc.poll() is not None, 60, "the adoption")
        assert records(sim_env)[0].state == "adopted", adopter.output()
        adopter.proc.kill()
        adopter.wait(10)
    finally:
        adopter.kill()
    assert record.keeper is not None
    wait_for(lambda: gone(record.members[0].pid) and gone(record.keeper.pid), 15,
             "the keeper to end the group its adopter died with")
    assert not records(sim_env) and not list(lock_dir(sim_env).glob("gpu-*.json"))
    assert "ended without handing it back" in Path(record.members[0].log).read_text()


def test_wiped_lock_directory_ends_the_warm_group(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                  warm: None) -> None:
    import shutil

    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    assert record.keeper is not None
    shutil.rmtree(lock_dir(sim_env))
    # Well before the group's 60 s TTL: the keeper ends it because its record is gone, not because it expired.
    wait_for(lambda: gone(record.members[0].pid) and gone(record.keeper.pid), 40,
             "the keeper to end a group whose record is gone")
    assert "its warm record is gone (was the lock directory wiped?)" in Path(record.members[0].log).read_text()


def test_untrusted_warm_record_is_ignored_then_removed(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                       warm: None) -> None:
    lock_dir(sim_env).mkdir(parents=True, exist_ok=True)
    planted = lock_dir(sim_env) / "warm-123-abcdef.json"
    planted.write_text('{"format": "pytest-sglworker/warm/v1", "id": "123-abcdef", "state": "warm"')  # cut short
    listed = pytester.runpytest_subprocess("--sgl-warm", "list", "-p", "no:cacheprovider")
    listed.stdout.fnmatch_lines(["*warm-123-abcdef.json: untrusted (not valid JSON*); ignored*"])
    result, report = run(pytester, "r1")
    assert launches(report) == 1
    result.stdout.fnmatch_lines(["*cleaned up after earlier sessions: ended 1 warm worker group(s): an untrusted "
                                 "warm record warm-123-abcdef.json (not valid JSON*"])
    assert not planted.exists()


# --------------------------------------------------------------------------------------------------------
# the option: CI, usage errors
# --------------------------------------------------------------------------------------------------------


def test_under_ci_the_ini_setting_is_not_used_but_the_command_line_is(pytester: pytest.Pytester,
                                                                      sim_env: dict[str, str], warm: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nsgl_keep_warm = 60\n")
    monkeypatch.setenv("CI", "true")
    result, report = run(pytester, "ci")
    result.stdout.fnmatch_lines(["sglworker: ini sgl_keep_warm is not used under CI (CI='true'); ask for it with "
                                 "--sgl-keep-warm or SGLWORKER_KEEP_WARM"])
    assert report["warm"]["kept"] == [] and not records(sim_env)
    assert not [p for p in psutil.process_iter() if "warm_keeper" in " ".join(_cmdline(p))
                and _env(p).get("SGLWORKER_TEST_MARK") == os.environ["SGLWORKER_TEST_MARK"]]
    _, report = run(pytester, "ci2", "--sgl-keep-warm")
    assert len(report["warm"]["kept"]) == 1 and report["warm"]["kept"][0]["ttl"] == 900
    monkeypatch.delenv("CI")
    result, report = run(pytester, "dev")  # the ini's setting, off CI
    assert len(report["warm"]["adopted"]) == 1 and report["warm"]["kept"][0]["ttl"] == 60


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _env(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.Error:
        return {}


@pytest.mark.parametrize(("args", "message"), [
    (["--sgl-keep-warm", "--sgl-cluster", "ray"],
     "--sgl-keep-warm cannot be used with --sgl-cluster (a Ray cluster's scheduler leases its GPUs; nothing of it "
     "outlives the session): drop one of them"),
    (["--sgl-keep-warm=30", "--sgl-worker-url", "w=http://127.0.0.1:9"],
     "--sgl-keep-warm cannot be used with --sgl-worker-url (attached workers are never launched, kept or stopped "
     "by the plugin): drop one of them"),
    (["--sgl-keep-warm=30", "--sgl-reuse", "off"],
     "--sgl-keep-warm cannot be used with --sgl-reuse off (no worker is pooled, so none is left to keep warm): "
     "drop one of them"),
    (["--sgl-keep-warm=soon"], "--sgl-keep-warm: invalid value 'soon': 'soon' is not a TTL: give 'on', 'off', or a "
                               "duration such as 90s, 15m, 1h or 600 (seconds)*"),
    (["--sgl-keep-warm", "test_warm.py"], "--sgl-keep-warm: invalid value 'test_warm.py'*a TTL goes after '=' "
                                          "(--sgl-keep-warm=15m)*"),
    (["--sgl-keep-warm=9d"], "--sgl-keep-warm: invalid value '9d'*"),
])
def test_usage_errors(pytester: pytest.Pytester, sim_env: dict[str, str], warm: None, args: list[str],
                      message: str) -> None:
    gpus = [] if "--sgl-cluster" in args else ["--sgl-gpus", "sim:2"]  # a cluster excludes a GPU selection
    result = pytester.runpytest_subprocess("--sgl-engine", "sim", *gpus, "-p", "no:cacheprovider", "-p", "no:xdist",
                                           "--sgl-model", "w", *args, timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])


@pytest.mark.parametrize(("values", "source", "expected"), [
    ({"worker_urls": {"w": ("w=http://127.0.0.1:9",)}}, "ini sgl_keep_warm",
     (None, "ini sgl_keep_warm is not used with --sgl-worker-url (attached workers are never launched, kept or "
            "stopped by the plugin)")),
    ({"cluster": "ray"}, "ini sgl_keep_warm",
     (None, "ini sgl_keep_warm is not used with --sgl-cluster (a Ray cluster's scheduler leases its GPUs; nothing of "
            "it outlives the session)")),
    ({}, "SGLWORKER_KEEP_WARM", (60.0, "")),
    ({}, "ini sgl_keep_warm", (60.0, "")),
])
def test_an_ini_setting_that_cannot_apply_is_a_note_not_an_error(values: dict[str, Any], source: str,
                                                                 expected: tuple[float | None, str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_sglworker.plugin.options import _keep_warm_in_force

    monkeypatch.delenv("CI", raising=False)
    resolved = {"keep_warm": 60.0, "cluster": None, "worker_urls": {}, "reuse": True, **values}
    sources = {"keep-warm": source, "cluster": "--sgl-cluster", "worker-url": "--sgl-worker-url", "reuse": "default"}
    assert _keep_warm_in_force(resolved, sources) == expected


def test_warm_stop_says_which_group_a_session_uses(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                   warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    gate = pytester.path / "gate"
    monkeypatch.setenv("WARM_GATE", str(gate))
    user = session(pytester, monkeypatch)
    try:
        wait_for(lambda: len(pids(pytester)) == 2 or user.proc.poll() is not None, 60, "the adoption")
        stopped = pytester.runpytest_subprocess("--sgl-warm", "stop", "-p", "no:cacheprovider")
        assert stopped.ret == 1
        stopped.stdout.fnmatch_lines(["*left w: in use by pytest pid * (*); that session ends it or keeps it warm "
                                      "when it ends"])
        gate.write_text("")
        assert user.wait(60) == 0, user.output()
    finally:
        gate.write_text("")
        user.kill()
    wait_for(lambda: not records(sim_env), 60, "the session that used it to end it")


def test_the_run_report_and_a_fresh_lock_directory(pytester: pytest.Pytester, warm: None) -> None:
    """Without any warm group, the report's ``warm`` says so: nothing adopted, kept or refused."""
    _, report = run(pytester, "r1")
    assert report["warm"] == {"keep_warm_seconds": None, "adopted": [], "kept": [], "refused": []}


MARKED = textwrap.dedent('''
    import pytest

    @pytest.mark.sgl_workers(count=2)
    def test_group(sgl_workers):
        assert len(sgl_workers) == 2
        with open("pids.txt", "a") as fh:
            fh.write(" ".join(str(w.pid) for w in sgl_workers) + "\\n")
''')


def test_a_worker_group_is_kept_and_adopted_whole(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                  warm: None) -> None:
    pytester.makepyfile(test_warm=MARKED)
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    assert len(record.members) == 2 and len(record.gpus) == 2
    _, report2 = run(pytester, "r2", "--sgl-keep-warm=60")
    assert launches(report2) == 0 and report2["warm"]["adopted"][0]["pids"] == list(record.pids)
    assert pids(pytester)[:2] == pids(pytester)[2:] == list(record.pids)
