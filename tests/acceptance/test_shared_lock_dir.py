"""Two real users share one lock directory exactly as docs/how-to/shared-gpu-box.md sets it up: a root-owned
``install -d -m 1777`` directory named by ``SGLWORKER_LOCK_DIR`` for both. Root (this suite) and an unprivileged user
made for the test (``second_user``, tests/second_user.py) run sessions on the simulated engine, one after the other
and both at once, with ``-n 2`` each; the run reports must show no GPU and no port used by two workers at once, and
both users' sessions must pass with nothing left running.

Also the ownership checks of the lock directory as the second user sees them (docs/SECURITY.md), which the tests
that run as root can only plant with ``chown``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
from second_user import SecondUser

#: one spec on the simulated engine; every test gets a fresh worker, so that GPUs and ports change hands often
CONFTEST = '''
from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec(name="w", model="org/shared", memory_gb=4, tp=1, worker_args=CI_WORKER_ARGS))
'''
TESTS = '''
import pytest

@pytest.mark.sgl_worker(fresh=True)
@pytest.mark.parametrize("i", range(3))
def test_uses_a_gpu(sgl_worker, i):
    assert sgl_worker.client.get("/health").status_code == 200
'''
TESTS_RUN = 3
SIM = ["--sgl-engine", "sim", "--sgl-gpus", "sim:2", "--sgl-model", "w", "-p", "no:cacheprovider",
       "--sgl-lease-timeout", "240"]
SESSION_TIMEOUT = 420.0


def how_to_lock_dir(base: Path) -> Path:
    """``install -d -m 1777 <base>/sglworker-locks``, as root."""
    path = base / "sglworker-locks"
    subprocess.run(["install", "-d", "-m", "1777", str(path)], check=True, timeout=30)
    return path


def project(directory: Path, owner: SecondUser | None) -> Path:
    directory.mkdir(parents=True)
    (directory / "conftest.py").write_text(CONFTEST)
    (directory / "test_shared.py").write_text(TESTS)
    (directory / "tmp").mkdir()
    if owner is not None:
        for path in (directory, directory / "conftest.py", directory / "test_shared.py", directory / "tmp"):
            os.chown(path, owner.uid, owner.gid)
    return directory


class Run:
    """One session of one user, started now; :meth:`finish` waits for it (bounded) and reads its run report."""

    def __init__(self, who: str, proc: subprocess.Popen[bytes], out: Path, report: Path) -> None:
        self.who, self.proc, self.out, self.report_path = who, proc, out, report

    def finish(self) -> dict[str, Any]:
        try:
            code = self.proc.wait(SESSION_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.who}'s session did not end within {SESSION_TIMEOUT:g} s:\n"
                                 f"{self.output()}") from None
        out = self.output()
        assert code == 0, f"{self.who}'s session exited {code}:\n{out}"
        for bad in ("Traceback", "INTERNALERROR", "PermissionError", "cannot write", "free some space"):
            assert bad not in out, f"{bad!r} in {self.who}'s session:\n{out}"
        report: dict[str, Any] = json.loads(self.report_path.read_text())
        assert report["outcomes"]["passed"] == TESTS_RUN, (report["outcomes"], out)
        for launch in report["launches"]:
            launch["who"] = self.who
        return report

    def output(self) -> str:
        return self.out.read_text(errors="replace")


def start_root(base: Path, lock_dir: Path, name: str) -> Run:
    work = project(base / f"root-{name}", None)
    env = {**os.environ, "SGLWORKER_LOCK_DIR": str(lock_dir), "SGLSIM_STARTUP_SECONDS": "0.2",
           "TMPDIR": str(work / "tmp")}
    env.pop("SGLWORKER_LOG_DIR", None)
    out = work / "session.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *SIM, "-n", "2", "--sgl-report", "r.json"],
                                cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT)
    return Run("root", proc, out, work / "r.json")


def start_user(user: SecondUser, lock_dir: Path, name: str, *args: str) -> Run:
    work = project(user.home / name, user)
    env = {"SGLWORKER_LOCK_DIR": str(lock_dir), "SGLSIM_STARTUP_SECONDS": "0.2", "TMPDIR": str(work / "tmp")}
    out = user.home / f"{name}.out"
    proc = user.pytest([*SIM, "-n", "2", "--sgl-report", "r.json", *args], cwd=work, env=env, out=out)
    return Run(user.name, proc, out, work / "r.json")


def overlaps(launches: list[dict[str, Any]]) -> list[str]:
    """Pairs of workers that held one GPU (leased .. released) or one port (started .. stopped) at once."""
    found = []
    for a, b in combinations(launches, 2):
        shared_gpus = set(a["gpus"]) & set(b["gpus"])
        if shared_gpus and a["t_leased"] < b["t_released"] and b["t_leased"] < a["t_released"]:
            found.append(f"GPU {sorted(shared_gpus)}: {a['who']} {a['id']} and {b['who']} {b['id']}")
        if a["port"] == b["port"] and a["t_started"] < b["t_stopped"] and b["t_started"] < a["t_stopped"]:
            found.append(f"port {a['port']}: {a['who']} {a['id']} and {b['who']} {b['id']}")
    return found


def check(reports: list[dict[str, Any]], lock_dir: Path) -> list[dict[str, Any]]:
    launches = [launch for report in reports for launch in report["launches"]]
    assert len(launches) == TESTS_RUN * len(reports), launches
    for launch in launches:
        assert launch["outcome"] == "ok" and launch["gpus"], launch
        assert None not in (launch["t_leased"], launch["t_released"], launch["t_started"], launch["t_stopped"]), launch
    assert overlaps(launches) == []
    left = sorted(p.name for p in lock_dir.iterdir() if not p.name.endswith(".lock"))
    assert left == [], f"holder records, flags or temporary files left in the lock directory: {left}"
    return launches


def lock_owners(lock_dir: Path) -> dict[int, int]:
    """GPU index -> the uid that owns its lock file."""
    return {int(p.stem.rsplit("-", 1)[1]): p.stat().st_uid for p in lock_dir.glob("gpu-*.lock")}


def test_two_users_alternate_on_the_how_tos_lock_directory(second_user: SecondUser) -> None:
    lock_dir = how_to_lock_dir(second_user.base)
    first = start_root(second_user.base, lock_dir, "first").finish()
    owners = lock_owners(lock_dir)
    assert owners and set(owners.values()) == {0}, owners  # root made every GPU's lock file
    for path in lock_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path  # readable by all, writable by its owner only
    second = start_user(second_user, lock_dir, "second").finish()
    used = {gpu for launch in second["launches"] for gpu in launch["gpus"]}
    assert used & set(owners), "the second user never leased a GPU whose lock file root made"
    third = start_root(second_user.base, lock_dir, "third").finish()
    check([first, second, third], lock_dir)
    assert second_user.wait_idle(30) == []


def test_two_users_at_once_with_two_xdist_workers_each(second_user: SecondUser) -> None:
    lock_dir = how_to_lock_dir(second_user.base)
    runs = [start_user(second_user, lock_dir, "theirs"), start_root(second_user.base, lock_dir, "ours")]
    reports = [run.finish() for run in runs]
    launches = check(reports, lock_dir)
    # 4 xdist workers wanted the 2 GPUs: someone waited, and both users held GPUs
    assert {launch["who"] for launch in launches} == {"root", second_user.name}
    assert second_user.wait_idle(30) == []


# --------------------------------------------------------------------------------------------------------
# the ownership checks, as the second user meets them
# --------------------------------------------------------------------------------------------------------

CHECK = '''
import sys
from pathlib import Path
from pytest_sglworker.resources.state import UnsafeDirectory, ensure_private_dir
try:
    ensure_private_dir(Path(sys.argv[1]), what="lock directory", shared_ok=True)
except UnsafeDirectory as exc:
    print(f"refused: {exc}")
else:
    print("accepted")
'''


def _as_user(user: SecondUser, path: Path) -> str:
    done = user.run([user.python, "-c", CHECK, str(path)], cwd=user.home)
    assert done.returncode == 0, done.stdout
    return done.stdout.strip()


@pytest.mark.parametrize(("owner", "mode", "expect"), [
    ("root", 0o1777, "accepted"),  # the how-to's
    ("user", 0o700, "accepted"),  # the user's own
    ("root", 0o777, "refused: * is writable by other users (mode 777)*"),  # no sticky bit
    ("third", 0o1777, "refused: * belongs to uid *, not to you (uid *) or to root*"),  # finding 2
])
def test_the_lock_directorys_owner_and_mode_as_the_second_user(second_user: SecondUser, owner: str, mode: int,
                                                                expect: str) -> None:
    import fnmatch

    path = second_user.base / "locks"
    path.mkdir()
    uid = {"root": 0, "user": second_user.uid, "third": 65534}[owner]
    os.chown(path, uid, uid)
    path.chmod(mode)
    said = _as_user(second_user, path)
    assert fnmatch.fnmatch(said, expect), said


def test_a_parent_that_is_a_symlink_into_another_users_directory_is_refused(second_user: SecondUser) -> None:
    """Finding 6: the last component is the lock directory the how-to made, but the way to it runs through a
    symlink into a directory of another user (here: root's session sees the second user's): refused, naming it."""
    theirs = second_user.home / "mine"
    theirs.mkdir()
    (theirs / "locks").mkdir()
    for path in (theirs, theirs / "locks"):
        os.chown(path, second_user.uid, second_user.gid)
    (theirs / "locks").chmod(0o1777)
    link = second_user.base / "via"
    link.symlink_to(theirs)
    from pytest_sglworker.resources.state import UnsafeDirectory, ensure_private_dir

    with pytest.raises(UnsafeDirectory, match=rf"lies in {second_user.home}, which belongs to uid {second_user.uid}"):
        ensure_private_dir(link / "locks", what="lock directory", shared_ok=True)
    assert list((theirs / "locks").iterdir()) == []
    # and as the second user, the way through root's sticky shared place (1777, like /tmp) is fine
    shared = second_user.base / "tmp-like"
    subprocess.run(["install", "-d", "-m", "1777", str(shared)], check=True, timeout=30)
    mine = second_user.run(["mkdir", "-m", "700", str(shared / "d")], cwd=second_user.home)
    assert mine.returncode == 0, mine.stdout
    assert _as_user(second_user, shared / "d") == "accepted"


def test_a_lock_file_the_user_cannot_open_skips_that_gpu_only(second_user: SecondUser) -> None:
    """Root's lock file of GPU 0 made 0600: the second user's sessions lease GPU 1 and pass; the whole session never
    fails on it, and where it has to wait for GPU 0 the message says what is true and how to fix it."""
    lock_dir = how_to_lock_dir(second_user.base)
    planted = lock_dir / "gpu-sim-2x80-0.lock"
    planted.write_bytes(b"")
    planted.chmod(0o600)
    report = start_user(second_user, lock_dir, "two").finish()
    assert {tuple(launch["gpus"]) for launch in report["launches"]} == {(1,)}, report["launches"]
    one = lock_dir / "gpu-sim-1x80-0.lock"
    one.write_bytes(b"")
    one.chmod(0o600)
    work = project(second_user.home / "one", second_user)
    args = [a if a != "sim:2" else "sim:1" for a in SIM]
    done = second_user.run([second_user.python, "-m", "pytest", *args, "--sgl-lease-timeout", "2", "-p", "no:xdist"],
                           cwd=work, env={"SGLWORKER_LOCK_DIR": str(lock_dir), "TMPDIR": str(work / "tmp")},
                           timeout=SESSION_TIMEOUT)
    out = done.stdout
    assert "Traceback" not in out and "INTERNALERROR" not in out and "free some space" not in out, out
    assert "3 errors" in out, out
    assert (f"GPU 0 not usable by you: its lock file gpu-sim-1x80-0.lock cannot be opened by you (Permission denied "
            f"(it belongs to uid 0, mode 600)); a shared lock file must be a regular file every user may read (its "
            f"owner, uid 0, can run 'chmod 644 {one}')") in " ".join(out.split()), out
    assert planted.stat().st_uid == 0 and one.exists(), "another user's lock file is theirs"


ROOTS_RECORD = {"pid": 1, "hostname": os.uname().nodename, "holder": "root's", "since": 0.0, "uuid": "GPU-sim-0",
                "memory_mib": 1024, "index": 0, "namespace": "sim-2x80", "gpus": [0]}


def test_roots_records_are_left_alone_by_the_second_user(second_user: SecondUser) -> None:
    """The ownership checks from the other side: what root's sessions leave in the shared directory (a holder record
    beside a free lock, a warm record, an untrusted record) is read by the unprivileged user's janitor and
    ``--sgl-warm stop`` as another user's, and left alone."""
    lock_dir = how_to_lock_dir(second_user.base)
    holder = lock_dir / "gpu-sim-2x80-0.json"
    holder.write_text(json.dumps(ROOTS_RECORD))
    untrusted = lock_dir / "gpu-sim-4x80-1.json"
    untrusted.write_bytes(b"{not json")
    warm = lock_dir / "warm-1-abcdefab.json"
    warm.write_bytes(b"{}")
    before = {p: p.read_bytes() for p in (holder, untrusted, warm)}
    work = project(second_user.home / "w", second_user)
    env = {"SGLWORKER_LOCK_DIR": str(lock_dir), "TMPDIR": str(work / "tmp")}
    stopped = second_user.run([second_user.python, "-m", "pytest", "--sgl-warm", "stop", "-p", "no:cacheprovider"],
                              cwd=work, env=env, timeout=SESSION_TIMEOUT)
    assert "warm-1-abcdefab.json: belongs to uid 0 (another user): left alone" in stopped.stdout, stopped.stdout
    assert stopped.returncode == 0, stopped.stdout
    run = start_user(second_user, lock_dir, "two")
    report = run.finish()  # its janitor and its sweep of untrusted records read all three
    assert {tuple(launch["gpus"]) for launch in report["launches"]} == {(1,)}, report["launches"]  # GPU 0: busy
    assert {p: p.read_bytes() for p in (holder, untrusted, warm)} == before


