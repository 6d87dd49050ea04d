"""Security: workers listen on loopback only; lock and log directories resist other users; the plugin never
writes a secret.

The worker's own log is the engine's output: the engine writes it straight to the file (no pipe, so that a
chatty engine can never block), so the plugin cannot redact it. It protects it instead (0600, in a 0700
directory) and redacts everything it writes itself: failure messages, report sections, the terminal summary,
the ``--sgl-report`` JSON.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sglworker.engine.redaction import secret_values
from pytest_sglworker.resources.state import UnsafeDirectory, ensure_private_dir

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1", "-p", "no:cacheprovider"]
NOBODY = 65534


# --------------------------------------------------------------------------------------------------------
# Loopback only
# --------------------------------------------------------------------------------------------------------


def test_workers_listen_on_loopback_only(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makeconftest("""
        from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("exposed", "org/exposed", 4, worker_args=(*CI_WORKER_ARGS, "--host", "0.0.0.0")))
    """)
    pytester.makepyfile("""
        import psutil
        import pytest

        def _listening(pid):
            return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
                          if c.status == psutil.CONN_LISTEN)

        @pytest.mark.sgl_worker(args=["--host", "0.0.0.0"])
        def test_host(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--ho", "0.0.0.0"])
        def test_abbreviated(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--host=::"])
        def test_equals_ipv6_any(sgl_worker): pass

        def test_spawn_factory(sgl_spawn_worker):
            sgl_spawn_worker(args=["--hos", "10.1.2.3"])

        def test_spec_args(sgl_spawn_worker):
            sgl_spawn_worker("exposed")

        def test_default_is_loopback(sgl_worker):
            assert _listening(sgl_worker.pid) == [("127.0.0.1", sgl_worker.port)]

        @pytest.mark.sgl_worker(args=["--host", "0.0.0.0"], allow_foreign_host="an external client must reach it")
        def test_explicit_opt_out(sgl_worker):
            assert _listening(sgl_worker.pid) == [("0.0.0.0", sgl_worker.port)]
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-log-retention-policy", "failed", timeout=120)
    result.assert_outcomes(passed=2, errors=3, failed=2)
    out = result.stdout.str()
    refused = "workers listen on 127.0.0.1 only (opt out with allow_foreign_host=True"
    for host in ("'0.0.0.0'", "'::'", "'10.1.2.3'"):
        assert f"extra args would bind {host}, not loopback; {refused}" in out
    assert out.count("not loopback") >= 5
    assert f"the worker_args of spec 'exposed' would bind '0.0.0.0', not loopback; {refused}" in out
    assert "INTERNALERROR" not in out
    # a refused worker is never launched (a failed launch would have kept its log)
    assert len(list(Path(sim_env["SGLWORKER_LOG_DIR"]).glob("sglang-worker-*.log"))) == 0


# --------------------------------------------------------------------------------------------------------
# Lock and log directories in a shared temp dir
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["log", "lock"])
def test_planted_symlink_at_a_directory_is_refused(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   which: str) -> None:
    target = tmp_path / "attacker"
    target.mkdir(mode=0o777)
    planted = tmp_path / "planted"
    planted.symlink_to(target)
    monkeypatch.setenv(f"SGLWORKER_{which.upper()}_DIR", str(planted))
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess(*SIM, timeout=60)
    result.assert_outcomes(errors=1)  # an error, never a skip that would turn the run green
    result.stdout.fnmatch_lines([f"*{which} directory {planted} is a symlink; refusing to follow it*"])
    assert list(target.iterdir()) == []  # not followed


@pytest.fixture
def shared_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A world-writable sticky temp dir (like /tmp) as TMPDIR, and no explicit lock or log dir."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.delenv("SGLWORKER_LOG_DIR", raising=False)
    monkeypatch.delenv("SGLWORKER_LOCK_DIR", raising=False)
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "0.2")
    yield shared


