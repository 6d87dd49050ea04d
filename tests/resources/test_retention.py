"""Worker logs kept like pytest keeps tmp_path: session directories under the default root, the last few
kept, and the policy (all, failed, none), in real sessions; under xdist the workers log into the
controller's session directory."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "-p", "no:cacheprovider"]
SUITE = """
def test_passes(sgl_worker):
    pass

def test_fails(sgl_spawn_worker):
    sgl_spawn_worker()
    raise AssertionError("a router bug")
"""


def _logs(root: Path) -> list[Path]:
    return sorted(root.rglob("sglang-worker-*.log"))


@pytest.mark.parametrize(("policy", "kept"), [("all", 2), ("failed", 1), ("none", 0)])
def test_policy(pytester: pytest.Pytester, sim_env: dict[str, str], policy: str, kept: int) -> None:
    pytester.makepyfile(SUITE)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-log-retention-policy", policy, timeout=120)
    result.assert_outcomes(passed=1, failed=1)
    logs = _logs(Path(sim_env["SGLWORKER_LOG_DIR"]))
    assert len(logs) == kept, logs
    if kept:
        result.stdout.fnmatch_lines([f"sglworker: worker logs of this run in *logs (retention policy {policy})"])


def test_keep_logs_overrides_the_policy(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile(SUITE)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-log-retention-policy", "none", "--sgl-keep-logs",
                                           timeout=120)
    result.assert_outcomes(passed=1, failed=1)
    assert len(_logs(Path(sim_env["SGLWORKER_LOG_DIR"]))) == 2
    result.stdout.fnmatch_lines(["*log kept (--sgl-keep-logs): *sglang-worker-*.log (kept 7 days, until *)"])


@pytest.fixture
def default_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default log root of inner sessions (``<TMPDIR>/pytest-sglworker-<uid>/logs``), in a private TMPDIR."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.delenv("SGLWORKER_LOG_DIR", raising=False)
    monkeypatch.setenv("SGLWORKER_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "0.2")
    return tmpdir / f"pytest-sglworker-{os.getuid()}" / "logs"


def test_session_directories_and_retention_count(pytester: pytest.Pytester, default_root: Path) -> None:
    pytester.makepyfile("def test_ok(sgl_worker): pass")
    for _ in range(4):
        pytester.runpytest_subprocess(*SIM, "--sgl-log-retention-count", "2", timeout=120).assert_outcomes(passed=1)
    sessions = sorted(p.name for p in default_root.iterdir() if p.name.startswith("session-"))
    assert sessions == ["session-3", "session-4"]
    assert (default_root / "current").resolve() == (default_root / "session-4").resolve()
    assert _logs(default_root / "session-4")  # policy all: the passing worker's log is there


def test_xdist_workers_log_into_the_controllers_session(pytester: pytest.Pytester, default_root: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("n", range(4))
        @pytest.mark.sgl_worker(fresh=True)
        def test_each(sgl_worker, n):
            pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "--sgl-gpus", "sim:2", timeout=180)
    result.assert_outcomes(passed=4)
    sessions = [p for p in default_root.iterdir() if p.name.startswith("session-")]
    assert len(sessions) == 1, sessions
    assert len(_logs(sessions[0])) == 4


def test_junitxml_carries_the_log_path_and_tail(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    import xml.etree.ElementTree as ET

    pytester.makepyfile("""
        def test_fails(sgl_worker):
            raise AssertionError("a router bug")

        def test_passes(sgl_worker):
            pass
    """)
    # pytest writes captured output into junitxml only with junit_logging; the log path property always
    result = pytester.runpytest_subprocess(*SIM, "--junitxml", "junit.xml", "-o", "junit_logging=system-err",
                                           timeout=120)
    result.assert_outcomes(passed=1, failed=1)
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").iter("testcase")}
    failed = cases["test_fails[qwen3-0.6b]"]
    props = {p.get("name"): p.get("value") for p in failed.iter("property")}
    (path,) = [v for k, v in props.items() if k.startswith("sglworker_log_worker_")]
    assert path.endswith(".log") and Path(path).exists()
    err = failed.find("system-err")
    assert err is not None and "The server is fired up and ready to roll!" in (err.text or "")
    assert not list(cases["test_passes[qwen3-0.6b]"].iter("property"))


def test_a_kept_failure_log_outlives_the_sessions_of_other_jobs(pytester: pytest.Pytester, default_root: Path) -> None:
    """A failure log the summary calls kept (``log kept: PATH (kept 7 days, until ...)``) is still there after
    three sessions of other jobs of the same user, started at once with the same log root and the default
    retention count of 3, which removes every other earlier session directory."""
    import subprocess
    import sys

    pytester.makepyfile(SUITE)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-log-retention-policy", "failed", timeout=120)
    result.assert_outcomes(passed=1, failed=1)
    kept = [line.split("log kept: ", 1)[1] for line in result.outlines if "log kept: " in line]
    assert len(kept) == 1, result.outlines
    log, _, words = kept[0].partition(" (")
    assert re.fullmatch(r"kept 7 days, until \d{4}-\d\d-\d\d \d\d:\d\d UTC\)", words), kept
    assert Path(log).is_file() and Path(log).parent.parent == default_root

    other = pytester.mkdir("other_job")
    (other / "test_other.py").write_text("def test_ok(sgl_worker):\n    pass\n")
    # a session of a passing job before them: it keeps no log, the count removes its directory
    result = pytester.runpytest_subprocess(*SIM, str(other), timeout=120)
    result.assert_outcomes(passed=1)
    plain = sorted(p for p in default_root.iterdir() if p.name.startswith("session-"))
    jobs = [subprocess.Popen([sys.executable, "-m", "pytest", *SIM, "--sgl-gpus", "sim:3", str(other)],
                             cwd=other, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             stdin=subprocess.DEVNULL) for _ in range(3)]
    for job in jobs:
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, out[-3000:]
    sessions = sorted(p.name for p in default_root.iterdir() if p.name.startswith("session-"))
    assert len(sessions) == 4 and plain[-1].name not in sessions, sessions  # the count removed the passing job's
    assert Path(log).is_file(), sessions


def test_a_kept_mark_lasts_its_days(tmp_path: Path) -> None:
    """After KEEP_DAYS the marked directory counts again and goes like any other."""
    from pytest_sglworker.resources import retention

    root = tmp_path / "logs"
    first = retention.make_session_dir(root, 1)
    until = retention.mark_kept(first.path)
    assert until == pytest.approx(os.stat(first.path / ".kept").st_mtime + retention.KEEP_SECONDS)
    first.release()
    second = retention.make_session_dir(root, 1)
    second.release()
    assert first.path.is_dir()  # marked: the count of 1 does not remove it
    old = time.time() - retention.KEEP_SECONDS - 1
    os.utime(first.path / ".kept", (old, old))
    retention.make_session_dir(root, 1).release()
    assert not first.path.exists() and not second.path.exists()


def test_the_docs_say_how_long_a_kept_log_stays() -> None:
    from pytest_sglworker.plugin.options import RETENTION_COUNT_DESC
    from pytest_sglworker.resources.retention import KEEP_DAYS

    repo = Path(__file__).resolve().parents[2]
    assert f"for {KEEP_DAYS} days" in RETENTION_COUNT_DESC
    assert f"kept {KEEP_DAYS} days, until" in (repo / "docs" / "explanation" / "failures.md").read_text()
