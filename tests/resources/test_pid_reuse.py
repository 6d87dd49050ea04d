"""No signal of the plugin reaches a process that got the pid of one of its processes after that one was reaped
(``resources/pidrefs.py``, ``resources/processes.py``).

The pid is reused on purpose: as root, ``/proc/sys/kernel/ns_last_pid`` is set to the pid less one and the newcomer
started at once (another process of the machine may take the pid first: tried again, bounded). The newcomer is a
session leader of this same user (what a pid check by uid alone would take for ours) that records every signal
it can catch in a file; each test asserts it got none and still runs, then ends it. Every scenario runs with the
kernel's pidfds and with them taken away in-process (``open_pidfd`` answers None: an older kernel), where the
start time and uid are checked before each signal instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from pytest_sglworker.resources import pidrefs
from pytest_sglworker.resources.processes import (
    OWNER_ENV,
    AdoptedProcess,
    ChildProcess,
    owner_tag,
    process_tree,
    terminate_tree,
)

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")

#: Records each catchable signal it gets (one line per signal), says it is ready, and runs until killed.
NEWCOMER = r"""
import os, signal, sys, time
out = sys.argv[1]
def record(sig, _frame):
    with open(out, "a") as fh:
        fh.write(f"{signal.Signals(sig).name}\n")
