"""A real second user for the tests of a lock directory several users share (docs/how-to/shared-gpu-box.md).

CI and the development machines run the suite as root: :func:`make_second_user` (the ``second_user`` fixture of
tests/conftest.py) makes an unprivileged user with ``useradd`` (a unique name, no home directory, no login shell),
runs commands as it with ``runuser``, and removes it with ``userdel`` at the end. What it started is ended by the pid
``runuser`` had; what the user still runs at the end (``ps -u``) fails the test that used it. Tests that need it
skip, with the reason, when the suite does not run as root or the tools are missing.

Everything the user writes lives in a directory of the test (:attr:`SecondUser.home`): its project, its ``TMPDIR``
(so that its default lock and log directories go there too), its cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

TOOLS = ("useradd", "userdel", "runuser")
#: what the user's commands get from this process's environment (the rest is set explicitly)
PASSED_ON = ("SGLWORKER_TEST_MARK", "LANG", "LC_ALL", "PYTHONDONTWRITEBYTECODE")


def unavailable() -> str | None:
    """Why no second user can be made here, or None."""
    if os.geteuid() != 0:
        return "a second user is made with useradd and run with runuser, which needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found: no second user can be made"
    return None


@dataclass
class SecondUser:
    name: str
    uid: int
    gid: int
    #: a directory of the user's own (mode 0755, in a root-owned 0755 directory of the test: :attr:`base`)
    home: Path
    #: the interpreter its commands run (:func:`interpreter`), and what its environment needs for it
    python: str = sys.executable
    python_env: dict[str, str] = field(default_factory=dict)
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def base(self) -> Path:
        """The root-owned directory (0755) around :attr:`home`: where a test puts what it shares with the user."""
        return self.home.parent

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {key: os.environ[key] for key in PASSED_ON if key in os.environ}
        env.update({"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, "TMPDIR": str(self.home / "tmp"),
                    "XDG_CACHE_HOME": str(self.home / "cache"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        env.update(self.python_env)
        env.update(extra or {})
        return env

    def argv(self, command: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """``command`` as this user, with exactly ``env`` as its environment."""
        runuser = shutil.which("runuser") or "runuser"
        return [runuser, "-u", self.name, "--", "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()),
                *command]

    def popen(self, command: Sequence[str], *, cwd: Path, out: Path,
              env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``command`` as this user in ``cwd``, its output into ``out``; ended at the end if still running."""
        with open(out, "wb") as fh:
            proc = subprocess.Popen(self.argv(command, self.environ(env)), cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=fh, stderr=subprocess.STDOUT)
        self.started.append(proc)
        return proc

    def pytest(self, args: Sequence[str], *, cwd: Path, out: Path,
               env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """An inner pytest session as this user, run by this suite's interpreter (its venv is readable by all)."""
        return self.popen([self.python, "-m", "pytest", *args], cwd=cwd, env=env, out=out)

    def run(self, command: Sequence[str], *, cwd: Path, timeout: float = 60.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``command`` as this user to its end (bounded by ``timeout``), its output captured."""
        proc = subprocess.Popen(self.argv(command, self.environ(env)), cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.started.append(proc)
        try:
            raw, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raw, _ = proc.communicate()
            raise AssertionError(f"{command} as {self.name} did not end within {timeout:g} s:\n"
                                 f"{raw.decode(errors='replace')}") from None
        return subprocess.CompletedProcess(command, proc.returncode, raw.decode(errors="replace"), None)

    def processes(self) -> list[psutil.Process]:
        """What this user runs now (``ps -u``), zombies left out."""
        found = []
        for proc in psutil.process_iter(["uids", "status"]):
            try:
                if proc.info["uids"] and proc.info["uids"].real == self.uid and \
                        proc.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def wait_idle(self, timeout: float) -> list[str]:
        """Wait (bounded) until this user runs nothing; what still runs then, in words."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.processes()
            if not left or time.monotonic() >= deadline:
                return [_describe(p) for p in left]
            time.sleep(0.1)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return str(proc.pid)


@contextmanager
def make_second_user(base: Path) -> Iterator[SecondUser]:
    """A new unprivileged user whose own directory is ``base/<name>`` (``base`` must be a root-owned directory
    every user may enter); removed at the end, with what it runs checked."""
    name = f"sglw{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                    "--user-group", name], check=True, capture_output=True, text=True, timeout=60)
    user: SecondUser | None = None
    try:
        import pwd

        entry = pwd.getpwnam(name)
        home = base / name
        (home / "tmp").mkdir(parents=True)
        (home / "cache").mkdir()
        for path in (home, home / "tmp", home / "cache"):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        home.chmod(0o755)
        user = SecondUser(name, entry.pw_uid, entry.pw_gid, home)
        yield user
    finally:
        left: list[str] = []
        if user is not None:
            for proc in user.started:  # only what we started, by the pid we had
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            left = user.wait_idle(30)
            # The user is new and unique: whatever runs as it descends from what we started. A test failure below
            # names them; the user can only be removed once they are gone.
            for stray in user.processes():
                with _suppress():
                    stray.kill()
        subprocess.run(["userdel", name], capture_output=True, text=True, timeout=60)
        assert not left, f"processes of the second user {name} left running: {left}"


def interpreter(user: SecondUser) -> str | None:
    """Find a Python the user can run with this suite's packages: this one, or (when it lives where the user cannot
    reach it, a pyenv under /root) the system's interpreter of the same version with this environment's
    site-packages and the checkout on ``PYTHONPATH``. Sets :attr:`SecondUser.python`; None, or why there is none."""
    import sysconfig

    import pytest_sglworker

    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    probe = ("import sys, pytest, pytest_sglworker; "
             f"assert '{version}' == '%d.%d' % sys.version_info[:2]; print(pytest_sglworker.__file__)")
    checkout = str(Path(pytest_sglworker.__file__).resolve().parents[1])
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], checkout])
    tried = []
    for python, env in ((sys.executable, {}),
                        *((f"{d}/python{version}", {"PYTHONPATH": os.pathsep.join(paths)})
                          for d in ("/usr/bin", "/usr/local/bin"))):
        if not os.path.exists(python):
            continue
        user.python, user.python_env = python, env
        done = user.run([python, "-c", probe], cwd=user.home, timeout=120)
        if done.returncode == 0:
            return None
        tried.append(f"{python}: {done.stdout.strip().splitlines()[-1:] or done.returncode}")
    return f"the second user can run no Python {version} with this suite's packages ({'; '.join(tried)})"


@contextmanager
def _suppress() -> Iterator[None]:
    try:
        yield
    except psutil.Error:
        pass


def shared_base(path: Path) -> Path:
    """A root-owned directory every user may enter and read (0755), for a test's shared lock directory and its
    users' own directories: what lies above a lock directory must belong to root or to its user."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)
    return path
