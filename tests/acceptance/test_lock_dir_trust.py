"""A shared lock directory cannot be turned against its users (docs/SECURITY.md): what a record in it says is a
claim, never an order. Each test plants what a hostile user (or a damaged record) could put there, runs the plugin
as its users do (a session, whose janitor reads the directory; ``pytest --sgl-warm list|stop``; a session that
would adopt a warm group), and checks that no file the record names changed and no process it names got a signal.

The hostile user is uid 65534 (``nobody``), made the owner of planted files with ``chown``; that needs root, which
CI and the development machines are (the tests that need it skip otherwise). Every scenario runs real pytest
sessions against the simulated engine with private lock and log directories (``sim_env``).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from session_helpers import Session
from warm_helpers import SIM, gone, launches, lock_dir, pids, records, report_of, run, session, wait_for

from pytest_sglworker.resources.state import atomic_write
from pytest_sglworker.resources.warm_records import FORMAT, KEEPER_ENV

NOBODY = 65534
PRECIOUS = b"precious: must never change\n"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root (chown)")


# --------------------------------------------------------------------------------------------------------
# what a hostile user plants
# --------------------------------------------------------------------------------------------------------


def victims(tmp_path: Path, n: int = 2) -> list[Path]:
    """Files of this user, 0600, that nothing may touch, each named like a worker log (the name alone proves
    nothing). Each in a directory of its own, as a user's private files are."""
    found = []
    for i in range(n):
        folder = tmp_path / f"victim{i}"
        folder.mkdir(mode=0o700)
        path = folder / f"sglang-worker-3100{i}.log"
        path.write_bytes(PRECIOUS)
        path.chmod(0o600)
        found.append(path)
    return found


def untouched(paths: list[Path]) -> None:
    for path in paths:
        assert path.exists(), f"{path} was deleted"
        assert path.read_bytes() == PRECIOUS, f"{path} was written to: {path.read_bytes()!r}"
        assert path.stat().st_nlink == 1, f"{path} was hard-linked somewhere"


def dead_pid() -> int:
    proc = psutil.Popen(["true"])
    proc.wait()
    return proc.pid


def record_dict(wid: str, *, log: Path, links: list[Path], policy: str, tag: str | None = None,
                pid: int | None = None, since: float | None = None, keeper: tuple[int, float] | None = None,
                state: str = "warm", expires_in: float = 600.0,
                identity: dict[str, str] | None = None) -> dict[str, Any]:
    """A warm record as the plugin writes one (format, fields, ranges), naming what the caller wants."""
    now = time.time()
    st = log.stat()
    pid = pid or dead_pid()
    return {
        "format": FORMAT, "id": wid, "hostname": os.uname().nodename, "state": state,
        "keeper": None if keeper is None else {"pid": keeper[0], "since": keeper[1], "session": "", "holder": ""},
        "kept_by": {"pid": dead_pid(), "since": now - 60, "session": "", "holder": "planted"}, "adopter": None,
        "ttl": 600.0, "created": now - 60, "last_used": now - 60, "expires_at": now + expires_in,
        "config": {"key": "planted", "label": "planted", "model": "planted"}, "identity": identity or {},
        "namespace": "sim", "gpus": [0], "gpu_uuids": ["GPU-sim-0"], "memory_mib": 1024, "log_dir": None,
        "log_policy": policy, "tainted": False, "uses": 0,
        "members": [{"role": "worker", "index": 0, "kind": "HttpWorker", "pid": pid, "since": since or now - 60,
                     "tag": tag or f"{wid}:{uuid.uuid4().hex[:12]}", "port": 31000, "ports": {"http": 31000},
                     "gpus": "0", "log": str(log), "links": [str(p) for p in links],
                     "log_id": [st.st_dev, st.st_ino], "argv": "planted", "started_at": now - 60,
                     "startup_seconds": 1.0, "probe_seconds": 0.01}],
    }


def plant(directory: Path, name: str, content: dict[str, Any] | bytes, *, owner: int | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def shared(sim_env: dict[str, str]) -> Path:
    """The lock directory as several users share it: sticky and world-writable (1777)."""
    path = lock_dir(sim_env)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o1777)
    return path


def janitor_session(pytester: pytest.Pytester, name: str) -> pytest.RunResult:
    """A session of another configuration (spec ``other``): its janitor reads the lock directory first; it adopts
    nothing there."""
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "other", "--sgl-report", f"{name}.json",
                                           timeout=120)
    out = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in out and "INTERNALERROR" not in out, out
    result.assert_outcomes(passed=1)
    return result


