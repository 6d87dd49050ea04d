"""How every process of the plugin starts (``workers/process.py: start_process``), without an engine: a tiny Python
child reports what it got. Its environment is the one handed down (pytest's per-test variables left out) with the
worker's own on top, ``PYTHONUNBUFFERED=1`` and a fresh owner tag; it runs in a session of its own, stdin closed,
stdout and stderr appended to a private log that never overwrites a kept one. The mutation run's fast tests of
the launch environment (scripts/mutation.py, target ``launch_env``). Last, what the launcher adds for a worker
of several ranks on sglang's CPU engine (``worker_env``: each rank's cores), shown on the simulated engine."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.engine.cpu_engine import CPU_ENGINE_ENV, CPU_RANK_BINDING_VAR, cpu_rank_binding
from pytest_sglworker.engine.specs import ModelSpec
from pytest_sglworker.resources.processes import OWNER_ENV, SESSION_ID, is_owner_tag, tag_session
from pytest_sglworker.workers.errors import LaunchError
from pytest_sglworker.workers.launcher import build_argv, worker_env
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
    # The session named must be a live one (this pytest process): a child tagged with a session whose pid is gone
    # is a leftover, and any session starting beside this one under xdist would rightly end it.
    session = f"{os.getpid()}-abcdef12"
    environ = {"PATH": os.environ["PATH"], "SGLWORKER_TEST_MARK": os.environ["SGLWORKER_TEST_MARK"]}
    first, _ = run_child(tmp_path, {}, environ, session_id=session)
    second, _ = run_child(tmp_path, {}, environ, session_id=session)
    assert tag_session(first["owner_tag"]) == tag_session(second["owner_tag"]) == session
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


CPU_SPEC = ModelSpec(name="cpu", model="/models/m", memory_gb=1, env=dict(CPU_ENGINE_ENV))
GPU_SPEC = ModelSpec(name="gpu", model="/models/m", memory_gb=1)


@pytest.mark.parametrize(("spec", "extra", "environ", "ranks"), [
    (CPU_SPEC, ("--dp-size", "2"), {}, 2),  # upstream's e2e_two_workers_dp2
    (CPU_SPEC, ("--tp-size", "2"), {}, 2),  # the e2e_grpc clusters' tp_size=2
    (CPU_SPEC, ("--dp-size", "2", "--tp-size", "2"), {}, 4),
    (CPU_SPEC, (), {}, 0),
    (CPU_SPEC, ("--dp-size", "2"), {CPU_RANK_BINDING_VAR: "0|0"}, 0),  # the user's own binding stays
    (GPU_SPEC, ("--dp-size", "2"), {"CUDA_VISIBLE_DEVICES": "0,1"}, 0),
    (GPU_SPEC, ("--dp-size", "2"), dict(CPU_ENGINE_ENV), 2),  # the user's environment runs the CPU engine
])
def test_a_cpu_engine_worker_of_several_ranks_gets_each_ranks_cores(
        spec: ModelSpec, extra: tuple[str, ...], environ: dict[str, str], ranks: int) -> None:
    """sglang's CPU engine refuses more ranks than NUMA nodes unless SGLANG_CPU_OMP_THREADS_BIND names each rank's
    cores: the launcher adds it for such a worker (from the argv it launches), and for no other."""
    argv = build_argv(spec, port=30000, launcher=("python", "-m", "sglang.launch_server"), extra_args=extra)
    env = worker_env(spec, {"CUDA_VISIBLE_DEVICES": ""}, argv=argv, environ=environ)
    assert env == {**spec.env, "CUDA_VISIBLE_DEVICES": "", **cpu_rank_binding(ranks)}
    if ranks:
        assert len(env[CPU_RANK_BINDING_VAR].split("|")) == ranks


def test_a_spec_s_own_binding_is_kept() -> None:
    spec = ModelSpec(name="cpu", model="/models/m", memory_gb=1, env={**CPU_ENGINE_ENV, CPU_RANK_BINDING_VAR: "1|1"})
    argv = build_argv(spec, port=30000, launcher=("python",), extra_args=("--dp-size", "2"))
    assert worker_env(spec, None, argv=argv, environ={})[CPU_RANK_BINDING_VAR] == "1|1"


def test_the_launched_worker_runs_with_the_binding(tmp_path: Path) -> None:
    """A ``--dp-size 2`` worker of a CPU-engine spec, launched (the simulated engine stands in for sglang): its
    process has the binding in its environment, and the worker is gone after its stop."""
    import psutil

    from pytest_sglworker.workers.launcher import LaunchOptions, sim_launcher, spawn_worker

    spec = ModelSpec(name="cpu", model="Qwen/Qwen3-0.6B", memory_gb=1, env=dict(CPU_ENGINE_ENV))
    options = LaunchOptions(launcher=tuple(sim_launcher()), log_dir=tmp_path / "logs", lock_dir=tmp_path / "locks",
                            startup_timeout=60)
    with spawn_worker(spec, extra_args=("--dp-size", "2"), options=options,
                      env={"SGLSIM_STARTUP_SECONDS": "0.1"}) as worker:
        pid = worker.pid
        assert psutil.Process(pid).environ()[CPU_RANK_BINDING_VAR] == cpu_rank_binding(2)[CPU_RANK_BINDING_VAR]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
