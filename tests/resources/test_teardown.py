"""Process-tree teardown, the marker sweep and the adoption proof (``resources/processes.py``) on real processes,
without an engine: a small Python family (a child, a grandchild that left the session but kept the owner tag, one
that stayed in the session but left the tree) stands in for sglang's tree. The mutation run's fast tests of the
teardown and the adoption identity (scripts/mutation.py, targets ``teardown`` and ``adoption_proof``); the
teardown of real workers is tested in tests/workers/test_worker_lifecycle.py."""

from __future__ import annotations

import json
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

from pytest_sglworker.resources.pidrefs import boot_clock
from pytest_sglworker.resources.processes import (
    OWNER_ENV,
    UNKNOWN_EXIT,
    AdoptedProcess,
    find_session_processes,
    find_tagged_processes,
    owner_tag,
    process_tree,
    prove_process,
    sweep_session,
    terminate_tree,
)

FAMILY = r"""
import json, os, signal, subprocess, sys, time
out, mode = sys.argv[1], sys.argv[2]
stubborn, deaf_once, spawns = mode == "stubborn", mode == "deaf-once", mode == "spawns-on-term"
if mode == "deaf":  # the root and what it forks ignore SIGTERM (the child sets a handler of its own)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
CHILD = '''
import os, signal, subprocess, sys, time
parent = os.getppid()
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"

terms = []

def on_term(*_):
    terms.append(1)
    if len(terms) > 1:  # the group's SIGTERM and its own, one after the other: the first one is handled
        return
    with open(sys.argv[1] + ".at", "w") as fh:  # when it began to end (the boot clock), for a failure's text
        fh.write(str(time.clock_gettime(time.CLOCK_BOOTTIME)))
    with open(sys.argv[1], "w") as fh:
        fh.write("parent alive" if os.getppid() == parent else "parent gone")
    if sys.argv[2] == "child-spawns":  # while the group is told to end: a daemon deaf to SIGTERM, tagged, on its own
        helper = subprocess.Popen([sys.executable, "-c", DEAF], start_new_session=True)
        with open(sys.argv[1] + ".helper", "w") as fh:
            fh.write(str(helper.pid))
    time.sleep(0.3)  # a clean exit takes a while too: SIGKILL must wait for it
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(p.pid, flush=True)
time.sleep(600)
'''
child = subprocess.Popen([sys.executable, "-c", CHILD, out + ".child", mode], stdout=subprocess.PIPE)
grandchild = int(child.stdout.readline())

def orphan(setsid):
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        if setsid:
            os.setsid()
        if os.fork() == 0:
            if stubborn and setsid:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            time.sleep(600)
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 32))
    os.waitpid(middle, 0)
    return pid

escaped, stayed = orphan(True), orphan(False)

terms = []

def on_term(*_):
    terms.append(1)
    if deaf_once and len(terms) == 1:
        return  # as a signal that lands on a thread that does not act on it
    alive = all(os.path.exists(f"/proc/{p}") for p in (child.pid, grandchild, escaped, stayed))
    with open(out + ".term", "w") as fh:
        fh.write("children alive" if alive else "children gone")
    if spawns:  # a daemon started while shutting down: it carries the tag, in a session of its own
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        with open(out + ".helper", "w") as fh:
            fh.write(str(helper.pid))
    time.sleep(0.3)  # a clean shutdown takes a while (sglang's: seconds): its children must not be signalled meanwhile
    os._exit(0)

if mode != "deaf":
    signal.signal(signal.SIGTERM, on_term)
with open(out + ".tmp", "w") as fh:
    json.dump({"child": child.pid, "grandchild": grandchild, "escaped": escaped, "stayed": stayed}, fh)
os.rename(out + ".tmp", out)
while True:
    time.sleep(600)
"""


def wait_for(check: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def child_story(out: Path, began: float) -> str:
    """When the family's child began its clean exit, after the teardown began (a failure's text: a child SIGKILLed
    after its grace had either not handled its SIGTERM, or not been given the CPU to finish)."""
    at = Path(f"{out}.child.at")
    if not at.exists():
        return "the child never handled a SIGTERM"
    return f"the child began its clean exit {float(at.read_text()) - began:.2f} s into the teardown"


def session_id() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Pids to end (SIGKILL, by pid) after the test, whatever it did."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def family(tmp_path: Path, started: list[int], tag: str, *, mode: str = "plain"
           ) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    out = tmp_path / f"family-{uuid.uuid4().hex[:6]}.json"
    root = subprocess.Popen([sys.executable, "-c", FAMILY, str(out), mode],
                            env={**os.environ, OWNER_ENV: tag}, start_new_session=True)
    started.append(root.pid)
    wait_for(out.exists, "the family's pids")
    pids = json.loads(out.read_text())
    started.extend(pids.values())
    return root, {"root": root.pid, **pids}


