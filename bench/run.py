#!/usr/bin/env python
"""Benchmark of pytest-sglworker (issue 6): ratios measured side by side in one run.

Run by hand from the repository root::

    .venv/bin/python bench/run.py            # full run, about 5 minutes
    .venv/bin/python bench/run.py --quick    # about 1 minute, smaller samples
    .venv/bin/python bench/run.py --json figures.json --only readiness,overhead

Every figure is relative to a baseline measured in the same run (no absolute thresholds): the machine is
small and noisy, so absolute seconds mean little from one run to the next, while a ratio of two things
measured a minute apart under the same load does. What each figure means: bench/README.md.

Parts:

1. ``readiness``: from the moment the simulated engine is ready (the wall time of its ``SGLSIM_RECORD``
   ``ready`` event) to the moment the wait for it returns: ``spawn_worker`` (ours) against
   re-implementations of the peers' polling habits, each launching the same simulated engine with the same
   startup time.
2. ``reuse``: launches and wall time of an example e2e suite (bench/suites/e2e) with ``--sgl-reuse off``
   against the default pool.
3. ``xdist``: the same suite with ``-n 1`` against ``-n 4 --sgl-gpus sim:4`` (``--dist load`` and
   ``--dist loadgroup``).
4. ``overhead``: the plugin loaded but unused: ``pytest --collect-only -q`` of a few thousand trivial tests
   with and without ``-p no:sglworker``, and the import time of ``pytest_sglworker.plugin`` against the import
   of ``pytest`` itself.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
E2E_SUITE = REPO / "bench" / "suites" / "e2e"
PARTS = ("readiness", "reuse", "xdist", "overhead")

#: Variables that would change what is measured: dropped from every measured process.
_DROPPED_ENV = ("PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
_DROPPED_PREFIXES = ("SGLWORKER_", "SGLSIM_")

SGLANG_INTERVAL = 10.0  # sglang test_utils.popen_launch_server: time.sleep(10) between /health_generate polls
VLLM_INTERVAL = 0.5  # vLLM tests/utils.py RemoteOpenAIServer: time.sleep(0.5) after a failed GET /health


# ---------------------------------------------------------------------------------------------- plumbing


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--quick`` shrinks them)."""

    quick: bool
    ready_startup: float  # simulated startup of the readiness launches
    ready_reps: int  # launches per method and mode
    sglang_reps: int  # launches with the real 10 s interval (0: analytical only)
    suite_startup: float  # simulated startup of the e2e suite's workers
    suite_per_set: int  # tests per argument set and model (x 3 sets x 2 models)
    pooled_reps: int
    off_reps: int
    xdist_reps: int
    loadgroup: bool  # also measure -n 4 --dist loadgroup
    collect_files: int
    collect_per_file: int
    collect_reps: int
    import_reps: int


FULL = Plan(quick=False, ready_startup=1.0, ready_reps=5, sglang_reps=3, suite_startup=1.0, suite_per_set=10,
            pooled_reps=3, off_reps=1, xdist_reps=2, loadgroup=True, collect_files=30, collect_per_file=100,
            collect_reps=7, import_reps=15)
QUICK = Plan(quick=True, ready_startup=0.3, ready_reps=3, sglang_reps=0, suite_startup=0.2, suite_per_set=3,
             pooled_reps=1, off_reps=1, xdist_reps=1, loadgroup=False, collect_files=10, collect_per_file=100,
             collect_reps=3, import_reps=7)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a measured process: bytecode caching on (as users have it), no plugin settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in _DROPPED_ENV and not k.startswith(_DROPPED_PREFIXES)}
    env.update(extra)
    return env


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 10:
        return f"{value:.1f} s"
    if abs(value) >= 1:
        return f"{value:.2f} s"
    return f"{value * 1000:.0f} ms"


