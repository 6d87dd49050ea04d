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

from pytest_sglworker.launcher import secret_values
from pytest_sglworker.state import UnsafeDirectory, ensure_private_dir

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
    result = pytester.runpytest_subprocess(*SIM, timeout=120)
    result.assert_outcomes(passed=2, errors=3, failed=2)
    out = result.stdout.str()
    refused = "workers listen on 127.0.0.1 only (opt out with allow_foreign_host=True"
    for host in ("'0.0.0.0'", "'::'", "'10.1.2.3'"):
        assert f"extra args would bind {host}, not loopback; {refused}" in out
    assert out.count("not loopback") >= 5
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
        (0o1777, "nobody", True, None),
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
    if owner == "nobody":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a directory to another user")
        os.chown(path, NOBODY, NOBODY)
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
    expected = {root: 0o700, f"{root}/logs": 0o700, f"{root}/locks": 0o700}
    for name in modes:
        if name.endswith(".log"):
            expected[name] = 0o600
        elif name.endswith((".lock", ".json")):
            expected[name] = 0o644
    assert modes == expected
    assert any(n.endswith(".json") for n in modes) and any(n.endswith(".log") for n in modes)
    (log,) = (shared_tmp / root / "logs").glob("sglang-worker-*.log")  # kept, still private
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE((pytester.path / "report.json").stat().st_mode) == 0o644


# --------------------------------------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------------------------------------

ECHO_LAUNCHER = """
\"\"\"An engine that prints its environment's secrets, as an engine logging its config would.\"\"\"
import os, runpy, sys

print(f"HF_TOKEN={os.environ.get('HF_TOKEN')} OPENAI_API_KEY={os.environ.get('OPENAI_API_KEY')}", flush=True)
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
        f"--sgl-report={report}", f"--junitxml={junit}", "test_secret.py", timeout=120,
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
    assert "'api_key': '***'" in out and "--api-key ***" in out and "--api-key=***" in out
    assert "qwen3-0.6b --api-key ***: " in out and "--api-key ***" in written["report"]
    assert "TOKENIZERS_PARALLELISM" not in out and "'disable_cuda_graph': False" in out  # no over-redaction
    # The engine's own log holds what the engine printed: the plugin cannot redact it (no pipe), so it keeps it
    # private instead.
    logs = list(Path(sim_env["SGLWORKER_LOG_DIR"]).glob("sglang-worker-*.log"))
    assert logs and any("hf_secret123" in log.read_text() for log in logs)
    assert all(stat.S_IMODE(log.stat().st_mode) == 0o600 for log in logs)
    assert stat.S_IMODE(Path(sim_env["SGLWORKER_LOG_DIR"]).stat().st_mode) == 0o700


def test_secret_values() -> None:
    env = {"HF_TOKEN": "hf_abcdef", "OPENAI_API_KEY": "sk-abcdef", "AWS_SECRET_ACCESS_KEY": "aws-abcdef",
           "TOKENIZERS_PARALLELISM": "false", "GITHUB_TOKEN": "true", "SHORT_TOKEN": "abc", "PATH": "/usr/bin"}
    argv = ["--api-key", "key-1234", "--admin-api-key=adm-1234", "--max-total-tokens", "4096", "--hf-token", "hf_9999"]
    assert set(secret_values(env, argv)) == {"hf_abcdef", "sk-abcdef", "aws-abcdef", "key-1234", "adm-1234",
                                             "hf_9999"}