def sleeper(started: list[int], env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env,
                            start_new_session=True)
    started.append(proc.pid)
    return proc


def test_the_tree_is_the_descendants_the_session_and_the_tagged(tmp_path: Path, started: list[int]) -> None:
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag)
    try:
        assert {p.pid for p in process_tree(root.pid, tag)} == set(pids.values())
        descendants = {pids["root"], pids["child"], pids["grandchild"]}
        assert {p.pid for p in process_tree(root.pid, tag, sweep=False)} == descendants
        assert {p.pid for p in process_tree(root.pid)} == {*descendants, pids["stayed"]}
        assert process_tree(2**22 + 1, None) == []  # no such root: nothing, no error
    finally:
        root.kill()
        root.wait()


def test_teardown_signals_the_root_first_and_ends_every_member(tmp_path: Path, started: list[int]) -> None:
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag)
    began = boot_clock()
    killed = terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=10.0, kill_timeout=10.0)
    out = next(tmp_path.glob("family-*.json"))
    assert killed == [], f"SIGKILLed: {killed} (the family: {pids}); {child_story(out, began)}"  # each on SIGTERM
    assert root.returncode == 0  # reaped by the teardown: its SIGTERM handler ran, while its children still ran
    assert Path(f"{out}.term").read_text() == "children alive"
    assert Path(f"{out}.child").read_text() == "parent gone"  # the child's SIGTERM came once the root had ended
    assert [name for name, pid in pids.items() if not gone(pid)] == []


def test_teardown_kills_what_ignores_sigterm(tmp_path: Path, started: list[int]) -> None:
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag, mode="stubborn")
    # the grace covers the root's own clean shutdown (0.3 s in its handler): 1 s was too short once in a full run
    # on 2 busy CPUs, and the root was SIGKILLed too
    killed = terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=3.0, kill_timeout=10.0)
    assert killed == [pids["escaped"]]
    assert [name for name, pid in pids.items() if not gone(pid)] == []


def test_a_stopped_root_is_resumed_to_handle_its_sigterm(tmp_path: Path, started: list[int]) -> None:
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag)
    for pid in (root.pid, pids["escaped"]):  # frozen (a debugger, ^Z): each handles its SIGTERM once resumed
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda pid=pid: psutil.Process(pid).status() == psutil.STATUS_STOPPED, "the process to stop")
    killed = terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=10.0, kill_timeout=10.0)
    assert killed == [] and root.returncode == 0
    out = next(tmp_path.glob("family-*.json"))
    assert Path(f"{out}.term").read_text() == "children alive"  # resumed at once, it ended before its children
    assert Path(f"{out}.child").read_text() == "parent gone"
    assert [name for name, pid in pids.items() if not gone(pid)] == []


def test_the_session_sweep_ends_its_tagged_processes_only(started: list[int]) -> None:
    ours, theirs = session_id(), session_id()
    leader = sleeper(started, {**os.environ, OWNER_ENV: owner_tag(ours)})
    other = sleeper(started, {**os.environ, OWNER_ENV: owner_tag(theirs)})
    try:
        assert sweep_session(ours, timeout=10.0) == []
        assert leader.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None
        assert {p.pid for p in find_session_processes(theirs)} == {other.pid}
    finally:
        other.kill()
        other.wait()


def test_a_tag_is_matched_whole_with_the_members_of_its_session(started: list[int]) -> None:
    sid = session_id()
    tag = owner_tag(sid)
    # the leader starts a member that does not carry the tag (as sglang's renamed scheduler): found as a member
    leader = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time; env = dict(os.environ); env.pop(sys.argv[1]);"
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], env=env);"
         "print(p.pid, flush=True); time.sleep(600)", OWNER_ENV],
        env={**os.environ, OWNER_ENV: tag}, start_new_session=True, stdout=subprocess.PIPE)
    started.append(leader.pid)
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    started.append(member)
    try:
        assert {p.pid for p in find_tagged_processes(tag)} == {leader.pid, member}
        assert {p.pid for p in find_session_processes(sid)} == {leader.pid, member}
        assert find_tagged_processes(f"{sid}:") == []  # a part of a tag finds nothing
        assert find_tagged_processes(sid) == []
        assert find_tagged_processes(owner_tag(sid)) == []  # another worker of the session
        assert find_session_processes("not-a-session") == []
    finally:
        leader.kill()
        leader.wait()
        leader.stdout.close()