def fmt_x(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0.1:
        return f"{value:.3f}x"
    return f"{value:.0f}x" if value >= 100 else f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def say(text: str = "") -> None:
    print(text, flush=True)


def progress(text: str) -> None:
    sys.stderr.write(f"  .. {text}\n")
    sys.stderr.flush()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(port: int, path: str, timeout: float = 5.0) -> int:
    """One GET on a new connection (like ``requests.get``); OSError when nothing listens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def count_health_requests(log_path: Path) -> int:
    """Health requests the engine answered (the simulated engine logs every request, uvicorn-style)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return 0
    return len(re.findall(r'"GET /health(?:_generate)? HTTP', text))


def warm_bytecode() -> None:
    """Import everything the measured processes import once, with bytecode caching on, so that every
    measured process finds its .pyc files (the environment of this session may disable them)."""
    code = ("import pytest, xdist, httpx, psutil, filelock, pytest_sglworker.plugin, pytest_sglworker.launcher, "
            "pytest_sglworker.pool, pytest_sglworker.gpus, pytest_sglworker.ports, pytest_sglworker.reaper, "
            "pytest_sglworker.sim, pytest_sglworker.state\n"
            "for name in ('diagnosis', 'ledger'):\n"
            "    try: __import__('pytest_sglworker.' + name)\n"
            "    except ImportError: pass\n")
    subprocess.run([sys.executable, "-c", code], env=clean_env(), check=True, cwd=REPO)


# ---------------------------------------------------------------------------------------------- 1. readiness


@dataclass
class Launch:
    method: str
    mode: str
    startup: float
    called_at: float  # wall time the launch was asked for
    started_at: float | None  # the engine's "start" event
    ready_at: float | None  # the engine's "ready" event
    returned_at: float  # wall time the wait returned
    health_requests: int
    teardown_seconds: float
    error: str | None = None

    @property
    def latency(self) -> float | None:
        return None if self.ready_at is None else self.returned_at - self.ready_at

    @property
    def launch_overhead(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.called_at


def sim_argv(port: int, mode_args: Sequence[str]) -> list[str]:
    from pytest_sglworker import CI_WORKER_ARGS

    return [sys.executable, "-m", "pytest_sglworker.sim", "--model-path", "bench/model-a", "--host", "127.0.0.1",
            "--port", str(port), "--tp-size", "1", *CI_WORKER_ARGS, *mode_args]


def launch_ours(workdir: Path, mode: str, mode_args: Sequence[str], startup: float) -> Launch:
    from pytest_sglworker import ModelSpec, SglWorkerError
    from pytest_sglworker.launcher import LaunchOptions, sim_launcher, spawn_worker

    record = Path(tempfile.mktemp(prefix="rec-", suffix=".jsonl", dir=workdir))
    options = LaunchOptions(launcher=tuple(sim_launcher()), log_dir=workdir / "logs", lock_dir=workdir / "locks",
                            startup_timeout=120.0)
    spec = ModelSpec(name="bench-a", model="bench/model-a", memory_gb=4)
    env = {"SGLSIM_RECORD": str(record), "SGLSIM_STARTUP_SECONDS": str(startup)}
    called = time.time()
    try:
        worker = spawn_worker(spec, extra_args=mode_args, env=env, options=options)
    except SglWorkerError as exc:
        launch = _launch_from_record("ours", mode, startup, called, time.time(), record, 0, 0.0)
        launch.error = str(exc).splitlines()[0]
        return launch
    returned = time.time()
    t0 = time.perf_counter()
    worker.stop()
    teardown = time.perf_counter() - t0
    polls = count_health_requests(worker.log_path)
    worker.remove_log()
    return _launch_from_record("ours", mode, startup, called, returned, record, polls, teardown)


def launch_peer(workdir: Path, method: str, mode: str, mode_args: Sequence[str], startup: float,
                interval: float) -> Launch:
    """Popen the same engine and wait the way the peer does; then tear it down (SIGTERM, wait)."""
    port = free_port()
    record = Path(tempfile.mktemp(prefix="rec-", suffix=".jsonl", dir=workdir))
    log_path = workdir / f"{method}-{port}.log"
    env = clean_env(SGLSIM_RECORD=str(record), SGLSIM_STARTUP_SECONDS=str(startup), PYTHONUNBUFFERED="1")
    called = time.time()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(sim_argv(port, mode_args), stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    error = None
    try:
        if method == "vllm":
            wait_vllm(proc, port, timeout=120.0, interval=interval)
        else:
            wait_sglang(proc, port, timeout=120.0, interval=interval)
    except RuntimeError as exc:
        error = str(exc)
    returned = time.time()
    t0 = time.perf_counter()
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    teardown = time.perf_counter() - t0
    polls = count_health_requests(log_path)
    log_path.unlink(missing_ok=True)
    launch = _launch_from_record(method, mode, startup, called, returned, record, polls, teardown)
    launch.error = error
    return launch


def wait_vllm(proc: subprocess.Popen[bytes], port: int, *, timeout: float, interval: float) -> None:
    """vLLM ``tests/utils.py`` ``RemoteOpenAIServer._wait_for_server``: GET /health; on an exception check
    the child and sleep 0.5 s. As there, a non-200 answer is polled again at once (no sleep)."""
    start = time.time()
    while True:
        try:
            if http_status(port, "/health") == 200:
                break
        except OSError:
            result = proc.poll()
            if result is not None and result != 0:
                raise RuntimeError("Server exited unexpectedly.") from None
            time.sleep(interval)
            if time.time() - start > timeout:
                raise RuntimeError("Server failed to start in time.") from None


def wait_sglang(proc: subprocess.Popen[bytes], port: int, *, timeout: float, interval: float) -> None:
    """sglang ``python/sglang/test/test_utils.py`` ``popen_launch_server``: check the child, GET
    /health_generate, sleep 10 s."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"Server process exited with code {proc.returncode}.")
        try:
            if http_status(port, "/health_generate") == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"Server process exited with code {proc.returncode}.")
        time.sleep(interval)
    raise RuntimeError("Server failed to start in time.")


def _launch_from_record(method: str, mode: str, startup: float, called: float, returned: float, record: Path,
                        polls: int, teardown: float) -> Launch:
    events = read_events(record)
    record.unlink(missing_ok=True)
    started = next((e["time"] for e in events if e.get("event") == "start"), None)
    ready = next((e["time"] for e in events if e.get("event") == "ready"), None)
    return Launch(method, mode, startup, called, started, ready, returned, polls, teardown)


def bench_readiness(plan: Plan, workdir: Path) -> dict[str, Any]:
    modes = {
        # the sim's default: binds at 70 % of the startup, /health* answer 503 during the 30 % warmup, like
        # sglang (which binds before its warmup request)
        "warmup": [],
        # --skip-server-warmup: ready the moment it binds, like vLLM's server (binds only when ready)
        "ready-at-bind": ["--skip-server-warmup"],
    }
    S = plan.ready_startup
    # warm-up launches, not counted (imports, bytecode, page cache)
    launch_ours(workdir, "warmup", [], 0.1)
    launch_peer(workdir, "vllm", "warmup", [], 0.1, VLLM_INTERVAL)
    launches: list[Launch] = []
    retried: list[str] = []

    def measured(what: Callable[[], Launch]) -> Launch:
        """A launch that did not become ready (e.g. killed from outside on a shared machine) is retried once;
        the failure is reported."""
        launch = what()
        if launch.error is None and launch.ready_at is not None:
            return launch
        retried.append(f"{launch.method}/{launch.mode} startup {launch.startup} s: "
                       f"{launch.error or 'no ready event'}")
        return what()

    for mode, mode_args in modes.items():
        for rep in range(plan.ready_reps):
            progress(f"readiness: {mode} {rep + 1}/{plan.ready_reps}")
            order = ["ours", "vllm"] if rep % 2 == 0 else ["vllm", "ours"]
            for method in order:
                if method == "ours":
                    launches.append(measured(functools.partial(launch_ours, workdir, mode, mode_args, S)))
                else:
                    launches.append(measured(functools.partial(
                        launch_peer, workdir, "vllm", mode, mode_args, S, VLLM_INTERVAL)))
    # sglang's 10 s interval, measured for real: startups chosen so that the ready moments fall at
    # (i + 0.5) / n of the poll period; each is paired with a launch of ours with the same startup.
    sglang_startups = [round(SGLANG_INTERVAL * (i + 0.5) / plan.sglang_reps - 0.1, 2)
                       for i in range(plan.sglang_reps)]
    for rep, startup in enumerate(sglang_startups):
        progress(f"readiness: sglang 10 s interval {rep + 1}/{plan.sglang_reps} (startup {startup} s)")
        launches.append(measured(functools.partial(
            launch_peer, workdir, "sglang", "warmup", [], startup, SGLANG_INTERVAL)))
        launches.append(_tag(measured(functools.partial(launch_ours, workdir, "warmup", [], startup)),
                             "ours@sglang-startups"))
    errors = [f"{x.method}/{x.mode}: {x.error} (after a retry)" for x in launches if x.error]

    def pick(method: str, mode: str) -> list[Launch]:
        return [x for x in launches if x.method == method and x.mode == mode and x.latency is not None]

    rows: list[dict[str, Any]] = []
    for mode in modes:
        ours = pick("ours", mode)
        ours_lat = median([x.latency for x in ours])  # type: ignore[misc]
        for method, label in (("ours", "ours: spawn_worker"), ("vllm", "vLLM RemoteOpenAIServer habit")):
            sample = pick(method, mode)
            lat = median([x.latency for x in sample])  # type: ignore[misc]
            rows.append({
                "mode": mode, "method": method, "label": label, "n": len(sample), "startup": S,
                "latency_median": lat, "latency_samples": [round(x.latency, 4) for x in sample],  # type: ignore[arg-type]
                "peer_over_ours": ratio(lat, ours_lat),
                "health_requests_median": median([x.health_requests for x in sample]),
                "launch_overhead_median": median([x.launch_overhead for x in sample]),  # type: ignore[misc]
                "teardown_median": median([x.teardown_seconds for x in sample]),
            })
    ours_warm = next(r for r in rows if r["mode"] == "warmup" and r["method"] == "ours")
    sglang = pick("sglang", "warmup")
    ours_paired = pick("ours@sglang-startups", "warmup")
    paired_lat = median([x.latency for x in ours_paired])  # type: ignore[misc]
    sg_lat = median([x.latency for x in sglang])  # type: ignore[misc]
    # A poll every T seconds, readiness at a moment uncorrelated with the grid: the wait is uniform in
    # [0, T), mean T/2, plus the time of the poll that sees it.
    expected = SGLANG_INTERVAL / 2
    rows.append({
        "mode": "warmup", "method": "sglang", "label": "sglang popen_launch_server habit (10 s)",
        "n": len(sglang), "startup": sglang_startups,
        "latency_median": sg_lat, "latency_samples": [round(x.latency, 4) for x in sglang],  # type: ignore[arg-type]
        "peer_over_ours": ratio(sg_lat, paired_lat),
        "ours_same_startups_median": paired_lat,
        "ours_same_startups_samples": [round(x.latency, 4) for x in ours_paired],  # type: ignore[arg-type]
        "expected_latency_analytical": expected,
        "expected_over_ours": ratio(expected, ours_warm["latency_median"]),
        "health_requests_median": median([x.health_requests for x in sglang]),
        "launch_overhead_median": median([x.launch_overhead for x in sglang]),  # type: ignore[misc]
        "teardown_median": median([x.teardown_seconds for x in sglang]),
    })
    return {"rows": rows, "errors": errors, "retried": retried, "startup": S, "sglang_startups": sglang_startups,
            "launches": [asdict(x) for x in launches]}


def _tag(launch: Launch, method: str) -> Launch:
    launch.method = method
    return launch


# ---------------------------------------------------------------------------------------------- 2./3. suites


@dataclass
class SuiteRun:
    label: str
    args: list[str]
    wall: float
    rc: int
    passed: int
    failed: int
    launches: int
    reuses: int
    startup_median: float | None
    gpu_seconds: float
    tail: str = field(default="", repr=False)


def run_suite(plan: Plan, workdir: Path, label: str, args: Sequence[str]) -> SuiteRun:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=workdir))
    report = run_dir / "report.json"
    cmd = [sys.executable, "-m", "pytest", str(E2E_SUITE), "-p", "no:cacheprovider",
           "--sgl-engine", "sim", "--sgl-model", "a,b", "--sgl-report", str(report),
           "--sgl-log-dir", str(run_dir / "logs"), "--sgl-lock-dir", str(workdir / "locks"), *args]
    env = clean_env(SGLSIM_STARTUP_SECONDS=str(plan.suite_startup), BENCH_E2E_TESTS_PER_SET=str(plan.suite_per_set))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    out = proc.stdout
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", out)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) (?:failed|error)", out)) else 0
    launches = reuses = 0
    startups: list[float] = []
    gpu_seconds = 0.0
    if report.exists():
        data = json.loads(report.read_text())
        for worker in data.get("workers", {}).values():
            launches += worker["launches"]
            reuses += worker["reuses"]
            startups += worker["startup_seconds"]["samples"]
            gpu_seconds += worker["gpu_seconds"]
    return SuiteRun(label, list(args), wall, proc.returncode, passed, failed, launches, reuses, median(startups),
                    gpu_seconds, "\n".join(out.splitlines()[-15:]))


def _suite_summary(runs: list[SuiteRun]) -> dict[str, Any]:
    return {
        "args": runs[0].args if runs else [],
        "n": len(runs),
        "wall_median": median([r.wall for r in runs]),
        "wall_samples": [round(r.wall, 3) for r in runs],
        "launches": median([r.launches for r in runs]),
        "reuses": median([r.reuses for r in runs]),
        "passed": median([r.passed for r in runs]),
        "startup_median": median([r.startup_median for r in runs if r.startup_median is not None]),
        "gpu_seconds": median([r.gpu_seconds for r in runs]),
        "ok": all(r.rc == 0 for r in runs),
    }


def bench_suites(plan: Plan, workdir: Path, parts: set[str]) -> dict[str, Any]:
    variants: dict[str, list[str]] = {}
    reps: dict[str, int] = {}
    if "reuse" in parts:
        variants["pooled"] = []
        reps["pooled"] = plan.pooled_reps
        variants["reuse-off"] = ["--sgl-reuse", "off"]
        reps["reuse-off"] = plan.off_reps
    if "xdist" in parts:
        gpus = ["--sgl-gpus", "sim:4"]
        variants["n1"] = ["-n", "1", *gpus]
        variants["n4"] = ["-n", "4", *gpus]
        if plan.loadgroup:
            variants["n4-loadgroup"] = ["-n", "4", *gpus, "--dist", "loadgroup"]
        for key in ("n1", "n4", "n4-loadgroup"):
            if key in variants:
                reps[key] = plan.xdist_reps
    runs: dict[str, list[SuiteRun]] = {k: [] for k in variants}
    # round robin over the variants, so that a burst of load hits all of them alike
    for rep in range(max(reps.values(), default=0)):
        for key, args in variants.items():
            if rep < reps[key]:
                progress(f"suite: {key} {rep + 1}/{reps[key]}")
                run = run_suite(plan, workdir, key, args)
                if run.rc != 0:
                    progress(f"suite {key} exited {run.rc}:\n{run.tail}")
                runs[key].append(run)
    summary = {key: _suite_summary(value) for key, value in runs.items()}
    result: dict[str, Any] = {"variants": summary, "startup": plan.suite_startup,
                              "tests": plan.suite_per_set * 3 * 2, "configurations": 6}
    if "pooled" in summary:
        result["reuse_off_over_pooled_wall"] = ratio(summary["reuse-off"]["wall_median"],
                                                     summary["pooled"]["wall_median"])
        result["reuse_off_over_pooled_launches"] = ratio(summary["reuse-off"]["launches"],
                                                         summary["pooled"]["launches"])
    if "n1" in summary:
        result["n1_over_n4_wall"] = ratio(summary["n1"]["wall_median"], summary["n4"]["wall_median"])
        if "n4-loadgroup" in summary:
            result["n1_over_n4_loadgroup_wall"] = ratio(summary["n1"]["wall_median"],
                                                        summary["n4-loadgroup"]["wall_median"])
    return result


# ---------------------------------------------------------------------------------------------- 4. overhead


def make_trivial_suite(root: Path, files: int, per_file: int) -> int:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    for f in range(files):
        body = "".join(f"def test_{i}():\n    assert {i} == {i}\n\n\n" for i in range(per_file))
        (root / f"test_trivial_{f:03d}.py").write_text(body)
    return files * per_file


def _timed(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def _timed_cpu(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall time and CPU time (user + sys) of one child process: CPU time is less sensitive than wall time
    to other load on a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, _ = _timed(cmd, env, cwd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def bench_overhead(plan: Plan, workdir: Path) -> dict[str, Any]:
    root = workdir / "trivial"
    count = make_trivial_suite(root, plan.collect_files, plan.collect_per_file)
    env = clean_env()
    base = [sys.executable, "-m", "pytest", "--collect-only", "-q", str(root)]
    variants = {"with plugin": base, "without (-p no:sglworker)": [*base, "-p", "no:sglworker"]}
    for cmd in variants.values():  # warm: bytecode of pytest, the plugin and the rewritten test modules
        _, proc = _timed(cmd, env, root)
        if f"{count} tests collected" not in proc.stdout:
            raise RuntimeError(f"collect-only did not collect {count} tests:\n{proc.stdout[-2000:]}\n{proc.stderr}")
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(plan.collect_reps):
        progress(f"overhead: collect-only {rep + 1}/{plan.collect_reps}")
        keys = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for key in keys:
            wall, cpu_s = _timed_cpu(variants[key], env, root)
            times[key].append(wall)
            cpu[key].append(cpu_s)
    with_p = median(times["with plugin"])
    without = median(times["without (-p no:sglworker)"])
    with_cpu = median(cpu["with plugin"])
    without_cpu = median(cpu["without (-p no:sglworker)"])

    # Import: fresh interpreters; pytest first (the baseline), then the plugin on top of it (what the
    # entry point costs a pytest run that has pytest imported already).
    code = ("import time; t0 = time.perf_counter(); import pytest; t1 = time.perf_counter(); "
            "import pytest_sglworker.plugin; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")
    interp_code = "pass"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    pytest_t: list[float] = []
    plugin_t: list[float] = []
    interp_t: list[float] = []
    for _ in range(plan.import_reps):
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.PIPE,
                             text=True).stdout.split()
        pytest_t.append(float(out[0]))
        plugin_t.append(float(out[1]))
        interp_t.append(_timed([sys.executable, "-c", interp_code], env, REPO)[0])
    breakdown = importtime_breakdown(env)
    breakdown["package_modules_in_unused_run"] = package_modules_in_run(env, root)
    return {
        "tests": count,
        "collect": {
            "with_plugin_median": with_p, "without_plugin_median": without,
            "with_samples": [round(t, 3) for t in times["with plugin"]],
            "without_samples": [round(t, 3) for t in times["without (-p no:sglworker)"]],
            "with_over_without": ratio(with_p, without),
            "added_seconds": None if with_p is None or without is None else with_p - without,
            "cpu_with_median": with_cpu, "cpu_without_median": without_cpu,
            "cpu_with_samples": [round(t, 3) for t in cpu["with plugin"]],
            "cpu_without_samples": [round(t, 3) for t in cpu["without (-p no:sglworker)"]],
            "cpu_with_over_without": ratio(with_cpu, without_cpu),
            "cpu_added_seconds": None if with_cpu is None or without_cpu is None else with_cpu - without_cpu,
        },
        "import": {
            "pytest_median": median(pytest_t), "plugin_after_pytest_median": median(plugin_t),
            "plugin_over_pytest": ratio(median(plugin_t), median(pytest_t)),
            "interpreter_startup_median": median(interp_t),
            **breakdown,
        },
        "bytecode": "PYTHONDONTWRITEBYTECODE unset for the measured processes; cache warmed first",
    }


def package_modules_in_run(env: dict[str, str], root: Path) -> list[dict[str, Any]]:
    """The package's modules that a ``--collect-only`` run using no worker imports (``-X importtime``)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pytest", "--collect-only", "-q", str(root)],
                          env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(pytest_sglworker\S*)$", line)
        if m:
            found.append({"module": m.group(3), "self_us": int(m.group(1)), "cumulative_us": int(m.group(2))})
    return found


def importtime_breakdown(env: dict[str, str]) -> dict[str, Any]:
    """``python -X importtime``: what importing the plugin after pytest pulls in, slowest first."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pytest; import pytest_sglworker.plugin"],
                          env=env, capture_output=True, text=True, check=True)
    lines = proc.stderr.splitlines()
    # the block after the top-level 'pytest' line belongs to the plugin import
    start = next((i for i, line in enumerate(lines) if re.match(r"import time:\s+\d+ \|\s+\d+ \| pytest$", line)), 0)
    modules: list[tuple[str, int, int]] = []
    for line in lines[start + 1:]:
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$", line)
        if m:
            modules.append((m.group(4), int(m.group(1)), int(m.group(2))))
    top = next((cum for name, _, cum in modules if name == "pytest_sglworker.plugin"), None)
    slowest = sorted(modules, key=lambda x: -x[1])[:6]
    third_party = sorted({name.split(".")[0] for name, _, _ in modules
                          if name.split(".")[0] in {"httpx", "psutil", "filelock", "pynvml", "sglang", "torch",
                                                    "httpcore", "anyio", "h11", "certifi", "ssl", "xdist"}})
    return {
        "plugin_cumulative_importtime_us": top,
        "modules_imported_by_plugin": len(modules),
        "slowest_self_us": [{"module": n, "self_us": s, "cumulative_us": c} for n, s, c in slowest],
        "heavy_modules_imported": third_party,
    }


# ---------------------------------------------------------------------------------------------- report


def print_report(results: dict[str, Any]) -> None:
    meta = results["meta"]
    say()
    say(f"pytest-sglworker bench  {meta['date']}  ({meta['cpus']} CPUs, load before/after "
        f"{meta['load_before']}/{meta.get('load_after', '?')}{', --quick' if meta['quick'] else ''})")
    say("Every ratio compares two things measured side by side in this run; absolute times are context only.")
    if "readiness" in results:
        r = results["readiness"]
        say()
        say(f"1. readiness latency: engine ready (SGLSIM_RECORD 'ready') -> the wait returns; "
            f"startup {r['startup']} s, median")
        say(f"   {'mode':<14}{'method':<42}{'n':>3}{'median':>10}{'peer/ours':>11}{'health GETs':>13}")
        for row in r["rows"]:
            label = row["label"]
            say(f"   {row['mode']:<14}{label:<42}{row['n']:>3}{fmt_s(row['latency_median']):>10}"
                f"{fmt_x(row['peer_over_ours']):>11}{row['health_requests_median'] or 0:>13.0f}")
            if row["method"] == "sglang":
                startups = "/".join(f"{s:g}" for s in row["startup"]) or "-"
                if row["n"]:
                    say(f"   {'':<14}  real 10 s interval; startups {startups} s put the ready moments at 1/6, "
                        f"3/6, 5/6 of the poll period;")
                    say(f"   {'':<14}  ratio against ours launched with the same startups "
                        f"({fmt_s(row['ours_same_startups_median'])})")
                else:
                    say(f"   {'':<14}  not measured (--quick): see the analytical line")
                say(f"   {'':<14}  analytical, readiness uncorrelated with the 10 s grid: "
                    f"{fmt_s(row['expected_latency_analytical'])} = {fmt_x(row['expected_over_ours'])} ours")
        ours = [x for x in r["rows"] if x["method"] == "ours"]
        vllm = [x for x in r["rows"] if x["method"] == "vllm"]
        if ours and vllm:
            def col(rows: list[dict[str, Any]], key: str) -> str:
                return fmt_s(median([x[key] for x in rows if x[key] is not None]))

            say(f"   launch overhead (call -> engine 'start' event): ours {col(ours, 'launch_overhead_median')} vs "
                f"bare Popen {col(vllm, 'launch_overhead_median')}; teardown: ours stop() "
                f"{col(ours, 'teardown_median')} vs SIGTERM+wait {col(vllm, 'teardown_median')}")
        say("   note: the vLLM habit re-polls at once on a non-200 answer (as vLLM's code does), so against an "
            "engine that answers 503 during warmup it busy-polls")
        for note in r["retried"]:
            say(f"   retried once (not counted): {note}")
        for err in r["errors"]:
            say(f"   ERROR {err}")
    if "suites" in results:
        s = results["suites"]
        v = s["variants"]
        say()
        say(f"2./3. example e2e suite: {s['tests']} tests, 2 models x 3 argument sets = {s['configurations']} "
            f"configurations, simulated startup {s['startup']} s, median wall")
        say(f"   {'variant':<40}{'n':>3}{'wall':>10}{'launches':>10}{'reuses':>8}{'GPU-s':>8}  ok")
        names = {"pooled": "pool (default)", "reuse-off": "--sgl-reuse off", "n1": "-n 1",
                 "n4": "-n 4 --sgl-gpus sim:4", "n4-loadgroup": "-n 4 --sgl-gpus sim:4 --dist loadgroup"}
        for key, row in v.items():
            say(f"   {names[key]:<40}{row['n']:>3}{fmt_s(row['wall_median']):>10}{row['launches'] or 0:>10.0f}"
                f"{row['reuses'] or 0:>8.0f}{row['gpu_seconds'] or 0:>8.1f}  {'yes' if row['ok'] else 'NO'}")
        if "reuse_off_over_pooled_wall" in s:
            say(f"   reuse: --sgl-reuse off / pool: wall {fmt_x(s['reuse_off_over_pooled_wall'])}, "
                f"launches {fmt_x(s['reuse_off_over_pooled_launches'])}")
        if "n1_over_n4_wall" in s:
            loadgroup = (f", --dist loadgroup {fmt_x(s['n1_over_n4_loadgroup_wall'])}"
                         if "n1_over_n4_loadgroup_wall" in s else "")
            say(f"   xdist speedup, -n 1 / -n 4: --dist load {fmt_x(s['n1_over_n4_wall'])}{loadgroup}  (this machine "
                f"has {meta['cpus']} CPUs: 4 xdist workers share them with the engines)")
    if "overhead" in results:
        o = results["overhead"]
        c, i = o["collect"], o["import"]
        say()
        say("4. plugin loaded but unused (bytecode caching on, cache warmed; median)")
        say(f"   pytest --collect-only -q, {o['tests']} trivial tests: with {fmt_s(c['with_plugin_median'])}, "
            f"without {fmt_s(c['without_plugin_median'])} -> {fmt_x(c['with_over_without'])} "
            f"({'+' if (c['added_seconds'] or 0) >= 0 else ''}{fmt_s(c['added_seconds'])}); CPU time "
            f"{fmt_s(c['cpu_with_median'])} vs {fmt_s(c['cpu_without_median'])} -> {fmt_x(c['cpu_with_over_without'])} "
            f"({'+' if (c['cpu_added_seconds'] or 0) >= 0 else ''}{fmt_s(c['cpu_added_seconds'])})")
        say(f"   import pytest_sglworker.plugin after pytest: {fmt_s(i['plugin_after_pytest_median'])} vs import "
            f"pytest {fmt_s(i['pytest_median'])} -> {fmt_x(i['plugin_over_pytest'])} "
            f"(python -c pass: {fmt_s(i['interpreter_startup_median'])})")
        slow = ", ".join(f"{m['module']} {m['self_us'] / 1000:.1f} ms" for m in i["slowest_self_us"][:4])
        say(f"   -X importtime: {i['modules_imported_by_plugin']} modules; slowest self: {slow}; heavy packages "
            f"pulled in: {', '.join(i['heavy_modules_imported']) or 'none'}")
        run_mods = i.get("package_modules_in_unused_run") or []
        say(f"   package modules a run without workers imports: "
            f"{', '.join(m['module'].removeprefix('pytest_sglworker.') for m in run_mods) or '-'} "
            f"(self {sum(m['self_us'] for m in run_mods) / 1000:.1f} ms under -X importtime)")
    say()


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller samples, about a minute")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON to this path")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, reports)")
    ns = parser.parse_args(argv)
    parts = {p.strip() for p in ns.only.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    plan = QUICK if ns.quick else FULL

    # Measured processes, including the engines that spawn_worker starts from this process's environment.
    for key in list(os.environ):
        if key in _DROPPED_ENV or key.startswith(_DROPPED_PREFIXES):
            del os.environ[key]
    sys.dont_write_bytecode = False
    t_start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="sglworker-bench-"))
    results: dict[str, Any] = {"meta": {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
        "quick": plan.quick, "plan": asdict(plan), "parts": sorted(parts),
        "load_before": round(os.getloadavg()[0], 2),
    }}
    try:
        warm_bytecode()
        if "readiness" in parts:
            results["readiness"] = bench_readiness(plan, workdir)
        if parts & {"reuse", "xdist"}:
            results["suites"] = bench_suites(plan, workdir, parts)
        if "overhead" in parts:
            results["overhead"] = bench_overhead(plan, workdir)
    finally:
        if ns.keep:
            progress(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results["meta"]["load_after"] = round(os.getloadavg()[0], 2)
    results["meta"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
    print_report(results)
    say(f"total {results['meta']['total_seconds']:.0f} s")
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        say(f"figures written to {ns.json}")
    bad = [k for k, v in results.get("suites", {}).get("variants", {}).items() if not v["ok"]]
    errors = results.get("readiness", {}).get("errors", [])
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