for sig in (signal.SIGTERM, signal.SIGCONT, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(sig, record)
with open(out + ".ready", "w") as fh:
    fh.write(str(os.getpid()))
while True:
    time.sleep(600)
"""

SLEEPER = "import time; time.sleep(600)"


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(params=["pidfd", "no-pidfd"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "pidfd":
        if pidrefs.open_pidfd(os.getpid()) is None:
            pytest.skip("this kernel gives no pidfds (Linux 5.3+)")
    else:
        monkeypatch.setattr(pidrefs, "open_pidfd", lambda pid: None)
    return str(request.param)


@pytest.fixture
def reuse() -> Iterator[Callable[[int, Path], subprocess.Popen[bytes]]]:
    """``reuse(pid, out)``: the newcomer, started with pid ``pid`` (out: the file of the signals it got)."""
    if os.geteuid() != 0 or not os.access(NS_LAST_PID, os.W_OK):
        pytest.skip("reusing a pid on purpose needs root (writes /proc/sys/kernel/ns_last_pid)")
    newcomers: list[subprocess.Popen[bytes]] = []

    def start(pid: int, out: Path) -> subprocess.Popen[bytes]:
        for _ in range(200):  # another process of this machine may take the pid between the write and the fork
            NS_LAST_PID.write_text(str(pid - 1))
            proc = subprocess.Popen([sys.executable, "-c", NEWCOMER, str(out)], start_new_session=True)
            if proc.pid == pid:
                newcomers.append(proc)
                wait_for(Path(f"{out}.ready").exists, "the newcomer to set its handlers")
                return proc
            proc.kill()
            proc.wait()
        pytest.fail(f"pid {pid} could not be had again in 200 tries (a very busy machine)")

    yield start
    for proc in newcomers:
        proc.kill()
        proc.wait()


def assert_untouched(newcomer: subprocess.Popen[bytes], out: Path) -> None:
    assert not out.exists(), f"the newcomer with the reused pid got {out.read_text().split()}"
    assert newcomer.poll() is None, "the newcomer with the reused pid was ended"


def ours(tag: str) -> ChildProcess:
    """A worker stand-in: a session of its own, tagged, returned once it runs its code (so its start is a clock
    tick or more before its pid's reuse: a start time read in ticks tells them apart)."""
    proc = ChildProcess([sys.executable, "-c", "print('ready', flush=True); " + SLEEPER],
                        env={**os.environ, OWNER_ENV: tag}, start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    proc.stdout.close()
    return proc


def test_an_adopted_worker_whose_pid_was_reused_is_never_signalled(
        mode: str, reuse: Callable[[int, Path], subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """The issue's case: an adopted warm worker dies under a test, its pid goes to another session leader, and the
    teardown (the root, then its process group, its session, its tag) reaches none of it."""
    tag = owner_tag()
    worker = ours(tag)
    adopted = AdoptedProcess(worker.pid, psutil.Process(worker.pid).create_time(), tag=tag)
    assert adopted.poll() is None and adopted.ref is not None
    assert adopted.ref.has_pidfd is (mode == "pidfd")
    worker.kill()
    worker.wait()  # it died, and its parent (here, the test) reaped it
    out = tmp_path / "signals"
    newcomer = reuse(worker.pid, out)
    assert adopted.poll() is not None
    adopted.terminate()
    adopted.kill()
    assert_untouched(newcomer, out)
    killed = terminate_tree(adopted, lambda: process_tree(adopted.pid, tag, ref=adopted.ref),
                            term_timeout=0.5, kill_timeout=0.5)
    assert killed == []
    assert_untouched(newcomer, out)


def _recorder(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / f"signals-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen([sys.executable, "-c", NEWCOMER, str(out)], env=env, start_new_session=True)
    wait_for(Path(f"{out}.ready").exists, "the process to set its handlers")
    return proc, out


def test_an_adopted_handle_is_proven_by_its_owner_tag_and_uid_too(mode: str, tmp_path: Path) -> None:
    """The pid and start time match, but the tag is another worker's (or the process is another user's): the
    handle holds nothing, counts the process as gone and never signals it."""
    tag = owner_tag()
    proc, out = _recorder(tmp_path, {**os.environ, OWNER_ENV: tag})
    try:
        created = psutil.Process(proc.pid).create_time()
        assert AdoptedProcess(proc.pid, created, tag=tag).ref is not None  # the right tag: proven
        wrong = AdoptedProcess(proc.pid, created, tag=owner_tag())
        assert wrong.ref is None and wrong.poll() is not None
        wrong.terminate()
        terminate_tree(wrong, lambda: [], term_timeout=0.5, kill_timeout=0.5)
        assert_untouched(proc, out)
    finally:
        proc.kill()
        proc.wait()
    if os.geteuid() != 0:
        return
    theirs = subprocess.Popen(["sleep", "600"], env={**os.environ, OWNER_ENV: tag}, user=65534, group=65534,
                              start_new_session=True)  # as root: another user's process, of the right tag
    try:
        wait_for(lambda: psutil.Process(theirs.pid).uids().real == 65534, "the other user's process")
        adopted = AdoptedProcess(theirs.pid, psutil.Process(theirs.pid).create_time(), tag=tag)
        assert adopted.ref is None and adopted.poll() is not None
        adopted.kill()
        assert theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait()


def test_a_launched_worker_reaped_elsewhere_is_never_signalled_through_its_old_pid(
        mode: str, reuse: Callable[[int, Path], subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """A worker this session started, reaped behind its handle's back (another thread's ``waitpid``): its handle's
    signals, its tree and the teardown of its group do not reach the process that got its pid."""
    tag = owner_tag()
    worker = ours(tag)
    assert worker.ref is not None and worker.ref.has_pidfd is (mode == "pidfd")
    os.kill(worker.pid, signal.SIGKILL)
    os.waitpid(worker.pid, 0)  # not through the handle: it still thinks its child runs
    out = tmp_path / "signals"
    newcomer = reuse(worker.pid, out)
    worker.send_signal(signal.SIGTERM)
    assert_untouched(newcomer, out)
    assert [p.pid for p in process_tree(worker.pid, tag, ref=worker.ref)] == []
    terminate_tree(worker, lambda: process_tree(worker.pid, tag, ref=worker.ref), term_timeout=0.5, kill_timeout=0.5)
    assert_untouched(newcomer, out)


def test_a_pidfd_opened_is_closed_with_the_teardown_and_never_inherited(tmp_path: Path) -> None:
    """Many workers started and torn down leave no pidfd open; a pidfd is close-on-exec."""
    before = _pidfds()
    for _ in range(20):
        worker = ours(owner_tag())
        if worker.ref is not None and worker.ref.has_pidfd:
            assert not os.get_inheritable(worker.ref._fd)  # type: ignore[arg-type]
        terminate_tree(worker, lambda w=worker: process_tree(w.pid, ref=w.ref),  # type: ignore[misc]
                       term_timeout=5.0, kill_timeout=5.0)
        assert worker.returncode == -signal.SIGTERM
    assert _pidfds() == before


def test_a_group_whose_leader_is_gone_is_signalled_member_by_member(
        mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader ends on its SIGTERM and is reaped; a member of its group the collection missed is still ended,
    and the group is never signalled by its number once its leader no longer holds it (``os.killpg`` only while
    ``/proc/<leader>`` exists)."""
    marker = tmp_path / f"member-{uuid.uuid4().hex[:6]}"
    leader = ChildProcess(
        [sys.executable, "-c",
         "import signal, subprocess, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
         f"m = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
         f"open({str(marker)!r}, 'w').write(str(m.pid))\n"
         "time.sleep(600)\n"],
        start_new_session=True)
    wait_for(marker.exists, "the member")
    wait_for(lambda: marker.read_text().isdigit(), "the member's pid")
    member = int(marker.read_text())
    # A member is proven by having started before the last moment its leader was seen holding its pid, to the
    # clock tick: one read within a tick of its start is (rightly) not proof. Teardown looks at the leader first.
    wait_for(lambda: (ident := pidrefs.identity(member)) is not None
             and pidrefs.started_before(ident, pidrefs.boot_clock()), "the member's start a clock tick past")
    calls: list[tuple[int, bool]] = []
    real_killpg = os.killpg

    def killpg(pgid: int, sig: int) -> None:
        calls.append((pgid, os.path.exists(f"/proc/{pgid}")))
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", killpg)
    try:
        root = psutil.Process(leader.pid)
        terminate_tree(leader, lambda: [root], term_timeout=5.0, kill_timeout=5.0)
        assert leader.returncode == 0
        wait_for(lambda: _gone(member), "the member to end on its own SIGTERM", timeout=15.0)
    finally:
        monkeypatch.undo()
        if not _gone(member):
            os.kill(member, signal.SIGKILL)
    assert all(held for _, held in calls), f"os.killpg sent to a group whose leader was gone: {calls}"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _pidfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            continue
    return count


def test_a_closed_ref_signals_nothing(mode: str, tmp_path: Path) -> None:
    """After its teardown a handle's ref is closed: a later signal through it (``worker.kill()`` of a stopped
    worker) is not sent, with a pidfd or without (no fallback to the pid)."""
    proc, out = _recorder(tmp_path, dict(os.environ))
    try:
        ref = pidrefs.ProcessRef.prove(proc.pid)
        assert ref is not None and ref.held() and ref.has_pidfd is (mode == "pidfd")
        ref.close()
        assert not ref.signal(signal.SIGTERM) and not ref.held() and not ref.signal_group(signal.SIGTERM)
        assert_untouched(proc, out)
    finally:
        proc.kill()
        proc.wait()


def test_a_ref_wakes_at_its_process_exit_through_the_pidfd(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ProcessRef.wait_exit``, what a teardown waits on for the root's exit: False while the process runs, True once
    it has exited (not yet reaped); without a pidfd it only waits, and says False (the caller polls)."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        ref = pidrefs.ProcessRef.child(proc.pid)
        assert ref is not None and ref.has_pidfd
        assert ref.wait_exit(0.05) is False  # runs
        os.kill(proc.pid, signal.SIGKILL)
        assert ref.wait_exit(30) is True  # a zombie now: its parent has not reaped it
        assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
        ref.close()
        monkeypatch.setattr(pidrefs, "open_pidfd", lambda pid: None)
        blind = pidrefs.ProcessRef.child(proc.pid)
        assert blind is not None and not blind.has_pidfd
        assert blind.wait_exit(0.01) is False
    finally:
        proc.kill()
        proc.wait()
