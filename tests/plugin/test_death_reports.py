"""A worker that dies under a test reads as a worker death (pytest_sglworker/plugin/deaths.py): pytest's crash line
(the short summary, ``--tb=line``, junitxml's message) is the death's headline, the failure text starts with the
death and its cause, then what the test met in its own frames; pytest's ``--tb`` still rules when given; the same
through xdist, whose controller rebuilds the report from what its worker sent."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:2", "-p", "no:cacheprovider",
       "-p", "no:randomly"]

SUITE = """
import pytest

GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_on_request=1"})
def test_dies_on_the_request(sgl_worker):
    answer = sgl_worker.client.post("/generate", json=GENERATE)
    assert answer.status_code == 200


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_after=1"})
def test_fails_on_its_own(sgl_worker):
    sgl_worker.client.post("/generate", json=GENERATE)
    sgl_worker.process.wait(10)  # it dies right after its answer
    assert False, "an answer the test did not like"
"""

HEADLINE = ("worker qwen3-0.6b exited with code -9 (SIGKILL) during the test: RuntimeError: simulated death on "
            "request 1")


def _failure_text(out: str, test: str) -> list[str]:
    """The lines of one test's failure text (between its ``___ name ___`` header and the next header)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^_+ {test}\[qwen3-0\.6b\] _+$", line))
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^(_{3,} \S|={3,})", lines[i])), len(lines))
    text = lines[start + 1:end]
    return text[1:] if text and re.match(r"^\[gw\d+\] ", text[0]) else text  # xdist names the worker first


@pytest.mark.parametrize("dist", [[], ["-n", "2"]], ids=["no-xdist", "xdist"])
def test_a_death_under_a_test_leads_its_report(pytester: pytest.Pytester, sim_env: dict[str, str],
                                               monkeypatch: pytest.MonkeyPatch, dist: list[str]) -> None:
    """The short summary at 200 columns names the worker, how it ended and the diagnosis; the failure text starts
    with the death (within its first lines: the whole death part, then the test's own frames) and shows no frame of
    httpx or httpcore; the log's tail follows once, in the worker's section."""
    monkeypatch.setenv("COLUMNS", "200")
    pytester.makepyfile(test_deaths=SUITE)
    result = pytester.runpytest_subprocess(*SIM, *dist, "-rf", f"--junitxml={pytester.path}/j.xml",
                                           timeout=120)
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    summary = [line for line in out.splitlines() if line.startswith("FAILED ")]
    dies = next(line for line in summary if "test_dies_on_the_request" in line)
    assert dies.startswith(f"FAILED test_deaths.py::test_dies_on_the_request[qwen3-0.6b] - {HEADLINE}"), dies
    text = _failure_text(out, "test_dies_on_the_request")
    assert text[0].startswith(HEADLINE), text[:3]
    note = next(i for i, line in enumerate(text) if line.startswith("what the test met, in its own frames"))
    assert note < 30, text[:note + 1]
    assert any(line.startswith("E       httpx.RemoteProtocolError: Server disconnected") for line in text[note:]), text
    assert not any("httpcore" in line or "httpx/_" in line for line in text), "library frames shown"
    assert sum(line.startswith("last lines of the log") for line in text) == 1
    assert text.index(next(line for line in text if line.startswith("last lines of the log"))) > note
    # a test that failed on its own after its worker died: the death still leads, the assertion follows
    other = _failure_text(out, "test_fails_on_its_own")
    assert other[0].startswith("worker qwen3-0.6b exited with code -9 (SIGKILL) during the test: RuntimeError: "
                               "simulated death after 1 requests"), other[:3]
    assert any("AssertionError: an answer the test did not like" in line for line in other)
    # junitxml's message is the crash line
    failures = {case.get("name"): case.find("failure") for case in ET.parse(pytester.path / "j.xml").iter("testcase")}
    assert failures["test_dies_on_the_request[qwen3-0.6b]"].get("message", "").startswith(HEADLINE)


@pytest.mark.parametrize("tb", ["short", "native", "line"])
def test_an_explicit_tb_style_still_rules(pytester: pytest.Pytester, sim_env: dict[str, str], tb: str) -> None:
    """``--tb=short`` and ``--tb=native`` show pytest's own traceback (the client library's frames included) after
    the death; ``--tb=line`` shows one line a failure: the death's headline."""
    pytester.makepyfile(test_deaths=SUITE.split("\n\n@pytest.mark.sgl_worker(env={\"SGLSIM_FAULT\": \"die_after")[0])
    result = pytester.runpytest_subprocess(*SIM, f"--tb={tb}", timeout=120)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    if tb == "line":
        assert re.search(rf"^\S+:\d+: {re.escape(HEADLINE)}", out, re.M), out
        return
    text = _failure_text(out, "test_dies_on_the_request")
    assert text[0].startswith(HEADLINE), text[:3]
    met = text.index("what the test met:")
    assert any("httpcore" in line for line in text[met:]), "pytest's own rendering keeps the library frames"
    if tb == "native":
        assert "Traceback (most recent call last):" in text[met:]


def test_a_test_that_killed_its_worker_reads_so(pytester: pytest.Pytester, sim_env: dict[str, str],
                                               tmp_path: Path) -> None:
    """A worker the test killed itself and then could not reach: the report leads with that, not with the
    ConnectError."""
    pytester.makepyfile(test_kill="""
        import os, signal

        def test_kills_then_asks(sgl_worker):
            os.kill(sgl_worker.pid, signal.SIGKILL)
            sgl_worker.process.wait(10)
            sgl_worker.client.get("/health")
    """)
    result = pytester.runpytest_subprocess(*SIM, "-rf", timeout=120)
    result.assert_outcomes(failed=1)
    text = _failure_text(result.stdout.str(), "test_kills_then_asks")
    assert re.match(r"worker qwen3-0\.6b exited with code -9 \(SIGKILL\) during the test: this test killed it "
                    r"\(os\.kill\(\d+, SIGKILL\)\)", text[0]), text[:2]
    assert any(line.startswith("E       httpx.ConnectError") for line in text)


class _Process:
    """A held process as :func:`dead_processes` sees it; it dies once it has been asked ``lives`` times."""

    def __init__(self, port: int, lives: int) -> None:
        self.port, self.lives, self.stopped = port, lives, False

    def is_alive(self) -> bool:
        self.lives -= 1
        return self.lives >= 0


def test_a_closed_connection_waits_for_the_process_it_went_to() -> None:
    """The kernel closes a dying process's sockets before its parent can reap it: a request that met a closed
    connection waits (within a deadline) for the process it went to to be seen dead; another error, or a process
    on another port, is not waited for."""
    import httpx

    from pytest_sglworker.plugin.deaths import dead_processes

    def refused(port: int) -> httpx.ConnectError:
        return httpx.ConnectError("refused", request=httpx.Request("POST", f"http://127.0.0.1:{port}/generate"))

    target, bystander = _Process(30000, lives=5), _Process(30010, lives=10**9)
    assert dead_processes([bystander, target], refused(30000)) == [target]
    assert dead_processes([_Process(30000, lives=5)], AssertionError("no")) == []
    assert dead_processes([_Process(30000, lives=10**9)], refused(30020)) == []
    wrapped = RuntimeError("the client's own error")
    wrapped.__cause__ = refused(30000)  # an SDK's error raised from httpx's (openai's APIConnectionError)
    late = _Process(30000, lives=3)
    assert dead_processes([late], wrapped) == [late]