OWNED = '''
import sys
from pathlib import Path
from pytest_sglworker.resources.owned_files import FileId, append_owned, remove_own_entry
path = Path(sys.argv[1])
print(f"append: {append_owned(path, FileId.of(path), b'x')}")
print(f"remove: {remove_own_entry(path)}")
'''


def test_another_users_file_is_theirs_as_the_second_user_sees_it(second_user: SecondUser) -> None:
    """tests/resources/test_owned_files.py plants another user's file with chown as root; here the unprivileged user
    meets root's file in the shared sticky directory: neither appended to nor removed, each saying why."""
    shared = second_user.base / "sticky"
    subprocess.run(["install", "-d", "-m", "1777", str(shared)], check=True, timeout=30)
    roots = shared / "sglang-worker-30001.log"
    roots.write_bytes(b"root's\n")
    roots.chmod(0o666)  # even a file the user may write is not theirs to touch
    done = second_user.run([second_user.python, "-c", OWNED, str(roots)], cwd=second_user.home)
    assert done.returncode == 0, done.stdout
    assert "append: belongs to uid 0, not to this user" in done.stdout, done.stdout
    assert "remove: belongs to uid 0 (another user): left alone" in done.stdout, done.stdout
    assert roots.read_bytes() == b"root's\n"


def test_a_default_root_another_user_planted_is_refused_as_the_second_user(second_user: SecondUser) -> None:
    """tests/acceptance/test_security.py plants the default root with chown as root; here root plants the second
    user's ``<tmp>/pytest-sglworker-<uid>`` in a shared sticky temp directory, and the user's session refuses it."""
    tmp = second_user.base / "tmp"
    subprocess.run(["install", "-d", "-m", "1777", str(tmp)], check=True, timeout=30)
    planted = tmp / f"pytest-sglworker-{second_user.uid}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    work = project(second_user.home / "p", second_user)
    done = second_user.run([second_user.python, "-m", "pytest", *SIM, "-p", "no:xdist"], cwd=work,
                           env={"TMPDIR": str(tmp)}, timeout=SESSION_TIMEOUT)
    assert done.returncode != 0, done.stdout
    assert f"{planted} belongs to uid 0, not to you (uid {second_user.uid})" in " ".join(done.stdout.split()), \
        done.stdout
    assert "Traceback" not in done.stdout and list(planted.iterdir()) == []