# ---------------------------------------------------------------------------------------------- adoption


TERM_EXITS_0 = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
                "print('ready', flush=True)\n"
                "time.sleep(600)\n")


def adoptee(started: list[int], tag: str) -> tuple[subprocess.Popen[bytes], float]:
    proc = subprocess.Popen([sys.executable, "-c", TERM_EXITS_0], env={**os.environ, OWNER_ENV: tag},
                            stdout=subprocess.PIPE)
    started.append(proc.pid)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    proc.stdout.close()
    return proc, psutil.Process(proc.pid).create_time()


def test_a_process_is_proven_by_pid_start_time_and_tag(started: list[int]) -> None:
    tag = owner_tag(session_id())
    proc, created = adoptee(started, tag)
    try:
        assert prove_process(proc.pid, created, tag) is None
        assert prove_process(proc.pid, created + 0.04, tag) is None  # the clock's rounding
        assert prove_process(proc.pid, created - 1.0, tag) is None  # the boot time read a second apart
        assert "the pid was reused" in (prove_process(proc.pid, created + 5.0, tag) or "")
        assert "the pid was reused" in (prove_process(proc.pid, created - 5.0, tag) or "")
        other = owner_tag(session_id())
        assert prove_process(proc.pid, created, other) == f"pid {proc.pid} does not carry {OWNER_ENV}={other} " \
                                                          f"(it has {tag!r})"
        assert prove_process(proc.pid, created, tag, env_name="SGLWORKER_KEEPER") == (
            f"pid {proc.pid} does not carry SGLWORKER_KEEPER={tag} (it has None)")
    finally:
        proc.kill()
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, "the zombie")
    assert prove_process(proc.pid, created, tag) == f"pid {proc.pid} has exited"  # a zombie has exited
    proc.wait()
    assert prove_process(proc.pid, created, tag) == f"pid {proc.pid} has exited"


def test_an_adopted_handle_signals_only_its_own_process(started: list[int]) -> None:
    proc, created = adoptee(started, owner_tag(session_id()))
    impostor = AdoptedProcess(proc.pid, created + 5.0)  # the pid, reused by a process started later
    assert impostor.poll() == UNKNOWN_EXIT
    impostor.kill()  # must not reach the process of that pid
    adopted = AdoptedProcess(proc.pid, created + 0.04)
    assert adopted.poll() is None
    adopted.terminate()
    assert proc.wait(timeout=30) == 0  # its SIGTERM handler ran: the impostor's SIGKILL never came
    assert adopted.poll() == UNKNOWN_EXIT and adopted.returncode == UNKNOWN_EXIT


def test_a_boot_time_read_a_second_later_still_proves_the_process(started: list[int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil's start time is the process's start ticks plus the kernel's boot time, which Linux works out anew at
    each read (wall clock less uptime, whole seconds) and may say a second later than before: the process is
    still proven and still alive, not taken for a reused pid (a warm worker taken for dead, its keeper for gone)."""
    import psutil._pslinux as pslinux

    tag = owner_tag(session_id())
    proc, created = adoptee(started, tag)
    booted = pslinux.boot_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: booted + 1.0)
    try:
        assert psutil.Process(proc.pid).create_time() == pytest.approx(created + 1.0, abs=0.02)
        assert prove_process(proc.pid, created, tag) is None
        assert AdoptedProcess(proc.pid, created).poll() is None
    finally:
        monkeypatch.undo()
        proc.kill()
        proc.wait()


def test_an_adopted_zombie_counts_as_gone(started: list[int]) -> None:
    proc, created = adoptee(started, owner_tag(session_id()))
    adopted = AdoptedProcess(proc.pid, created)
    adopted.kill()
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, "the zombie")
    assert adopted.poll() == UNKNOWN_EXIT
    adopted.kill()  # a zombie is not signalled again (and nothing fails)
    assert proc.wait() == -signal.SIGKILL


def test_a_root_deaf_to_its_first_sigterm_gets_another_before_its_children_are_signalled(
        tmp_path: Path, started: list[int]) -> None:
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag, mode="deaf-once")
    began = boot_clock()
    killed = terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=10.0, kill_timeout=10.0)
    out = next(tmp_path.glob("family-*.json"))
    assert killed == [], f"SIGKILLed: {killed} (the family: {pids}); {child_story(out, began)}"
    assert root.returncode == 0
    assert Path(f"{out}.term").read_text() == "children alive"
    assert Path(f"{out}.child").read_text() == "parent gone"
    assert [name for name, pid in pids.items() if not gone(pid)] == []


def test_a_process_that_cannot_be_inspected_is_not_proven(started: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc unreadable (a hardened mount): said in words, never raised."""
    tag = owner_tag(session_id())
    proc, created = adoptee(started, tag)

    def unreadable(self: psutil.Process) -> dict[str, str]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(psutil.Process, "environ", unreadable)
    try:
        assert prove_process(proc.pid, created, tag) == f"pid {proc.pid} cannot be inspected (OSError)"
    finally:
        monkeypatch.undo()
        proc.kill()
        proc.wait()


def test_a_process_the_root_starts_while_stopping_is_ended_with_the_rest(tmp_path: Path, started: list[int]) -> None:
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag, mode="spawns-on-term")
    began = boot_clock()
    killed = terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=10.0, kill_timeout=10.0)
    out = next(tmp_path.glob("family-*.json"))
    helper = int(Path(f"{out}.helper").read_text())
    started.append(helper)
    # found after the root ended, and sent SIGTERM with the rest, not SIGKILL. Only the helper is asked about: the
    # child's clean exit (0.3 s of Python) once outlasted its 5 s grace in CI, on a machine too busy to give it the
    # CPU; its clean end is the family test's to check (above)
    assert helper not in killed, f"SIGKILLed: {killed} (the helper: {helper}); {child_story(out, began)}"
    assert root.returncode == 0
    assert gone(helper)
    assert [name for name, pid in pids.items() if not gone(pid)] == []


