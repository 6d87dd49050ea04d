"""A Ctrl-C during a worker's startup: the summary counts the launch it interrupted (``1 interrupted while
starting``) instead of a line of zeros ("0 launched ... 0 failed to start") that leaves it out; the run report
carries the count."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from session_helpers import Session

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1", "-p", "no:cacheprovider"]


def test_a_launch_interrupted_by_ctrl_c_is_counted(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_STARTUP_SECONDS": "60"})
        def test_slow_start(sgl_worker):
            raise AssertionError("the worker cannot be ready: Ctrl-C comes during its startup")
    """)
    report = pytester.path / "report.json"
    session = Session(pytester, *SIM, "--sgl-report", str(report))
    log_dir = Path(sim_env["SGLWORKER_LOG_DIR"])
    deadline = time.monotonic() + 60
    while not any("Load weight begin" in log.read_text(errors="replace")
                  for log in log_dir.glob("sglang-worker-*.log")):
        assert session.proc.poll() is None and time.monotonic() < deadline, session.output()
        time.sleep(0.05)
    session.proc.send_signal(signal.SIGINT)
    try:
        assert session.wait(60) == pytest.ExitCode.INTERRUPTED
    finally:
        session.kill()
    out = session.output()
    line = next((line for line in out.splitlines() if line.startswith("qwen3-0.6b") and " launched, " in line), None)
    assert line is not None, out
    assert "0 launched" in line and "0 failed to start" in line and "1 interrupted while starting" in line, line
    (entry,) = json.loads(report.read_text())["workers"].values()
    assert entry["interrupted"] == 1 and entry["launches"] == 0, entry