def warm_stop(pytester: pytest.Pytester) -> pytest.RunResult:
    result = pytester.runpytest_subprocess("--sgl-warm", "stop", "-p", "no:cacheprovider", timeout=120)
    out = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in out and "INTERNALERROR" not in out, out
    return result


# --------------------------------------------------------------------------------------------------------
# files a record names
# --------------------------------------------------------------------------------------------------------


@needs_root
@pytest.mark.parametrize("policy", ["none", "all"])  # none: the janitor would delete the logs; all: append a line
def test_another_users_record_never_touches_the_files_it_names(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                                warm: None, tmp_path: Path, policy: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    files = victims(tmp_path)
    wid = f"{dead_pid()}-{uuid.uuid4().hex[:8]}"
    planted = plant(shared(sim_env), f"warm-{wid}.json", record_dict(wid, log=files[0], links=files[1:],
                                                                       policy=policy), owner=NOBODY)
    janitor_session(pytester, "j")
    untouched(files)
    assert planted.exists(), "another user's record is theirs: never removed"
    stopped = warm_stop(pytester)
    stopped.stdout.fnmatch_lines([f"*warm-{wid}.json: belongs to uid {NOBODY} (another user): left alone"])
    assert stopped.ret == 0
    listed = pytester.runpytest_subprocess("--sgl-warm", "list", "-p", "no:cacheprovider")
    listed.stdout.fnmatch_lines([f"*warm-{wid}.json: belongs to uid {NOBODY} (another user); its GPUs and ports*"])
    untouched(files)


@pytest.mark.parametrize("policy", ["none", "all"])
def test_a_record_whose_paths_name_other_files_ends_without_touching_them(
        pytester: pytest.Pytester, sim_env: dict[str, str], warm: None, tmp_path: Path, policy: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A record of this user (damaged, or edited) whose member's log and links name files other than the log its
    session created: its group is ended (its keeper is gone), and the files stay as they were."""
    files = victims(tmp_path)
    wid = f"{dead_pid()}-{uuid.uuid4().hex[:8]}"
    content = record_dict(wid, log=files[0], links=files[1:], policy=policy)
    other = tmp_path / "sglang-worker-31009.log"
    other.write_text("the log the session created\n")
    content["members"][0]["log_id"] = [other.stat().st_dev, other.stat().st_ino]  # not the victims' identity
    planted = plant(lock_dir(sim_env), f"warm-{wid}.json", content)
    result = janitor_session(pytester, "j")
    result.stdout.fnmatch_lines(["*ended 1 warm worker group(s): planted (its keeper is gone)*"])
    assert not planted.exists()
    untouched(files)


# --------------------------------------------------------------------------------------------------------
# processes a record names
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("owner", ["self", pytest.param("nobody", marks=needs_root)])
@pytest.mark.parametrize("tag", ["prefix", "another group's"])
def test_a_planted_tag_never_ends_another_sessions_warm_group(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                               warm: None, tmp_path: Path, owner: str,
                                                               tag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    (legit,) = records(sim_env)
    assert legit.keeper is not None
    wid = f"{dead_pid()}-{uuid.uuid4().hex[:8]}"
    planted_tag = f"{legit.id}:" if tag == "prefix" else legit.members[0].tag
    files = victims(tmp_path, 1)
    content = record_dict(wid, log=files[0], links=[], policy="none", tag=planted_tag,
                          pid=legit.members[0].pid, since=legit.members[0].since)
    plant(shared(sim_env) if owner == "nobody" else lock_dir(sim_env), f"warm-{wid}.json", content,
          owner=NOBODY if owner == "nobody" else None)
    janitor_session(pytester, "j")
    assert not gone(legit.members[0].pid) and not gone(legit.keeper.pid), "the legitimate warm group was ended"
    (again,) = records(sim_env)
    assert again.id == legit.id and again.state == "warm"
    untouched(files)


ADOPTER_CONFTEST = '''
import json, os
from pathlib import Path
import pytest_sglworker.workers.warm as warm_side
from pytest_sglworker.resources.warm_records import warm_records

def _forged(*args, **kwargs):
    """What a forger writes into a record: the digests this session computes match the record's, whatever the
    process runs."""
    (entry,) = [e for e in warm_records(Path(os.environ["SGLWORKER_LOCK_DIR"])) if e.record is not None]
    return dict(entry.record.identity)

warm_side.identity = _forged
'''


def test_adoption_reads_the_running_process_not_the_records_digests(
        pytester: pytest.Pytester, sim_env: dict[str, str], warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARM_EXTRA_ARGS", "--max-running-requests 8")
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    monkeypatch.delenv("WARM_EXTRA_ARGS")
    # the digests say "same configuration" (as if a record's were swapped for this configuration's)
    pytester.makeconftest((pytester.path / "conftest.py").read_text() + ADOPTER_CONFTEST)
    result, report = run(pytester, "r2")
    assert launches(report) == 1, result.stdout.str()
    (refused,) = report["warm"]["refused"]
    assert "runs other arguments than this session would launch" in refused["why"], refused
    assert "--max-running-requests" in refused["why"]
    assert gone(record.members[0].pid) and pids(pytester)[1] != record.members[0].pid


def test_an_edited_log_path_is_never_linked_appended_or_printed(
        pytester: pytest.Pytester, sim_env: dict[str, str], warm: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    (victim,) = victims(tmp_path, 1)
    path = lock_dir(sim_env) / f"warm-{record.id}.json"
    content = json.loads(path.read_text())
    content["members"][0]["log"] = str(victim)  # the path, not the identity the session recorded
    # written whole, as the plugin writes a record: its keeper reads it meanwhile, and ends the group (its record
    # gone) on a file it catches half-written, which a write in place once showed it
    atomic_write(path, json.dumps(content), mode=0o600)
    monkeypatch.setenv("WARM_FAIL", "1")  # the test fails: a failing test's section prints its worker's log
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "w", "--sgl-report", "r2.json", timeout=120)
    result.assert_outcomes(failed=1)
    report = json.loads((pytester.path / "r2.json").read_text())
    (refused,) = report["warm"]["refused"]
    assert f"log {victim} is not the file the plugin created there" in refused["why"], refused
    assert PRECIOUS.decode().strip() not in result.stdout.str()
    untouched([victim])
    log_dir = Path(sim_env["SGLWORKER_LOG_DIR"])
    assert not [p for p in log_dir.rglob("*") if p.is_file() and p.stat().st_ino == victim.stat().st_ino]


# --------------------------------------------------------------------------------------------------------
# the hand-over and its interruptions
# --------------------------------------------------------------------------------------------------------


def _keeper_of_session(parent: int) -> psutil.Process | None:
    for proc in psutil.Process(parent).children():
        try:
            if KEEPER_ENV in proc.environ():
                return proc
        except psutil.Error:
            continue
    return None


def _frozen_keeper_session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str,
                           ack: float) -> tuple[Session, psutil.Process, Path]:
    """A session that keeps its group warm, its test held at a gate, and its keeper frozen (SIGSTOP): at the hand-over
    the keeper cannot answer, and the session waits ``ack`` seconds for it (a live keeper gets 15 s). Returns the
    session, the keeper and the gate (create it to let the test end)."""
    gate = pytester.path / "gate"
    monkeypatch.setenv("WARM_GATE", str(gate))
    monkeypatch.setenv("WARM_ACK_TIMEOUT", str(ack))
    held = session(pytester, monkeypatch, "--sgl-keep-warm=60", "--sgl-report", "r.json", *args)
    wait_for(lambda: pids(pytester) or held.proc.poll() is not None, 60, "the test to hold its worker")
    keeper = _keeper_of_session(held.proc.pid)
    assert keeper is not None, held.output()
    keeper.suspend()
    return held, keeper, gate


def test_a_keeper_that_does_not_answer_the_hand_over_is_killed(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                                 warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    held, keeper, gate = _frozen_keeper_session(pytester, monkeypatch, ack=2.0)
    try:
        gate.write_text("")
        assert held.wait(90) == 0, held.output()
    finally:
        gate.write_text("")
        held.kill()
    assert "did not answer" in held.output() and "killed it" in held.output(), held.output()
    wait_for(lambda: gone(keeper.pid), 10, "the frozen keeper to be gone")
    assert gone(pids(pytester)[0]) and not records(sim_env)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 2)])
def test_an_interrupt_during_the_hand_over_ends_the_run_in_order(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                                 warm: None, monkeypatch: pytest.MonkeyPatch,
                                                                 signum: int, status: int) -> None:
    # the signal lands during the wait for the keeper: seconds after the hand-over began, however busy the machine
    held, keeper, gate = _frozen_keeper_session(pytester, monkeypatch, ack=6.0)
    try:
        gate.write_text("")
        wait_for(lambda: any(r.state == "handover" for r in records(sim_env)) or held.proc.poll() is not None, 60,
                 "the hand-over to begin")
        held.proc.send_signal(signum)
        code = held.wait(90)
    finally:
        gate.write_text("")
        held.kill()
    out = held.output()
    assert code == status, out
    assert "Traceback" not in out and "INTERNALERROR" not in out, out
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["interrupted"] is True
    assert "w: 1 launched" in out, out  # the plugin's summary
    wait_for(lambda: gone(keeper.pid) and gone(pids(pytester)[0]), 20, "the group and its keeper to be gone")
    assert not records(sim_env), "a record was left behind"


def test_ctrl_c_during_warm_stop_lets_the_group_end_whole(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                          warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLSIM_FAULT", "ignore_sigterm")  # its teardown takes SIGTERM's whole grace, then SIGKILL
    run(pytester, "r1", "--sgl-keep-warm=60")
    (record,) = records(sim_env)
    stopper = Session(pytester, "--sgl-warm", "stop", "-p", "no:cacheprovider")
    try:
        wait_for(lambda: any(r.state == "stop" for r in records(sim_env)) or stopper.proc.poll() is not None, 30,
                 "the stop to begin ending the group")
        stopper.proc.send_signal(signal.SIGINT)
        code = stopper.wait(60)
    finally:
        stopper.kill()
    out = stopper.output()
    assert code == 2 and "Traceback" not in out, out
    assert "interrupted (SIGINT)" in out, out
    assert gone(record.members[0].pid), "the worker outlived its keeper"
    assert record.keeper is not None and gone(record.keeper.pid)
    assert not records(sim_env) and not list(lock_dir(sim_env).glob("warm-*"))


# --------------------------------------------------------------------------------------------------------
# what the lock directory holds that is no record
# --------------------------------------------------------------------------------------------------------


def test_untrusted_entries_are_removed_or_said_how_to_remove(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                             warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    locks = lock_dir(sim_env)
    locks.mkdir(parents=True, exist_ok=True)
    (locks / "warm-1-aaaaaaaa.json").mkdir()  # a directory where a record goes
    empty = plant(locks, "warm-2-bbbbbbbb.json", b"")
    (locks / "warm-2-bbbbbbbb.lock").symlink_to(locks / "nowhere")  # a dangling link where its claim goes
    stopped = warm_stop(pytester)
    stopped.stdout.fnmatch_lines([
        "*removed warm-2-bbbbbbbb.json: untrusted (is empty)",
        f"*left warm-1-aaaaaaaa.json: untrusted (is a directory) and not removed: is a directory: left alone (remove "
        f"it by hand: rm -r {locks / 'warm-1-aaaaaaaa.json'})",
    ])
    assert stopped.ret == 1
    assert not empty.exists() and not os.path.lexists(locks / "warm-2-bbbbbbbb.lock")
    assert (locks / "warm-1-aaaaaaaa.json").is_dir()
    (locks / "warm-1-aaaaaaaa.json").rmdir()
    # the janitor of a session does the same for a record of this user it can remove
    plant(locks, "warm-3-cccccccc.json", b"")
    (locks / "warm-3-cccccccc.lock").symlink_to(locks / "nowhere")
    result = janitor_session(pytester, "j")
    result.stdout.fnmatch_lines(["*an untrusted warm record warm-3-cccccccc.json (is empty)*"])
    assert not list(locks.glob("warm-*"))


def test_a_report_path_that_is_not_a_regular_file_is_never_replaced(pytester: pytest.Pytester,
                                                                    sim_env: dict[str, str], warm: None) -> None:
    fifo = pytester.path / "report.fifo"
    os.mkfifo(fifo)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "w", "--sgl-report", str(fifo), timeout=120)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*ERROR: cannot write the run report to {fifo} (--sgl-report): not a regular "
                                 "file is in the way*"])
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# --------------------------------------------------------------------------------------------------------
# another user's files where this user's lock files and records go (issue 38, findings 1 and 3)
# --------------------------------------------------------------------------------------------------------


def plant_claim(sim_env: dict[str, str], wid: str) -> Path:
    """An empty ``warm-<id>.lock`` of another user beside a warm record of ours: the sticky directory lets anybody
    create a file at a name nobody has taken yet."""
    path = shared(sim_env) / f"warm-{wid}.lock"
    assert not path.exists()
    path.write_bytes(b"")
    os.chown(path, NOBODY, NOBODY)
    return path


def _blocked(wid: str) -> str:
    return (f"its claim file warm-{wid}.lock belongs to uid {NOBODY} (another user), so no session of yours can "
            "claim it: ended without it")


@needs_root
def test_a_planted_claim_file_does_not_keep_a_warm_group_past_its_ttl(
        pytester: pytest.Pytester, sim_env: dict[str, str], warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    run(pytester, "r1", "--sgl-keep-warm=600")
    (record,) = records(sim_env)
    assert record.keeper is not None
    planted = plant_claim(sim_env, record.id)
    # its TTL runs out now: the record says so, written whole as the plugin writes one (the keeper reads it)
    path = lock_dir(sim_env) / f"warm-{record.id}.json"
    content = json.loads(path.read_text())
    content["expires_at"] = time.time() - 1
    atomic_write(path, json.dumps(content), mode=0o600)
    wait_for(lambda: gone(record.keeper.pid), 60, "the keeper to end its group at its TTL")  # type: ignore[union-attr]
    assert gone(record.members[0].pid), "the warm worker outlived its keeper"
    assert not records(sim_env) and not path.exists()
    assert planted.exists() and planted.stat().st_uid == NOBODY, "another user's file is theirs: never removed"


@needs_root
def test_warm_stop_ends_a_group_whose_claim_file_another_user_planted(
        pytester: pytest.Pytester, sim_env: dict[str, str], warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    run(pytester, "r1", "--sgl-keep-warm=600")
    (record,) = records(sim_env)
    planted = plant_claim(sim_env, record.id)
    stopped = warm_stop(pytester)
    out = stopped.stdout.str()
    assert "in use by" not in out, out
    assert f"({_blocked(record.id)})" in out, out
    assert stopped.ret == 0, out
    assert gone(record.members[0].pid) and not records(sim_env)
    assert planted.exists()


@needs_root
def test_the_next_session_does_not_wait_out_its_lease_timeout_behind_a_planted_claim(
        pytester: pytest.Pytester, sim_env: dict[str, str], warm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU, held by a warm group whose claim file another user planted: the next session of its configuration
    cannot adopt it (and says why, not "in use by another session"), waits for the GPU, and the keeper gives way as
    it does for any waiter."""
    one_gpu = [*SIM[:SIM.index("sim:2")], "sim:1", *SIM[SIM.index("sim:2") + 1:]]
    first = pytester.runpytest_subprocess(*one_gpu, "--sgl-model", "w", "--sgl-keep-warm=600", timeout=120)
    first.assert_outcomes(passed=1)
    (record,) = records(sim_env)
    plant_claim(sim_env, record.id)
    result = pytester.runpytest_subprocess(*one_gpu, "--sgl-model", "w", "--sgl-lease-timeout", "90",
                                           "--sgl-report", "r2.json", timeout=180)
    out = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in out and "INTERNALERROR" not in out, out
    result.assert_outcomes(passed=1)
    (refused,) = report_of(pytester, "r2.json")["warm"]["refused"]
    assert refused["why"].startswith(f"its claim file warm-{record.id}.lock belongs to uid {NOBODY} (another user), "
                                     "so no session of yours can claim it"), refused
    assert gone(record.members[0].pid) and not records(sim_env)


@needs_root
@pytest.mark.parametrize("kind", ["untrusted", "stale"])
def test_another_users_holder_record_is_busy_and_never_removed(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                                 warm: None, kind: str) -> None:
    """Finding 3: root's session reads another user's GPU holder record as "busy" (the session leases the other GPU)
    and leaves it where it is, whether it cannot be trusted (the sweep) or names a holder that is gone (after
    locking)."""
    content: dict[str, Any] | bytes = b"{not json" if kind == "untrusted" else {
        "pid": dead_pid(), "hostname": os.uname().nodename, "holder": "theirs", "since": time.time() - 60,
        "uuid": "GPU-sim-0", "memory_mib": 1024, "index": 0, "namespace": "sim-2x80", "gpus": [0]}
    planted = plant(shared(sim_env), "gpu-sim-2x80-0.json", content, owner=NOBODY)
    before = planted.read_bytes()
    result, report = run(pytester, "r1")
    assert [launch["gpus"] for launch in report["launches"]] == [[1]], report["launches"]
    assert planted.exists() and planted.read_bytes() == before and planted.stat().st_uid == NOBODY
    if kind == "untrusted":
        result.stdout.fnmatch_lines([f"*gpu-sim-2x80-0.json (not valid JSON*; kept: it belongs to uid {NOBODY} "
                                     "(another user), whose sessions remove it)*"])
    janitor_session(pytester, "j")  # the janitor of a later session leaves it too
    assert planted.exists() and planted.read_bytes() == before