def test_a_process_that_vanishes_mid_scan_does_not_end_the_scan(tmp_path: Path, started: list[int],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that exits between the listing and its ``getsid`` (the first one looked at, here) is passed over;
    the rest of the listing is still scanned, and the member of the root's session found."""
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag)
    real_getsid, calls = os.getsid, []

    def vanishing_first(pid: int) -> int:
        calls.append(pid)
        if len(calls) == 1:
            raise ProcessLookupError(3, "No such process")
        return real_getsid(pid)

    monkeypatch.setattr(os, "getsid", vanishing_first)
    try:
        found = {p.pid for p in process_tree(root.pid)}
    finally:
        monkeypatch.undo()
        root.kill()
        root.wait()
    assert calls and calls[0] not in pids.values()  # the vanished one is none of the family
    assert found == {pids["root"], pids["child"], pids["grandchild"], pids["stayed"]}


def _root_only(root: subprocess.Popen[bytes]) -> Callable[[], list[psutil.Process]]:
    """A collection that sees the root alone: the members of its process group are missed (an unreadable /proc
    entry, a scan that raced their start); only the signals to the whole group reach them."""
    proc = psutil.Process(root.pid)
    return lambda: [proc]


def test_the_group_is_told_to_end_when_the_collection_misses_its_members(tmp_path: Path,
                                                                          started: list[int]) -> None:
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag)
    killed = terminate_tree(root, _root_only(root), term_timeout=10.0, kill_timeout=10.0)
    assert killed == [] and root.returncode == 0
    for name in ("child", "grandchild", "stayed"):  # the root's process group; "escaped" left it
        wait_for(lambda name=name: gone(pids[name]), f"the {name} to end on the group's SIGTERM", timeout=15.0)


def test_the_group_is_killed_with_a_root_deaf_to_sigterm(tmp_path: Path, started: list[int]) -> None:
    """The root and a member the collection misses ignore SIGTERM: SIGKILL goes to the root's whole group."""
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag, mode="deaf")
    killed = terminate_tree(root, _root_only(root), term_timeout=0.5, kill_timeout=10.0)
    assert killed == [root.pid] and root.returncode == -signal.SIGKILL
    for name in ("child", "grandchild", "stayed"):  # "stayed" ignores SIGTERM too: only the group's SIGKILL ends it
        wait_for(lambda name=name: gone(pids[name]), f"the {name} to end", timeout=15.0)


