"""What the warm-worker tests share (``tests/acceptance/test_warm.py``, ``tests/acceptance/test_lock_dir_trust.py``):
the inner suite (one spec ``w`` on the simulated engine, one test that notes its worker's pid and may wait at a
gate), its sessions, and waits on conditions with deadlines. The ``warm`` fixture ends every warm group a test
made, so the leftover check of ``tests/conftest.py`` holds."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from session_helpers import Session

from pytest_sglworker.resources.warm import stop_warm
from pytest_sglworker.resources.warm_records import WarmRecord, warm_records

SIM = ["--sgl-engine", "sim", "--sgl-gpus", "sim:2", "-p", "no:cacheprovider", "-p", "no:xdist"]

CONFTEST = '''
import os
from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

if os.environ.get("WARM_ACK_TIMEOUT"):  # how long a hand-over waits for a keeper (a frozen one never answers)
    import pytest_sglworker.resources.warm_keeper as keeper
    keeper.ACK_TIMEOUT = float(os.environ["WARM_ACK_TIMEOUT"])

def pytest_sglworker_register_specs(registry):
    extra = tuple(os.environ.get("WARM_EXTRA_ARGS", "").split())
    # the spec sets an engine variable, as the CPU recipe's SGLANG_USE_CPU_ENGINE does: adoption must expect it
    registry.add(ModelSpec(name="w", model=os.environ.get("WARM_MODEL", "Qwen/Qwen3-0.6B"), memory_gb=4, tp=1,
                           worker_args=(*CI_WORKER_ARGS, *extra), env={"SGLANG_WARM_SPEC": "1"}))
    registry.add(ModelSpec(name="other", model="other/model", memory_gb=4, tp=1, worker_args=CI_WORKER_ARGS))
'''

#: one test that writes its worker's pid, and, when ``WARM_GATE`` names a file, waits (bounded) until it exists;
#: ``WARM_FAIL`` makes it fail
TEST = '''
import os, time

def test_uses_a_worker(sgl_worker):
    assert sgl_worker.client.get("/health").status_code == 200
    with open(os.environ.get("WARM_PIDS", "pids.txt"), "a") as fh:
        fh.write(f"{sgl_worker.pid}\\n")
    gate = os.environ.get("WARM_GATE")
    deadline = time.monotonic() + 60
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.environ.get("WARM_FAIL"), "failing on purpose (WARM_FAIL)"
'''


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll until ``predicate()`` is true; the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def lock_dir(sim_env: dict[str, str]) -> Path:
    return Path(sim_env["SGLWORKER_LOCK_DIR"])


def records(sim_env: dict[str, str]) -> list[WarmRecord]:
    return [e.mine for e in warm_records(lock_dir(sim_env)) if e.mine is not None]


def report_of(pytester: pytest.Pytester, name: str) -> dict[str, Any]:
    return json.loads((pytester.path / name).read_text())


def launches(report: dict[str, Any]) -> int:
    return sum(w["launches"] for w in report["workers"].values())


def pids(pytester: pytest.Pytester) -> list[int]:
    path = pytester.path / "pids.txt"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def run(pytester: pytest.Pytester, name: str, *args: str, passed: int = 1) -> tuple[pytest.RunResult, dict[str, Any]]:
    """One inner session of the test file, its run report in ``<name>.json``."""
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "w", "--sgl-report", f"{name}.json", *args,
                                           timeout=120)
    out = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in out and "INTERNALERROR" not in out, out
    result.assert_outcomes(passed=passed)
    return result, report_of(pytester, f"{name}.json")


@pytest.fixture
def warm(pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The inner suite; at the end, every warm group of the lock directory ended (and its processes gone)."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("SGLWORKER_KEEP_WARM", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_warm=TEST)
    yield
    if lock_dir(sim_env).is_dir():
        stop_warm(lock_dir(sim_env))
        wait_for(lambda: not records(sim_env), 30, "the warm groups to end")


def session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> Session:
    """An inner session as a process (to hold it, or to signal it), in the environment ``runpytest_subprocess``
    gives its sessions: pytester puts the test directory first on ``PYTHONPATH``, which is part of a warm worker's
    identity (it decides what the engine imports)."""
    with monkeypatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH", "")])))
        return Session(pytester, *SIM, "--sgl-model", "w", *args)


def keeper_of(record: WarmRecord) -> psutil.Process:
    assert record.keeper is not None
    return psutil.Process(record.keeper.pid)