@pytest.mark.parametrize("planted", ["symlink", "directory of another user"])
def test_planted_default_root_is_refused(pytester: pytest.Pytester, shared_tmp: Path, tmp_path: Path,
                                         planted: str) -> None:
    root = shared_tmp / f"pytest-sglworker-{os.getuid()}"
    attacker = tmp_path / "attacker"
    attacker.mkdir(mode=0o777)
    attacker.chmod(0o777)
    if planted == "symlink":
        root.symlink_to(attacker)
        expect = f"*{root} is a symlink; refusing to follow it*"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to plant a directory owned by another user")
        root.mkdir(mode=0o755)
        os.chown(root, NOBODY, NOBODY)
        expect = f"*{root} belongs to uid {NOBODY}, not to you*"
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess(*SIM, timeout=60)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([expect])
    assert list(attacker.iterdir()) == []
    if planted != "symlink":
        assert list(root.iterdir()) == []


@pytest.mark.parametrize(
    ("mode", "owner", "shared_ok", "refused"),
    [
        (0o700, "me", False, None),
        (0o700, "nobody", False, "belongs to uid 65534, not to you"),
        (0o755, "nobody", True, "belongs to uid 65534, not to you"),  # a shared lock dir: sticky or root's
        (0o1777, "nobody", True, "belongs to uid 65534, not to you"),  # sticky binds all but the dir's owner
        (0o1777, "root", True, None),  # the how-to's: install -d -m 1777 as root
        (0o755, "root", True, None if os.geteuid() == 0 else "is not writable"),
        (0o1777, "nobody", False, "belongs to uid 65534"),
        (0o777, "me", False, "is writable by other users (mode 777)"),
        (0o777, "me", True, "is writable by other users (mode 777)"),  # no sticky bit
        (0o775, "me", True, "is writable by other users (mode 775)"),
        (0o1777, "me", False, "is writable by other users (mode 1777)"),  # a log dir is never shared
        (0o1777, "me", True, None),
    ],
)
def test_directory_ownership_and_mode(tmp_path: Path, mode: int, owner: str, shared_ok: bool,
                                      refused: str | None) -> None:
    path = tmp_path / "dir"
    path.mkdir()
    path.chmod(mode)
    if owner in ("nobody", "root") and owner != ("root" if os.geteuid() == 0 else ""):
        if os.geteuid() != 0:
            pytest.skip("needs root to give a directory to another user")
        os.chown(path, NOBODY if owner == "nobody" else 0, NOBODY if owner == "nobody" else 0)
    if refused is None:
        assert ensure_private_dir(path, what="lock directory", shared_ok=shared_ok) == path
    else:
        with pytest.raises(UnsafeDirectory, match=refused.replace("(", r"\(").replace(")", r"\)")):
            ensure_private_dir(path, what="lock directory", shared_ok=shared_ok)


def test_dangling_symlink_and_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnsafeDirectory, match="is a symlink; refusing to follow it"):
        ensure_private_dir(tmp_path / "dangling", what="log directory")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeDirectory, match="exists and is not a directory"):
        ensure_private_dir(tmp_path / "file", what="log directory")