def test_a_deaf_root_whose_proof_races_the_groups_sigkill_is_still_counted(
        tmp_path: Path, started: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's SIGKILL can reach the root while it is proven on its own: it turns zombie between the two
    reads of its identity, the proof fails, and nothing is sent (once in CI, on a busy machine). It needed
    SIGKILL all the same, and the group's ended it: it is reported."""
    import pytest_sglworker.resources.processes as processes

    tag = owner_tag(session_id())
    root, _ = family(tmp_path, started, tag, mode="deaf")
    real = processes.signal_proven

    def racing(proc: psutil.Process, sig: int) -> bool:
        if sig == signal.SIGKILL and proc.pid == root.pid:
            return False  # the proof lost the race with the root's exit
        return real(proc, sig)

    monkeypatch.setattr(processes, "signal_proven", racing)
    killed = terminate_tree(root, _root_only(root), term_timeout=0.5, kill_timeout=10.0)
    assert killed == [root.pid] and root.returncode == -signal.SIGKILL


def test_a_process_started_during_the_groups_grace_is_found_and_killed(tmp_path: Path, started: list[int]) -> None:
    """The child starts a daemon (tagged, in a session of its own, deaf to SIGTERM) when the group is told to end:
    the tree is collected again after the group's grace, and the daemon killed."""
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag, mode="child-spawns")
    try:
        killed = terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=10.0, kill_timeout=10.0)
    finally:
        out = next(tmp_path.glob("family-*.json"))
        helper_file = Path(f"{out}.child.helper")
        if helper_file.exists():
            started.append(int(helper_file.read_text()))
    helper = int(helper_file.read_text())
    assert killed == [helper]
    assert [name for name, pid in {**pids, "helper": helper}.items() if not gone(pid)] == []


def test_a_member_of_the_session_that_is_another_users_is_not_swept(started: list[int]) -> None:
    """As root: a process of another user in the worker's session, not its descendant (a double fork that
    switched its uid); the sweep by session takes processes of the session's own user only."""
    if os.geteuid() != 0:
        pytest.skip("a process of another user in our session needs root")
    leader = subprocess.Popen(
        [sys.executable, "-c", "import os, time\n"
         "r, w = os.pipe()\n"
         "if os.fork() == 0:\n"
         "    if os.fork() == 0:\n"
         "        os.setgid(65534); os.setuid(65534)\n"
         "        os.write(w, str(os.getpid()).encode()); os.close(w); time.sleep(600)\n"
         "    os._exit(0)\n"
         "os.close(w); print(int(os.read(r, 32)), flush=True); time.sleep(600)"],
        start_new_session=True, stdout=subprocess.PIPE)
    started.append(leader.pid)
    assert leader.stdout is not None
    theirs = int(leader.stdout.readline())
    started.append(theirs)
    try:
        wait_for(lambda: psutil.Process(theirs).uids().real == 65534, "the other user's process")
        middle = {c.pid for c in psutil.Process(leader.pid).children()}
        wait_for(lambda: psutil.Process(theirs).ppid() not in middle, "the middle process to exit (an orphan)")
        assert os.getsid(theirs) == leader.pid
        found = {p.pid for p in process_tree(leader.pid)}
        assert leader.pid in found and theirs not in found
    finally:
        leader.kill()
        leader.wait()
        leader.stdout.close()


def test_a_root_that_vanishes_before_it_is_read_leaves_the_rest_of_its_tree(tmp_path: Path, started: list[int],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The root is read (psutil) just after it was seen holding its pid: gone in between, it is passed over and
    the members of its session are still found, no error."""
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag)
    real = psutil.Process

    def vanished(pid: int | None = None) -> psutil.Process:
        if pid == root.pid:
            raise psutil.NoSuchProcess(pid)
        return real(pid)

    monkeypatch.setattr(psutil, "Process", vanished)
    try:
        found = {p.pid for p in process_tree(root.pid, ref=None)}
    finally:
        monkeypatch.undo()
        root.kill()
        root.wait()
    assert {pids["stayed"]} <= found and root.pid not in found


def test_a_stopped_member_is_resumed_to_handle_its_sigterm(tmp_path: Path, started: list[int]) -> None:
    """A member of the tree frozen by SIGSTOP (a debugger, a job control stop) gets SIGCONT with its SIGTERM and
    ends cleanly: nothing needs SIGKILL."""
    tag = owner_tag(session_id())
    root, pids = family(tmp_path, started, tag)
    os.kill(pids["child"], signal.SIGSTOP)
    wait_for(lambda: psutil.Process(pids["child"]).status() == psutil.STATUS_STOPPED, "the child to stop")
    killed = terminate_tree(root, lambda: process_tree(root.pid, tag), term_timeout=10.0, kill_timeout=10.0)
    assert killed == []
    out = next(tmp_path.glob("family-*.json"))
    assert Path(f"{out}.child").read_text() in ("parent alive", "parent gone")  # its SIGTERM handler ran
    assert [name for name, pid in pids.items() if not gone(pid)] == []
