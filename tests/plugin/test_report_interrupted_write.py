"""The run report is written atomically: a write that fails half-way (the disk is full, a file-size limit is
reached) leaves the previous report as it was, never a half-written one that a CI step would then parse.

The failure is the kernel's, not a patched function's: the inner session runs under ``RLIMIT_FSIZE`` (with
``SIGXFSZ`` ignored, so that a write past the limit fails with ``EFBIG`` after writing what fits), the limit below
the report's size and above everything else the session writes to a file. A report written in place would be
truncated to the limit."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest

#: bytes a file of the inner session may grow to: the report of SUITE is about three times this
LIMIT = 4096

SUITE = """
import pytest


@pytest.mark.parametrize("i", range(60), ids=lambda i: f"a-test-id-long-enough-to-make-the-report-big-{i}")
def test_many(i):
    pass
"""


def _limited() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an ignored disposition survives the exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.mark.timeout(300)
def test_a_report_write_that_fails_half_way_leaves_the_old_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_many=SUITE)
    report = pytester.path / "report.json"
    old = json.dumps({"schema": "an earlier run's report"}) + "\n"
    report.write_text(old)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist",
         f"--sgl-report={report}"], cwd=pytester.path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=240, preexec_fn=_limited)
    out = proc.stdout + proc.stderr
    assert "60 passed" in out and "INTERNALERROR" not in out and "Traceback" not in out, out
    assert f"ERROR: cannot write the run report to {report}" in out and "File too large" in out, out
    assert report.read_text() == old, "the failed write changed the earlier report (written in place?)"
    assert sorted(p.name for p in pytester.path.iterdir() if p.name.startswith(".report")) == [], \
        "the temporary file of the failed write was left"
    # and the same session without the limit writes it whole
    whole = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist",
         f"--sgl-report={report}"], cwd=pytester.path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=240)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    written = json.loads(report.read_text())
    assert written["outcomes"]["passed"] == 60 and len(report.read_bytes()) > LIMIT
