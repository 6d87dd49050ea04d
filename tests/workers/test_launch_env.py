"""How every process of the plugin starts (``workers/process.py: start_process``), without an engine: a tiny Python
child reports what it got. Its environment is the one handed down (pytest's per-test variables left out) with the
worker's own on top, ``PYTHONUNBUFFERED=1`` and a fresh owner tag; it runs in a session of its own, stdin closed,
stdout and stderr appended to a private log that never overwrites a kept one. The mutation run's fast tests of
the launch environment (scripts/mutation.py, target ``launch_env``)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.resources.processes import OWNER_ENV, SESSION_ID, is_owner_tag, tag_session
from pytest_sglworker.workers.errors import LaunchError
from pytest_sglworker.workers.process import inherited_environ, start_process, unused_log_path

REPORT = """
import json, os, sys
print(json.dumps({"env": dict(os.environ), "sid": os.getsid(0), "pid": os.getpid(), "stdin": sys.stdin.read(),
                  "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}))
print("to stderr", file=sys.stderr)
"""


def run_child(tmp_path: Path, env: dict[str, str], environ: dict[str, str], **kwargs: Any) -> tuple[dict[str, Any],
                                                                                                    dict[str, Any]]:
    started = start_process([sys.executable, "-c", REPORT], env, tmp_path / "worker-1.log", environ=environ,
                            **kwargs)
    process: subprocess.Popen[bytes] = started["process"]
    try:
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = Path(started["log_path"]).read_text().splitlines()
    return started, {"report": json.loads(lines[0]), "rest": lines[1:]}


def test_environment_handed_down_with_own_env_on_top(tmp_path: Path) -> None:
    environ = {"PATH": os.environ["PATH"], "KEPT": "inherited", "OVERRIDDEN": "inherited",
               "PYTEST_CURRENT_TEST": "tests/x.py::t (call)", "PYTHONUNBUFFERED": "0", OWNER_ENV: "forged",
               "SGLWORKER_TEST_MARK": os.environ["SGLWORKER_TEST_MARK"]}
    started, out = run_child(tmp_path, {"OVERRIDDEN": "own", "OWN": "x"}, environ)
    env = out["report"]["env"]
    env.pop("LC_CTYPE", None)  # Python's own C-locale coercion may add it
    assert env == {"PATH": os.environ["PATH"], "KEPT": "inherited", "OVERRIDDEN": "own", "OWN": "x",
                   "PYTHONUNBUFFERED": "1", OWNER_ENV: started["owner_tag"],
                   "SGLWORKER_TEST_MARK": os.environ["SGLWORKER_TEST_MARK"]}
    assert is_owner_tag(started["owner_tag"]) and tag_session(started["owner_tag"]) == SESSION_ID


def test_a_fresh_tag_per_process_naming_the_session_given(tmp_path: Path) -> None:
    environ = {"PATH": os.environ["PATH"], "SGLWORKER_TEST_MARK": os.environ["SGLWORKER_TEST_MARK"]}
    first, _ = run_child(tmp_path, {}, environ, session_id="4242-abcdef12")
    second, _ = run_child(tmp_path, {}, environ, session_id="4242-abcdef12")
    assert tag_session(first["owner_tag"]) == tag_session(second["owner_tag"]) == "4242-abcdef12"
    assert first["owner_tag"] != second["owner_tag"]


def test_own_session_stdin_closed_both_streams_in_a_private_log(tmp_path: Path) -> None:
    environ = {"PATH": os.environ["PATH"], "SGLWORKER_TEST_MARK": os.environ["SGLWORKER_TEST_MARK"],
               "SGLANG_API_KEY": "sekrit-value"}
    started, out = run_child(tmp_path, {}, environ)
    assert out["report"]["sid"] == out["report"]["pid"]  # the leader of a session of its own
    assert out["report"]["stdin"] == ""
    assert out["rest"] == ["to stderr"]
    assert stat.S_IMODE(os.stat(started["log_path"]).st_mode) == 0o600
    assert started["argv"][0] == sys.executable and started["times"]["started"] > 0
    assert started["secrets"] == ["sekrit-value"]


def test_no_descriptor_of_the_session_is_inherited(tmp_path: Path) -> None:
    """Not even one marked inheritable (a lock handed over by descriptor): a worker holding it would hold the lock."""
    read, write = os.pipe()
    os.set_inheritable(write, True)
    try:
        environ = {"PATH": os.environ["PATH"], "SGLWORKER_TEST_MARK": os.environ["SGLWORKER_TEST_MARK"]}
        _, out = run_child(tmp_path, {}, environ)
    finally:
        os.close(read)
        os.close(write)
    assert write not in out["report"]["fds"]
    assert {0, 1, 2} <= set(out["report"]["fds"])


def test_a_kept_log_is_never_overwritten(tmp_path: Path) -> None:
    kept = tmp_path / "worker-1.log"
    kept.write_text("the kept failure\n")
    (tmp_path / "worker-1-2.log").write_text("another kept one\n")
    environ = {"PATH": os.environ["PATH"], "SGLWORKER_TEST_MARK": os.environ["SGLWORKER_TEST_MARK"]}
    started, _ = run_child(tmp_path, {}, environ)
    assert started["log_path"] == tmp_path / "worker-1-3.log"
    assert kept.read_text() == "the kept failure\n"
    assert (tmp_path / "worker-1-2.log").read_text() == "another kept one\n"
    assert unused_log_path(tmp_path / "fresh.log") == tmp_path / "fresh.log"
    (tmp_path / "once.log").write_text("")
    assert unused_log_path(tmp_path / "once.log") == tmp_path / "once-2.log"


def test_pytest_per_test_variables_are_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_SETTING", "1")
    environ = inherited_environ()
    assert "PYTEST_CURRENT_TEST" in os.environ and "PYTEST_CURRENT_TEST" not in environ
    assert environ["SOME_SETTING"] == "1"


@pytest.mark.parametrize(("argv", "why"), [
    (["/nonexistent/launcher"], "launcher '/nonexistent/launcher' not found; install sglang"),
    (["{here}"], "is not executable"),
])
def test_a_launcher_that_cannot_run_is_a_launch_error(tmp_path: Path, argv: list[str], why: str) -> None:
    argv = [a.format(here=tmp_path) for a in argv]  # a directory: exists, cannot be executed
    with pytest.raises(LaunchError) as info:
        start_process(argv, {}, tmp_path / "w.log", environ={"PATH": os.environ["PATH"]})
    assert why in str(info.value)
    assert info.value.log_path == str(tmp_path / "w.log")


def test_an_unwritable_log_is_a_launch_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        start_process([sys.executable, "-c", "pass"], {}, tmp_path / "missing" / "w.log",
                      environ={"PATH": os.environ["PATH"]})
    assert "cannot write the worker log" in str(info.value) and "--sgl-log-dir" in str(info.value)