def test_shared_sticky_lock_dir_works_end_to_end(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An explicitly named lock dir shared between users (mode 1777) is accepted by leases and port blocks."""
    shared = tmp_path / "shared-locks"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("SGLWORKER_LOCK_DIR", str(shared))
    pytester.makepyfile("def test_x(sgl_worker): assert sgl_worker.client.get('/health').status_code == 200")
    pytester.runpytest_subprocess(*SIM, timeout=60).assert_outcomes(passed=1)
    assert {p.name.split("-")[0] for p in shared.iterdir()} == {"gpu", "port"}


def test_files_the_plugin_creates_are_not_world_writable(pytester: pytest.Pytester, shared_tmp: Path) -> None:
    """Under umask 000: directories 0700, logs 0600, lock files, holder records and the report 0644."""
    pytester.makepyfile("""
        import json, os, stat, tempfile
        from pathlib import Path

        def test_modes(sgl_worker):
            root = Path(tempfile.gettempdir()) / f"pytest-sglworker-{os.getuid()}"
            modes = {str(p.relative_to(root.parent)): stat.S_IMODE(p.lstat().st_mode)
                     for p in [root, *root.rglob("*")]}
            Path("modes.json").write_text(json.dumps(modes))
            assert False, "fails, so that the log is kept"
    """)
    old = os.umask(0)
    try:
        result = pytester.runpytest_subprocess(*SIM, f"--sgl-report={pytester.path / 'report.json'}", timeout=60)
    finally:
        os.umask(old)
    result.assert_outcomes(failed=1)
    modes: dict[str, int] = json.loads((pytester.path / "modes.json").read_text())
    root = f"pytest-sglworker-{os.getuid()}"
    expected = {root: 0o700, f"{root}/logs": 0o700, f"{root}/locks": 0o700,
                f"{root}/logs/session-1": 0o700, f"{root}/logs/current": 0o777}  # the link itself
    for name in modes:
        if name.endswith(".log"):
            expected[name] = 0o600
        elif name.endswith("session-1/.lock"):
            expected[name] = 0o600  # the session directory's own lock: private like its logs
        elif name.endswith((".lock", ".json")):
            expected[name] = 0o644
    assert modes == expected
    assert any(n.endswith(".json") for n in modes) and any(n.endswith(".log") for n in modes)
    (log,) = (shared_tmp / root / "logs" / "current").glob("sglang-worker-*.log")  # kept, still private
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE((pytester.path / "report.json").stat().st_mode) == 0o644


# --------------------------------------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------------------------------------

ECHO_LAUNCHER = """
\"\"\"An engine that prints its environment's secrets, as an engine logging its config would.\"\"\"
import os, runpy, sys

print(f"HF_TOKEN={os.environ.get('HF_TOKEN')} OPENAI_API_KEY={os.environ.get('OPENAI_API_KEY')}", flush=True)
print(f"tokenizers in parallel: {os.environ.get('TOKENIZERS_PARALLELISM')}; cuda graphs disabled: False", flush=True)
sys.argv = ["pytest_sglworker.sim", *sys.argv[1:]]
runpy.run_module("pytest_sglworker.sim", run_name="__main__", alter_sys=True)
"""

SECRETS = ("hf_secret123", "sk-openai-secret789", "sk-live-secret456")


def test_secrets_never_appear_in_what_the_plugin_writes(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret123")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret789")
    monkeypatch.setenv("TEST_API_KEY", "sk-live-secret456")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a *TOKEN*-like name that is no secret
    pytester.makepyfile(echo_launcher=ECHO_LAUNCHER)
    pytester.makepyfile(test_secret=textwrap.dedent("""
        import os
        import pytest

        KEY = os.environ["TEST_API_KEY"]
        AUTH = {"Authorization": "Bearer " + KEY}

        @pytest.mark.sgl_worker(args=["--api-key", KEY])
        def test_router_fails(sgl_worker):
            assert sgl_worker.client.get("/v1/models", headers=AUTH).status_code == 200
            assert False, "router bug"

        @pytest.mark.sgl_worker(args=["--api-key=" + KEY], env={"SGLSIM_FAULT": "crash_oom"})
        def test_startup_crash(sgl_worker):
            pass

        @pytest.mark.sgl_worker(args=["--api-key", KEY], env={"SGLSIM_FAULT": "die_after=1"})
        def test_worker_dies(sgl_worker):
            sgl_worker.client.post("/generate", json={"text": "hi"}, headers=AUTH)
            sgl_worker.process.wait(10)
    """))
    report, junit = pytester.path / "report.json", pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess(
        *SIM, "--sgl-launcher", f"{sys.executable} {pytester.path / 'echo_launcher.py'}", "-rA",
        f"--sgl-report={report}", f"--junitxml={junit}", "test_secret.py", "--sgl-tail-lines", "400", timeout=120,
    )
    result.assert_outcomes(failed=1, passed=1, errors=2)
    written = {"terminal": result.stdout.str() + result.stderr.str(), "report": report.read_text(),
               "junit": junit.read_text()}
    for where, text in written.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} in the {where} output"
    out = written["terminal"]
    # The tails, argv lines and labels are there, redacted.
    assert "HF_TOKEN=*** OPENAI_API_KEY=***" in out
    assert "--api-key ***" in out and "--api-key=***" in out
    assert "characters, cut)" in out  # the engine's long server_args line, its api_key masked, is cut in a tail
    assert "qwen3-0.6b --api-key ***: " in out and "--api-key ***" in written["report"]
    assert "tokenizers in parallel: false; cuda graphs disabled: False" in out  # no over-redaction
    # The engine's own log holds what the engine printed: the plugin cannot redact it (no pipe), so it keeps it
    # private instead.
    logs = list(Path(sim_env["SGLWORKER_LOG_DIR"]).glob("sglang-worker-*.log"))
    assert logs and any("hf_secret123" in log.read_text() for log in logs)
    assert all(stat.S_IMODE(log.stat().st_mode) == 0o600 for log in logs)
    assert stat.S_IMODE(Path(sim_env["SGLWORKER_LOG_DIR"]).stat().st_mode) == 0o700


def test_secret_values() -> None:
    env = {"HF_TOKEN": "hf_abcdef", "OPENAI_API_KEY": "sk-abcdef", "AWS_SECRET_ACCESS_KEY": "aws-abcdef",
           "TOKENIZERS_PARALLELISM": "false", "GITHUB_TOKEN": "true", "SHORT_TOKEN": "abc", "PATH": "/usr/bin",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "ray-abcdef"}  # Ray's mode is none: "tokens" stays readable
    argv = ["--api-key", "key-1234", "--admin-api-key=adm-1234", "--max-total-tokens", "4096", "--hf-token", "hf_9999"]
    assert set(secret_values(env, argv)) == {"hf_abcdef", "sk-abcdef", "aws-abcdef", "key-1234", "adm-1234",
                                             "hf_9999", "ray-abcdef"}


# --------------------------------------------------------------------------------------------------------
# Hostile lock-directory content (issue #12, item 2): one bad holder record must not break this session or the
# next; a lock or record path that is a directory is a clear error that leaves no temporary file
# --------------------------------------------------------------------------------------------------------

HOSTILE = Path(__file__).resolve().parents[1] / "data" / "hostile"
WORKER_TEST = "def test_x(sgl_worker):\n    assert sgl_worker.client.get('/health').status_code == 200\n"


def plant(path: Path, name: str) -> None:
    """The hostile file ``name`` at ``path``, placeholders filled in (tests/data/hostile/README.md)."""
    import socket
    import time

    raw = (HOSTILE / name).read_bytes()
    for key, value in ((b"@PID@", os.getpid()), (b"@HOSTNAME@", socket.gethostname()), (b"@SINCE@", time.time())):
        raw = raw.replace(key, str(value).encode())
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(raw)


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp")) if directory.is_dir() else []


@pytest.mark.parametrize("name", ["record-pid-1e999.json", "record-pid-negative.json", "record-gpus-1e999.json",
                                  "record-nested-20000.json"])
def test_hostile_holder_record_breaks_neither_this_session_nor_the_next(
        pytester: pytest.Pytester, sim_env: dict[str, str], name: str) -> None:
    lock_dir = Path(sim_env["SGLWORKER_LOCK_DIR"])
    plant(lock_dir / "gpu-sim-1x80-0.json", name)
    pytester.makepyfile(WORKER_TEST)
    for session in ("first", "next"):
        result = pytester.runpytest_subprocess(*SIM, "--sgl-lease-timeout", "5", timeout=90)
        out = result.stdout.str() + result.stderr.str()
        assert "INTERNALERROR" not in out and "Traceback" not in out, out
        result.assert_outcomes(passed=1)
        warnings = [line for line in out.splitlines() if "untrusted GPU holder record" in line]
        if session == "first":
            assert len(warnings) == 1, out
            assert f"ignored 1 untrusted GPU holder record(s) in {lock_dir}: gpu-sim-1x80-0.json (" in warnings[0]
            assert warnings[0].endswith("; removed)"), warnings[0]
        else:
            assert warnings == [], out
        assert not (lock_dir / "gpu-sim-1x80-0.json").exists()
    assert _temporaries(lock_dir) == []


@pytest.mark.parametrize("which", ["lock", "json"])
def test_lock_or_record_path_that_is_a_directory_is_a_clear_error(
        pytester: pytest.Pytester, sim_env: dict[str, str], which: str) -> None:
    lock_dir = Path(sim_env["SGLWORKER_LOCK_DIR"])
    lock_dir.mkdir(mode=0o700, parents=True)
    path = lock_dir / f"gpu-sim-1x80-0.{which}"
    path.mkdir()
    pytester.makepyfile(WORKER_TEST)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-lease-timeout", "5", timeout=90)
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out and "IsADirectoryError" not in out, out
    result.assert_outcomes(errors=1)
    what = "GPU lock file" if which == "lock" else "GPU holder record"
    result.stdout.fnmatch_lines([f"*cannot use the {what} {path}: it is a directory; remove it (the lock "
                                 f"directory {lock_dir} holds only files the plugin makes) or choose another "
                                 "--sgl-lock-dir*"])
    assert _temporaries(lock_dir) == [] and path.is_dir()
    log_dir = Path(sim_env["SGLWORKER_LOG_DIR"])
    assert not log_dir.is_dir() or not list(log_dir.glob("*.log")), "nothing may be launched"


# --------------------------------------------------------------------------------------------------------
# Atomic writes (issue #12, item 8): every file the plugin produces is whole or absent, never through a planted
# link, mode exact
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_atomic_write_mode_is_exact_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    from pytest_sglworker.resources.state import atomic_write

    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "a.json", "{}\n")
        atomic_write(tmp_path / "b.json", b"{}", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o600
    assert (tmp_path / "a.json").read_text() == "{}\n" and _temporaries(tmp_path) == []


@pytest.mark.parametrize("planted", ["symlink", "fifo", "directory"])
def test_atomic_write_never_replaces_what_is_not_a_regular_file(tmp_path: Path, planted: str) -> None:
    """A symlink (never followed, never replaced), a FIFO or a device node (``--sgl-report /dev/full`` as root
    would have become a JSON file), a directory: each stays what it is, the write fails with the reason, and no
    temporary file is left."""
    from pytest_sglworker.resources.state import atomic_write

    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "report.json"
    if planted == "symlink":
        target.symlink_to(victim)
    elif planted == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    with pytest.raises(OSError) as info:
        atomic_write(target, "new")
    assert "in the way (only a regular file is ever replaced)" in str(info.value.strerror)
    assert victim.read_text() == "precious" and _temporaries(tmp_path) == []
    kind = os.lstat(target).st_mode
    assert {"symlink": stat.S_ISLNK, "fifo": stat.S_ISFIFO, "directory": stat.S_ISDIR}[planted](kind)


@pytest.mark.parametrize("failure", ["disk full mid-write", "interrupted at fsync"])
def test_atomic_write_failure_keeps_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        failure: str) -> None:
    import errno

    from pytest_sglworker.resources import state

    path = tmp_path / "report.json"
    state.atomic_write(path, "old and whole")
    real_write = os.write

    def full(fd: int, data: bytes | memoryview) -> int:
        if len(data) > 4:
            return real_write(fd, bytes(data[:4]))  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    if failure == "disk full mid-write":
        monkeypatch.setattr(os, "write", full)
        expected: type[BaseException] = OSError
    else:
        monkeypatch.setattr(os, "fsync", interrupted)
        expected = KeyboardInterrupt
    with pytest.raises(expected):
        state.atomic_write(path, "new content that does not fit")
    monkeypatch.undo()
    assert path.read_text() == "old and whole"
    assert _temporaries(tmp_path) == []


def test_holder_records_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record goes through state.atomic_write: a failing write leaves no record, no temporary, no lock."""
    import errno

    from pytest_sglworker.resources import state
    from pytest_sglworker.resources.gpus import DeclaredInventory, LeaseManager

    calls: list[Path] = []
    real = state.atomic_write

    def failing(path: Path | str, data: bytes | str, *, mode: int = 0o644) -> None:
        calls.append(Path(path))
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    manager = LeaseManager(tmp_path, DeclaredInventory(1, 1024), namespace="sim-1x1")
    monkeypatch.setattr(state, "atomic_write", failing)
    with pytest.raises(state.UnusableFile, match=r"cannot write the GPU holder record .*: No space left on device"):
        manager.acquire(1, 10, holder="me", timeout=0)
    assert calls == [manager.record_path(0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-sim-1x1-0.lock"]
    monkeypatch.setattr(state, "atomic_write", real)
    with manager.acquire(1, 10, holder="me", timeout=0) as lease:  # the lock was given back
        assert stat.S_IMODE(manager.record_path(0).stat().st_mode) == 0o644 and lease.indices == (0,)
