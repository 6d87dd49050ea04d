#!/usr/bin/env python
"""Benchmark of pytest-sglworker (issues 6 and 16): ratios measured side by side in one run.

Run by hand from the repository root::

    .venv/bin/python bench/run.py                  # full run: the README's figures, about 20 minutes on 2 CPUs
    .venv/bin/python bench/run.py --quick          # about 4 minutes, smaller samples: NOT the README's figures
    .venv/bin/python bench/run.py --only readiness,overhead --json figures.json
    .venv/bin/python bench/run.py --only soak      # bench/soak.py, plain and --hostile, about 3 minutes

Every figure is a ratio against a baseline measured in the same run, baseline and candidate interleaved (a
burst of load hits both alike), with the range of the per-round ratios as its spread. stdout gets two markdown
sections, exactly as they are meant to be pasted: the README's ``## Speed`` section and bench/README.md's
``## Latest figures``; progress goes to stderr. What each figure means: bench/README.md.

Parts (``--only``; all of them by default):

- ``readiness``: from the moment the simulated engine is ready (its ``SGLSIM_RECORD`` ``ready`` event) to the
  moment the wait returns: ours as committed (ready-line watch + one probe), ours with the line watch off (the
  plain polling it falls back to), ours before the fixes of bench/previous.py, and the peers' habits (vLLM's
  ``RemoteOpenAIServer``, sglang's ``popen_launch_server``), for an engine that warms up (503 until ready) and
  one that is ready when it binds.
- ``real``: the same latency after the real sglang's ready line (CPU build, tiny model; needs
  ``scripts/install-real-engine.sh``), ours against the probe it replaced, and what each health endpoint costs.
- ``reuse``: an e2e suite of 6 worker configurations, the pool against ``--sgl-reuse off``; then a 2-worker regular
  group and a 1+1 prefill/decode group, each over 20 tests, pooled against ``--sgl-reuse off``.
- ``xdist``: the same suite under ``-n 4`` (``--dist load``, ``--dist loadgroup``, the plugin's scheduler) against
  ``-n 1``.
- ``ahead``: the same suite with a startup long next to its tests on 2 GPUs, launch ahead on (the default 1, and
  2) against off.
- ``groups``: how long a 1+1 prefill/decode group and a 4-worker group take against their slowest member's
  startup; the plugin's router against a bare copy of it polled every millisecond.
- ``overhead``: the plugin installed but unused: trivial suites of 300 and 3000 tests with and without
  ``-p no:sglworker``; the import of the plugin against the import of pytest.
- ``soak``: bench/soak.py and bench/soak.py --hostile at their defaults, their summary lines.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import http.client
import itertools
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
SUITES = BENCH / "suites"
PARTS = ("readiness", "real", "reuse", "xdist", "ahead", "groups", "overhead", "soak")
DEFAULT_PARTS = PARTS

#: Variables that would change what is measured: dropped from every measured process.
_DROPPED_ENV = ("PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
_DROPPED_PREFIXES = ("SGLWORKER_", "SGLSIM_")

SGLANG_INTERVAL = 10.0  # sglang test_utils.popen_launch_server: time.sleep(10) between /health_generate polls
VLLM_INTERVAL = 0.5  # vLLM tests/utils.py RemoteOpenAIServer: time.sleep(0.5) after a failed GET /health
READY_GOAL = 0.020  # issue 16: readiness within 20 ms (median) of the engine being ready
AHEAD_GOAL = 0.6  # issue 16: launch ahead on / off <= 0.6
GROUP_GOAL = 1.1  # issue 16: group ready / slowest member's startup <= 1.1
OVERHEAD_GOAL = 1.03  # issue 16: installed but unused / -p no:sglworker <= 1.03


# ---------------------------------------------------------------------------------------------- plumbing


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--quick`` shrinks them)."""

    quick: bool
    ready_startup: float  # simulated startup of the readiness launches
    ready_reps: int  # launches per method and mode
    sglang_reps: int  # launches with the real 10 s interval (0: analytical only)
    real: bool  # launch the real engine (part real)
    reuse_startup: float
    reuse_per_set: int  # tests per argument set and model (x 3 sets x 2 models)
    reuse_reps: int
    reuse_group_tests: int  # tests of each group shape (part reuse)
    xdist_startup: float
    xdist_per_set: int
    xdist_reps: int
    ahead_startup: float
    ahead_per_set: int
    ahead_reps: int
    group_startup: float
    group_reps: int  # groups of each shape launched
    router_reps: int  # routers launched
    overhead_sizes: tuple[int, ...]  # trivial suites (tests)
    overhead_reps: tuple[int, ...]  # runs of each variant, per size
    import_reps: int
    soak_launches: int


FULL = Plan(quick=False, ready_startup=1.0, ready_reps=5, sglang_reps=3, real=True,
            reuse_startup=1.0, reuse_per_set=5, reuse_reps=2, reuse_group_tests=20,
            xdist_startup=1.0, xdist_per_set=10, xdist_reps=2,
            ahead_startup=5.0, ahead_per_set=10, ahead_reps=2,
            group_startup=5.0, group_reps=3, router_reps=4,
            overhead_sizes=(300, 3000), overhead_reps=(11, 15), import_reps=15, soak_launches=300)
QUICK = Plan(quick=True, ready_startup=0.3, ready_reps=2, sglang_reps=0, real=False,
             reuse_startup=0.2, reuse_per_set=2, reuse_reps=1, reuse_group_tests=20,
             xdist_startup=0.2, xdist_per_set=3, xdist_reps=1,
             ahead_startup=1.0, ahead_per_set=3, ahead_reps=1,
             group_startup=1.0, group_reps=1, router_reps=2,
             overhead_sizes=(300, 1000), overhead_reps=(3, 3), import_reps=5, soak_launches=40)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a measured process: bytecode caching on (as users have it), no plugin settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in _DROPPED_ENV and not k.startswith(_DROPPED_PREFIXES)}
    env.update(extra)
    return env


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def spread(pairs: Sequence[tuple[float | None, float | None]]) -> tuple[float, float] | None:
    """The range of the per-round ratios candidate / baseline (rounds are interleaved)."""
    ratios = [r for a, b in pairs if (r := ratio(a, b)) is not None]
    return (min(ratios), max(ratios)) if ratios else None


def fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 10:
        return f"{value:.1f} s"
    if abs(value) >= 1:
        return f"{value:.2f} s"
    if abs(value) >= 0.0095:
        return f"{value * 1000:.0f} ms"
    return f"{value * 1000:.1f} ms"


def fmt_x(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    if value >= 0.095:
        return f"{value:.2f}x"
    if value >= 0.0095:
        return f"{value:.3f}x"
    return f"{value:.4f}x"


def fmt_ratio(value: float | None, rng: tuple[float, float] | None) -> str:
    """``0.53x (0.41-0.88)``: the ratio of the medians, and the range of the per-round ratios."""
    if value is None:
        return "-"
    if rng is None or math.isclose(rng[0], rng[1]):
        return fmt_x(value)
    return f"{fmt_x(value)} ({fmt_x(rng[0]).rstrip('x')}-{fmt_x(rng[1])})"


def fmt_range(values: Sequence[float]) -> str:
    return f"{fmt_s(min(values))}-{fmt_s(max(values))}" if values else "-"


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
    return len(re.findall(r'"GET /(?:health(?:_generate)?|ready) HTTP', text))


def tcp_tables() -> tuple[int, float]:
    """Sockets in the machine's TCP tables, and the seconds one read of both takes (what psutil's
    ``net_connections`` reads on every call)."""
    total = 0
    t0 = time.perf_counter()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            total += max(0, len(fh.read().splitlines()) - 1)
    return total, time.perf_counter() - t0


def warm_bytecode() -> None:
    """Import everything the measured processes import once, with bytecode caching on, so that every
    measured process finds its .pyc files (the environment of this session may disable them)."""
    code = ("import pytest, xdist, httpx, psutil, filelock, pytest_sglworker.plugin, "
            "pytest_sglworker.workers.launcher, pytest_sglworker.workers.pool, pytest_sglworker.resources.gpus, "
            "pytest_sglworker.resources.ports, pytest_sglworker.resources.reaper, pytest_sglworker.sim, "
            "pytest_sglworker.resources.state, pytest_sglworker.workers.router\n"
            "for name in ('diagnosis', 'ledger', 'xdist_scheduling', 'sim_pd'):\n"
            "    try: __import__('pytest_sglworker.' + name)\n"
            "    except ImportError: pass\n")
    subprocess.run([sys.executable, "-c", code], env=clean_env(), check=True, cwd=REPO)


def machine() -> dict[str, Any]:
    """What the figures ran on: CPU model, cores, memory, Python, the commit and what differs from it."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024)
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    # what the measured code (the package, the bench) has that the commit has not; not the figures' JSON
    # (bench/results/, bench/bound.json), which bench/all.py writes while the later benchmarks run
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "pytest_sglworker", "bench").splitlines()
             if len(line) > 3 and not line[3:].endswith((".pyc", "/", ".json"))]
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": mem_gib, "python": platform.python_version(),
            "platform": platform.platform(), "commit": git("rev-parse", "--short=7", "HEAD").strip() or "unknown",
            "dirty": dirty}


def add_render_option(parser: argparse.ArgumentParser) -> None:
    """``--render JSON``, the same in every bench script: measure nothing, print the section(s) again from a JSON
    file the script wrote with ``--json`` (:func:`print_rendered`)."""
    parser.add_argument("--render", type=Path, default=None, metavar="JSON",
                        help="measure nothing: print the section(s) again from an earlier --json file")


def print_rendered(path: Path, render: Callable[[dict[str, Any]], str]) -> int:
    """What ``--render`` does: the section(s) ``render`` makes of the JSON at ``path``, on stdout; exit status 0."""
    sys.stdout.write(render(json.loads(path.read_text())))
    return 0


def start_meta(argv: Sequence[str]) -> dict[str, Any]:
    """The provenance every benchmark's JSON carries, as its run begins: the date, the machine (``machine()``: the
    commit and what differs from it), the settings (the script's command line) and the load average before."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "argv": shlex.join(argv), "load_before": round(os.getloadavg()[0], 2)}


def finish_meta(meta: dict[str, Any], seconds: float) -> None:
    """The rest of it, as the run ends: the load average after and the run's duration."""
    meta["load_after"] = round(os.getloadavg()[0], 2)
    meta["total_seconds"] = round(seconds, 1)


def provenance_line(meta: dict[str, Any], script: str) -> str:
    """The line under every rendered section that says where its figures ran (``start_meta``, ``finish_meta``)."""
    return where_and_when(meta, f"`{script}{' ' + meta['argv'] if meta['argv'] else ''}`")


def where_and_when(meta: dict[str, Any], settings: str) -> str:
    m = meta["machine"]
    commit = f"commit `{m['commit']}`"
    if m["dirty"]:
        commit += f" plus uncommitted changes in {', '.join(f'`{p}`' for p in m['dirty'])}"
    return (f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']}; {commit}; {settings}; "
            f"{meta['date']}, {meta['total_seconds']:.0f} s, load average {meta['load_before']} before, "
            f"{meta['load_after']} after.")


# ---------------------------------------------------------------------------------------------- 1. readiness


@dataclass
class Launch:
    method: str
    mode: str
    startup: float
    rnd: int  # the round it ran in (interleaved: every method once per round)
    called_at: float  # wall time the launch was asked for
    started_at: float | None  # the engine's "start" event
    ready_at: float | None  # the engine's "ready" event
    returned_at: float  # wall time the wait returned
    health_requests: int
    teardown_seconds: float
    own_check_seconds: float | None = None  # the last (successful) ownership check, ours only
    tcp_sockets: int | None = None  # sockets in the TCP tables when the wait returned
    tcp_read_seconds: float | None = None  # one read of both tables then
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


@contextlib.contextmanager
def ours_variant(variant: str) -> Iterator[tuple[Any, list[float]]]:
    """The plugin's readiness as committed (``ours``), with the line watch off (``ours-poll``: the plain
    polling it falls back to), or as before the fixes of bench/previous.py (``previous``). Yields the worker kind to
    pass to ``spawn_worker`` and a list that receives the duration of every ownership check."""
    from previous import PreviousWorker, previous_owns_port

    import pytest_sglworker.workers.launcher as launcher_mod

    kind = None
    with contextlib.ExitStack() as stack:
        if variant == "ours-poll":
            original_wait = launcher_mod.wait_until_ready
            launcher_mod.wait_until_ready = functools.partial(original_wait, ready_line=None)  # type: ignore[assignment]
            stack.callback(setattr, launcher_mod, "wait_until_ready", original_wait)
        elif variant == "previous":
            stack.enter_context(previous_owns_port())
            kind = PreviousWorker()
        checks: list[float] = []
        owns = launcher_mod.ModelInstance.owns_port

        def timed_owns_port(self: Any) -> bool:
            t0 = time.perf_counter()
            try:
                return bool(owns(self))
            finally:
                checks.append(time.perf_counter() - t0)

        launcher_mod.ModelInstance.owns_port = timed_owns_port  # type: ignore[method-assign]
        stack.callback(setattr, launcher_mod.ModelInstance, "owns_port", owns)
        yield kind, checks


def launch_ours(workdir: Path, variant: str, mode: str, mode_args: Sequence[str], startup: float,
                rnd: int = 0) -> Launch:
    from pytest_sglworker import ModelSpec, SglWorkerError
    from pytest_sglworker.workers.launcher import LaunchOptions, sim_launcher, spawn_worker

    record = Path(tempfile.mktemp(prefix="rec-", suffix=".jsonl", dir=workdir))
    options = LaunchOptions(launcher=tuple(sim_launcher()), log_dir=workdir / "logs", lock_dir=workdir / "locks",
                            startup_timeout=120.0)
    spec = ModelSpec(name="bench-a", model="bench/model-a", memory_gb=4)
    env = {"SGLSIM_RECORD": str(record), "SGLSIM_STARTUP_SECONDS": str(startup)}
    with ours_variant(variant) as (kind, checks):
        called = time.time()
        try:
            worker = spawn_worker(spec, extra_args=mode_args, env=env, options=options, kind=kind)
        except SglWorkerError as exc:
            launch = _launch_from_record(variant, mode, startup, rnd, called, time.time(), record, 0, 0.0)
            launch.error = str(exc).splitlines()[0]
            return launch
        returned = time.time()
    sockets, read_seconds = tcp_tables()
    t0 = time.perf_counter()
    worker.stop()
    teardown = time.perf_counter() - t0
    polls = count_health_requests(worker.log_path)
    worker.remove_log()
    launch = _launch_from_record(variant, mode, startup, rnd, called, returned, record, polls, teardown)
    launch.own_check_seconds = checks[-1] if checks else None
    launch.tcp_sockets = sockets
    launch.tcp_read_seconds = read_seconds
    return launch


def launch_peer(workdir: Path, method: str, mode: str, mode_args: Sequence[str], startup: float,
                interval: float, rnd: int = 0) -> Launch:
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
    launch = _launch_from_record(method, mode, startup, rnd, called, returned, record, polls, teardown)
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


def _launch_from_record(method: str, mode: str, startup: float, rnd: int, called: float, returned: float,
                        record: Path, polls: int, teardown: float) -> Launch:
    events = read_events(record)
    record.unlink(missing_ok=True)
    started = next((e["time"] for e in events if e.get("event") == "start"), None)
    ready = next((e["time"] for e in events if e.get("event") == "ready"), None)
    return Launch(method, mode, startup, rnd, called, started, ready, returned, polls, teardown)


READINESS_METHODS = {
    "ours": "ours: `spawn_worker` as committed (ready-line watch, then one probe)",
    "ours-poll": "ours, line watch off (the plain polling it falls back to)",
    "previous": "ours before the fixes (bench/previous.py: psutil's ownership check, `/health_generate`)",
    "vllm": "vLLM `RemoteOpenAIServer` habit",
}
READINESS_MODES = {
    # the sim's default: binds at 70 % of the startup, /health* answer 503 during the 30 % warmup, like
    # sglang (which binds before its warmup request)
    "warmup": [],
    # --skip-server-warmup: ready the moment it binds, like vLLM's server (binds only when ready)
    "ready-at-bind": ["--skip-server-warmup"],
}


def bench_readiness(plan: Plan, workdir: Path) -> dict[str, Any]:
    S = plan.ready_startup
    # warm-up launches, not counted (imports, bytecode, page cache)
    for variant in ("ours", "ours-poll", "previous"):
        launch_ours(workdir, variant, "warmup", [], 0.1)
    launch_peer(workdir, "vllm", "warmup", [], 0.1, VLLM_INTERVAL)
    launches: list[Launch] = []
    retried: list[str] = []

    def measured(what: Callable[[], Launch]) -> Launch:
        """A launch that did not become ready (e.g. killed from outside on a shared machine) is retried once;
        the failure is reported."""
        launch = what()
        if launch.error is None and launch.ready_at is not None:
            return launch
        retried.append(f"{launch.method}/{launch.mode} startup {launch.startup} s: {launch.error or 'no ready event'}")
        return what()

    methods = list(READINESS_METHODS)
    for rnd in range(plan.ready_reps):
        for mode, mode_args in READINESS_MODES.items():
            progress(f"readiness: {mode} round {rnd + 1}/{plan.ready_reps}")
            order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]  # rotated every round
            for method in order:
                if method == "vllm":
                    launches.append(measured(functools.partial(
                        launch_peer, workdir, "vllm", mode, mode_args, S, VLLM_INTERVAL, rnd)))
                else:
                    launches.append(measured(functools.partial(launch_ours, workdir, method, mode, mode_args, S, rnd)))
    # sglang's 10 s interval, measured for real: startups chosen so that the ready moments fall at
    # (i + 0.5) / n of the poll period; each is paired with a launch of ours with the same startup.
    sglang_startups = [round(SGLANG_INTERVAL * (i + 0.5) / plan.sglang_reps - 0.1, 2)
                       for i in range(plan.sglang_reps)]
    for rnd, startup in enumerate(sglang_startups):
        progress(f"readiness: sglang 10 s interval {rnd + 1}/{plan.sglang_reps} (startup {startup} s)")
        pair = [functools.partial(launch_peer, workdir, "sglang", "warmup", [], startup, SGLANG_INTERVAL, rnd),
                functools.partial(launch_ours, workdir, "ours", "warmup", [], startup, rnd)]
        for i, what in enumerate(pair if rnd % 2 == 0 else reversed(pair)):
            launch = measured(what)
            if launch.method == "ours":
                launch.method = "ours@sglang"
            launches.append(launch)
            del i
    errors = [f"{x.method}/{x.mode}: {x.error} (after a retry)" for x in launches if x.error]

    def pick(method: str, mode: str) -> list[Launch]:
        return [x for x in launches if x.method == method and x.mode == mode and x.latency is not None]

    def by_round(method: str, mode: str) -> dict[int, float]:
        return {x.rnd: x.latency for x in pick(method, mode) if x.latency is not None}

    rows: list[dict[str, Any]] = []
    for mode in READINESS_MODES:
        for method, label in READINESS_METHODS.items():
            sample = pick(method, mode)
            rows.append({
                "mode": mode, "method": method, "label": label, "n": len(sample),
                "latency_median": median([x.latency for x in sample]),
                "latency_samples": [round(x.latency, 4) for x in sample if x.latency is not None],
                "health_requests_median": median([x.health_requests for x in sample]),
                "own_check_median": median([x.own_check_seconds for x in sample]),
                "tcp_sockets_median": median([x.tcp_sockets for x in sample]),
                "tcp_read_median": median([x.tcp_read_seconds for x in sample]),
                "launch_overhead_median": median([x.launch_overhead for x in sample]),
                "teardown_median": median([x.teardown_seconds for x in sample]),
            })
    sglang = pick("sglang", "warmup")
    paired = pick("ours@sglang", "warmup")
    rows.append({
        "mode": "warmup", "method": "sglang", "label": "sglang `popen_launch_server` habit, real 10 s interval",
        "n": len(sglang), "startups": sglang_startups,
        "latency_median": median([x.latency for x in sglang]),
        "latency_samples": [round(x.latency, 4) for x in sglang if x.latency is not None],
        "ours_same_startups_median": median([x.latency for x in paired]),
        "ours_same_startups_samples": [round(x.latency, 4) for x in paired if x.latency is not None],
        "health_requests_median": median([x.health_requests for x in sglang]),
        # a poll every T seconds, readiness uncorrelated with the grid: the wait is uniform in [0, T), mean T/2
        "expected_latency_analytical": SGLANG_INTERVAL / 2,
    })

    def row(mode: str, method: str) -> dict[str, Any]:
        return next(r for r in rows if r["mode"] == mode and r["method"] == method)

    # ratios: candidate / baseline, the ratio of the medians and the range of the per-round ratios
    comparisons: list[dict[str, Any]] = []
    for mode in READINESS_MODES:
        for cand, base in (("ours", "ours-poll"), ("ours", "vllm"), ("ours", "previous")):
            c, b = by_round(cand, mode), by_round(base, mode)
            comparisons.append({
                "mode": mode, "candidate": cand, "baseline": base,
                "ratio": ratio(row(mode, cand)["latency_median"], row(mode, base)["latency_median"]),
                "range": spread([(c.get(k), b.get(k)) for k in sorted(set(c) | set(b))]),
            })
    c, b = by_round("ours@sglang", "warmup"), by_round("sglang", "warmup")
    comparisons.append({
        "mode": "warmup", "candidate": "ours", "baseline": "sglang",
        "ratio": ratio(median(list(c.values())), median(list(b.values()))),
        "range": spread([(c.get(k), b.get(k)) for k in sorted(set(c) | set(b))]),
    })
    return {"rows": rows, "comparisons": comparisons, "errors": errors, "retried": retried, "startup": S,
            "reps": plan.ready_reps, "sglang_startups": sglang_startups, "launches": [asdict(x) for x in launches]}


def comparison(results: dict[str, Any], mode: str, candidate: str, baseline: str) -> dict[str, Any] | None:
    return next((c for c in results["comparisons"] if c["mode"] == mode and c["candidate"] == candidate
                 and c["baseline"] == baseline), None)


def readiness_row(results: dict[str, Any], mode: str, method: str) -> dict[str, Any] | None:
    return next((r for r in results["rows"] if r["mode"] == mode and r["method"] == method), None)


# ---------------------------------------------------------------------------------------------- 1b. real engine


class LogWatcher:
    """Watches a log file from another thread (every millisecond) and notes when ``needle`` first appears."""

    def __init__(self, needle: str) -> None:
        self.needle = needle.encode()
        self.path: Path | None = None
        self.seen_at: float | None = None
        self.offset_after: int | None = None  # the byte offset just after the line
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-log-watch", daemon=True)

    def __enter__(self) -> LogWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        data = b""
        while not self._stop.is_set() and self.seen_at is None:
            path = self.path
            if path is not None:
                try:
                    size = os.stat(path).st_size
                    if size > len(data):
                        with open(path, "rb") as fh:
                            fh.seek(len(data))
                            data += fh.read(size - len(data))
                        at = data.find(self.needle)
                        if at >= 0:
                            self.seen_at = time.time()
                            end = data.find(b"\n", at)
                            self.offset_after = len(data) if end < 0 else end + 1
                except OSError:
                    pass
            time.sleep(0.001)


@contextlib.contextmanager
def log_path_of_next_start(watcher: LogWatcher) -> Iterator[None]:
    """Hands the log path of the next process the launcher starts to ``watcher``."""
    import pytest_sglworker.workers.launcher as launcher_mod

    original = launcher_mod.start_process

    def start_process(argv: list[str], env: Any, log_path: Path, **kwargs: Any) -> dict[str, Any]:
        started = original(argv, env, log_path, **kwargs)  # environ, session_id: as the launcher passes them
        watcher.path = started["log_path"]
        return started

    launcher_mod.start_process = start_process  # type: ignore[assignment]
    try:
        yield
    finally:
        launcher_mod.start_process = original  # type: ignore[assignment]


_GENERATION = re.compile(rb"Prefill batch")
_HEALTH_GET = re.compile(rb'"GET /(health_generate|health|ready) HTTP')


def bench_real(plan: Plan, workdir: Path) -> dict[str, Any]:
    from previous import PreviousWorker, previous_owns_port

    from pytest_sglworker.engine.cpu_engine import (
        build_tiny_model,
        cpu_engine_spec,
        real_engine_launcher,
        real_engine_missing_reason,
        real_engine_python,
    )
    from pytest_sglworker.engine.sglang_facts import READY_LINE
    from pytest_sglworker.workers.health import http_request
    from pytest_sglworker.workers.launcher import LaunchOptions, spawn_worker

    root = os.environ.get("BENCH_REAL_ENGINE") or None
    python = real_engine_python(root)
    if python is None:
        return {"skipped": real_engine_missing_reason(root)}
    progress("real: the tiny model (cached in .cache/bench-tiny-model)")
    model = build_tiny_model(python, REPO / ".cache" / "bench-tiny-model")
    spec = cpu_engine_spec("bench-tiny-cpu", str(model))
    options = LaunchOptions(launcher=tuple(real_engine_launcher(python)), log_dir=workdir / "real-logs",
                            lock_dir=workdir / "locks", startup_timeout=600.0)
    launches: list[dict[str, Any]] = []
    probes: dict[str, list[float]] = {"/health_generate": [], "/ready": []}
    probe_generations = None
    for variant in ("ours", "previous"):
        progress(f"real: launch of the real engine, {variant} (about a minute)")
        watcher = LogWatcher(READY_LINE)
        with contextlib.ExitStack() as stack:
            stack.enter_context(watcher)
            stack.enter_context(log_path_of_next_start(watcher))
            kind = None
            if variant == "previous":
                stack.enter_context(previous_owns_port())
                kind = PreviousWorker()
            t0 = time.time()
            worker = spawn_worker(spec, options=options, kind=kind)
            returned = time.time()
            time.sleep(0.05)  # let the watcher see the line if it came in the last millisecond
        try:
            log = worker.log_path.read_bytes()
            after = log[watcher.offset_after or len(log):]
            launches.append({
                "variant": variant, "startup_seconds": returned - t0,
                "latency_after_line": None if watcher.seen_at is None else returned - watcher.seen_at,
                "generations_after_line": len(_GENERATION.findall(after)),
                "health_gets_after_line": [m.group(1).decode() for m in _HEALTH_GET.finditer(after)],
            })
            if variant == "ours":  # what each endpoint costs the running engine, alternating
                before = len(_GENERATION.findall(worker.log_path.read_bytes()))
                for _ in range(3):
                    for path in probes:
                        t1 = time.perf_counter()
                        resp = http_request(worker.host, worker.port, path, deadline=time.monotonic() + 30)
                        probes[path].append(time.perf_counter() - t1)
                        assert resp.status == 200, (path, resp.status)
                time.sleep(0.5)
                probe_generations = len(_GENERATION.findall(worker.log_path.read_bytes())) - before
        finally:
            worker.stop()
            worker.remove_log()
    ours = next(x for x in launches if x["variant"] == "ours")
    previous = next(x for x in launches if x["variant"] == "previous")
    return {"launches": launches, "probe_seconds": probes, "probe_generations": probe_generations,
            "probes_per_endpoint": 3,
            # below the watch's resolution a latency is counted as that resolution (a ratio of at most)
            "ratio": ratio(_resolved(ours["latency_after_line"]), _resolved(previous["latency_after_line"])),
            "ratio_is_bound": (ours["latency_after_line"] or 0) < WATCH_RESOLUTION}


#: The log watch of part ``real`` looks every millisecond: a wait that returns within that of the line (or
#: before the watch saw it: sglang is ``Up`` a moment before it logs the line) is "under 1 ms".
WATCH_RESOLUTION = 0.001


def _resolved(latency: float | None) -> float | None:
    return None if latency is None else max(latency, WATCH_RESOLUTION)


def fmt_after_line(latency: float | None) -> str:
    if latency is not None and latency < WATCH_RESOLUTION:
        return "under 1 ms"
    return fmt_s(latency)


# ---------------------------------------------------------------------------------------------- suites


@dataclass
class SuiteRun:
    label: str
    args: list[str]
    rnd: int
    wall: float
    rc: int
    passed: int
    failed: int
    launches: int
    reuses: int
    startup_median: float | None
    gpu_seconds: float
    report: dict[str, Any] = field(default_factory=dict, repr=False)
    tail: str = field(default="", repr=False)


def run_suite(workdir: Path, suite: Path, label: str, args: Sequence[str], env_extra: dict[str, str],
              rnd: int = 0, models: str = "a,b") -> SuiteRun:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=workdir))
    report = run_dir / "report.json"
    cmd = [sys.executable, "-m", "pytest", str(suite), "-p", "no:cacheprovider",
           "--sgl-engine", "sim", "--sgl-model", models, "--sgl-report", str(report),
           "--sgl-log-dir", str(run_dir / "logs"), "--sgl-lock-dir", str(workdir / "locks"), *args]
    env = clean_env(**env_extra)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    out = proc.stdout
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", out)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) (?:failed|error)", out)) else 0
    launches = reuses = 0
    startups: list[float] = []
    gpu_seconds = 0.0
    data: dict[str, Any] = {}
    if report.exists():
        data = json.loads(report.read_text())
        for worker in data.get("workers", {}).values():
            if worker.get("model") == "sglang-router":
                continue
            launches += worker["launches"]
            reuses += worker["reuses"]
            startups += worker["startup_seconds"]["samples"]
            gpu_seconds += worker["gpu_seconds"]
    run = SuiteRun(label, list(args), rnd, wall, proc.returncode, passed, failed, launches, reuses,
                   median(startups), gpu_seconds, data, "\n".join(out.splitlines()[-15:]))
    if run.rc != 0:
        progress(f"{label} exited {run.rc}:\n{run.tail}")
    return run


def interleaved(workdir: Path, variants: dict[str, tuple[Path, list[str], dict[str, str]]], reps: int,
                what: str, models: str = "a,b") -> dict[str, list[SuiteRun]]:
    """Every variant once per round, the order rotated each round."""
    runs: dict[str, list[SuiteRun]] = {k: [] for k in variants}
    keys = list(variants)
    for rnd in range(reps):
        for key in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
            progress(f"{what}: {key} round {rnd + 1}/{reps}")
            suite, args, env = variants[key]
            runs[key].append(run_suite(workdir, suite, key, args, env, rnd, models))
    return runs


def summary(runs: list[SuiteRun], tests: int) -> dict[str, Any]:
    return {
        "args": runs[0].args if runs else [],
        "n": len(runs),
        "wall_median": median([r.wall for r in runs]),
        "wall_samples": [round(r.wall, 3) for r in runs],
        "launches": median([r.launches for r in runs]),
        "launch_samples": [r.launches for r in runs],
        "reuses": median([r.reuses for r in runs]),
        "startup_median": median([r.startup_median for r in runs]),
        "gpu_seconds": median([r.gpu_seconds for r in runs]),
        "ok": all(r.rc == 0 and r.passed == tests for r in runs),
    }


def compare(runs: dict[str, list[SuiteRun]], cand: str, base: str, key: str = "wall") -> dict[str, Any]:
    c = {r.rnd: getattr(r, key) for r in runs[cand]}
    b = {r.rnd: getattr(r, key) for r in runs[base]}
    return {"candidate": cand, "baseline": base, "of": key,
            "ratio": ratio(median(list(c.values())), median(list(b.values()))),
            "range": spread([(c.get(k), b.get(k)) for k in sorted(set(c) | set(b))])}


def e2e_env(startup: float, per_set: int) -> dict[str, str]:
    return {"SGLSIM_STARTUP_SECONDS": str(startup), "BENCH_E2E_TESTS_PER_SET": str(per_set)}


def bench_reuse(plan: Plan, workdir: Path) -> dict[str, Any]:
    env = e2e_env(plan.reuse_startup, plan.reuse_per_set)
    suite = SUITES / "e2e"
    runs = interleaved(workdir, {"pool": (suite, [], env), "reuse-off": (suite, ["--sgl-reuse", "off"], env)},
                       plan.reuse_reps, "reuse")
    tests = plan.reuse_per_set * 6
    return {"startup": plan.reuse_startup, "tests": tests, "configurations": 6,
            "variants": {k: summary(v, tests) for k, v in runs.items()},
            "wall": compare(runs, "pool", "reuse-off"), "launches": compare(runs, "pool", "reuse-off", "launches"),
            "groups": bench_group_reuse(plan, workdir)}


#: the group shapes of part reuse: ``-k`` selects their tests in bench/suites/group_reuse
GROUP_REUSE_SHAPES = {"regular": "a 2-worker regular group", "pd": "a 1+1 prefill/decode group"}


def bench_group_reuse(plan: Plan, workdir: Path) -> dict[str, Any]:
    """Each group shape over ``reuse_group_tests`` tests on ``sim:2``: pooled (one group launch) against
    ``--sgl-reuse off`` (a group launched and torn down per test), interleaved. Launches are group launches (the
    report's per-configuration count), each of 2 processes."""
    env = {"SGLSIM_STARTUP_SECONDS": str(plan.reuse_startup), "BENCH_GROUP_REUSE_TESTS": str(plan.reuse_group_tests)}
    suite = SUITES / "group_reuse"
    shapes: dict[str, Any] = {}
    for shape, desc in GROUP_REUSE_SHAPES.items():
        args = ["--sgl-gpus", "sim:2", "-k", f"test_{shape}"]
        variants = {"pool": (suite, args, env), "reuse-off": (suite, [*args, "--sgl-reuse", "off"], env)}
        runs = interleaved(workdir, variants, plan.reuse_reps, f"reuse, {desc}", models="a")
        shapes[shape] = {"tests": plan.reuse_group_tests, "members": 2, "gpus": 2,
                         "variants": {k: summary(v, plan.reuse_group_tests) for k, v in runs.items()},
                         "wall": compare(runs, "pool", "reuse-off"),
                         "launches": compare(runs, "pool", "reuse-off", "launches")}
    return shapes


XDIST_VARIANTS = {
    "n1": ["-n", "1"],
    "n4-load": ["-n", "4", "--dist", "load"],
    "n4-loadgroup": ["-n", "4", "--dist", "loadgroup"],
    "n4-ours": ["-n", "4"],
}
XDIST_LABELS = {
    "n1": "`-n 1`",
    "n4-load": "`-n 4 --dist load`",
    "n4-loadgroup": "`-n 4 --dist loadgroup`",
    "n4-ours": "`-n 4` (the plugin's scheduler, `--sgl-dist auto`)",
}


def bench_xdist(plan: Plan, workdir: Path) -> dict[str, Any]:
    env = e2e_env(plan.xdist_startup, plan.xdist_per_set)
    suite = SUITES / "e2e"
    variants = {k: (suite, [*v, "--sgl-gpus", "sim:4"], env) for k, v in XDIST_VARIANTS.items()}
    runs = interleaved(workdir, variants, plan.xdist_reps, "xdist")
    tests = plan.xdist_per_set * 6
    return {"startup": plan.xdist_startup, "tests": tests, "configurations": 6, "gpus": 4,
            "variants": {k: summary(v, tests) for k, v in runs.items()},
            "walls": {k: compare(runs, k, "n1") for k in XDIST_VARIANTS if k != "n1"}}


def _gpu_idle_gaps(report: dict[str, Any]) -> list[float]:
    """For each GPU: from a worker's stop to the next launch on that GPU (seconds the GPU stood idle while the
    run still needed launches)."""
    by_gpu: dict[int, list[dict[str, Any]]] = {}
    for launch in report.get("launches", []):
        for gpu in launch.get("gpus") or []:
            by_gpu.setdefault(gpu, []).append(launch)
    gaps = []
    for launches in by_gpu.values():
        launches.sort(key=lambda x: x.get("t_started") or 0)
        for prev, nxt in itertools.pairwise(launches):
            stopped = prev.get("t_stopped") or prev.get("t_stop_requested")
            if stopped is not None and nxt.get("t_started") is not None:
                gaps.append(max(0.0, nxt["t_started"] - stopped))
    return gaps


def _ideal_seconds(report: dict[str, Any], gpus: int | None = None) -> float | None:
    """The first startup plus the tests (every other startup hidden behind earlier tests); with ``gpus``, the
    best any schedule can do on that many GPUs when the tests are short next to a startup: one startup per
    GPU at a time, ceil(launches / gpus) startups in a row, plus the tests."""
    launches = sorted(report.get("launches", []), key=lambda x: x.get("t_started") or 0)
    if not launches or launches[0].get("t_ready") is None:
        return None
    startups = [x["t_ready"] - x["t_started"] for x in launches if x.get("t_ready") and x.get("t_started")]
    tests = sum((t["t_end"] - t["t_start"]) for launch in launches for t in launch.get("tests", [])
                if t.get("t_end") is not None and t.get("t_start") is not None)
    if gpus is None:
        return startups[0] + tests
    return math.ceil(len(launches) / gpus) * statistics.median(startups) + tests


def bench_ahead(plan: Plan, workdir: Path) -> dict[str, Any]:
    env = e2e_env(plan.ahead_startup, plan.ahead_per_set)
    suite = SUITES / "e2e"
    gpus = ["--sgl-gpus", "sim:2"]
    variants = {
        "off": (suite, [*gpus, "--sgl-launch-ahead", "0"], env),
        "on": (suite, gpus, env),
        "two": (suite, [*gpus, "--sgl-launch-ahead", "2"], env),
    }
    runs = interleaved(workdir, variants, plan.ahead_reps, "launch ahead")
    tests = plan.ahead_per_set * 6
    gaps = {k: median([median(_gpu_idle_gaps(r.report)) for r in v]) for k, v in runs.items()}
    ideal = median([_ideal_seconds(r.report) for r in runs["off"]])
    bound = median([_ideal_seconds(r.report, 2) for r in runs["off"]])
    off_wall = median([r.wall for r in runs["off"]])
    return {"startup": plan.ahead_startup, "tests": tests, "configurations": 6, "gpus": 2,
            "variants": {k: summary(v, tests) for k, v in runs.items()},
            "on": compare(runs, "on", "off"), "two": compare(runs, "two", "off"),
            "gpu_idle_gap_median": gaps, "ideal_seconds": ideal, "ideal_ratio": ratio(ideal, off_wall),
            "two_gpu_bound_seconds": bound, "two_gpu_bound_ratio": ratio(bound, off_wall)}


def bench_groups(plan: Plan, workdir: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="groups-out-", dir=workdir))
    env = {"SGLSIM_STARTUP_SECONDS": str(plan.group_startup), "BENCH_GROUP_REPS": str(plan.group_reps),
           "BENCH_ROUTER_REPS": str(plan.router_reps), "BENCH_GROUPS_OUT": str(out)}
    progress("groups: a 1+1 PD group and a 4-worker group (fresh each test), routers")
    # no launch ahead: a group started ahead would count the earlier tests as its startup
    run = run_suite(workdir, SUITES / "groups", "groups", ["--sgl-gpus", "sim:4", "--sgl-launch-ahead", "0"], env,
                    models="a")
    launches = run.report.get("launches", [])
    shapes: dict[str, list[dict[str, Any]]] = {"pd": [], "four": []}
    by_group: dict[str, list[dict[str, Any]]] = {}
    for launch in launches:
        if launch.get("role") != "router" and launch.get("group"):
            by_group.setdefault(launch["group"], []).append(launch)
    for members in by_group.values():
        tests = [t for m in members for t in m.get("tests", [])]
        if not tests:
            continue
        first = min(tests, key=lambda t: t["t_start"])
        shape = "pd" if "::test_pd" in first["nodeid"] else "four" if "::test_four" in first["nodeid"] else None
        if shape is None:
            continue
        requested = min(m["t_lease_requested"] or m["t_started"] for m in members)
        slowest = max(m["t_ready"] - m["t_started"] for m in members)
        shapes[shape].append({"members": len(members), "group_seconds": first["t_start"] - requested,
                              "slowest_member_seconds": slowest,
                              "ratio": ratio(first["t_start"] - requested, slowest)})
    routers = {launch["port"]: launch for launch in launches if launch.get("role") == "router"}
    bare = [json.loads(line) for line in (out / "bare-routers.jsonl").read_text().splitlines()] \
        if (out / "bare-routers.jsonl").exists() else []
    router_pairs = []
    for record in bare:
        # the router fixture's launch served this test: the router record whose tests name it
        ours = next((launch for launch in launches if launch.get("role") == "router"
                     and any(t["nodeid"] == record["nodeid"] for t in launch.get("tests", []))), None)
        if ours is None or ours.get("t_ready") is None:
            continue
        seconds = ours["t_ready"] - ours["t_started"]
        router_pairs.append({"order": record["order"], "ours_seconds": seconds, "bare_seconds": record["bare_seconds"],
                             "ratio": ratio(seconds, record["bare_seconds"])})
    del routers
    result: dict[str, Any] = {"startup": plan.group_startup, "ok": run.rc == 0, "shapes": {}, "routers": router_pairs}
    for shape, rows in shapes.items():
        ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
        result["shapes"][shape] = {
            "n": len(rows), "rows": rows,
            "group_median": median([r["group_seconds"] for r in rows]),
            "slowest_median": median([r["slowest_member_seconds"] for r in rows]),
            "ratio": median(ratios), "range": (min(ratios), max(ratios)) if ratios else None,
        }
    if router_pairs:
        ratios = [r["ratio"] for r in router_pairs if r["ratio"] is not None]
        result["router"] = {"n": len(router_pairs), "ours_median": median([r["ours_seconds"] for r in router_pairs]),
                            "bare_median": median([r["bare_seconds"] for r in router_pairs]),
                            "ratio": ratio(median([r["ours_seconds"] for r in router_pairs]),
                                           median([r["bare_seconds"] for r in router_pairs])),
                            "range": (min(ratios), max(ratios)) if ratios else None}
    return result


# ---------------------------------------------------------------------------------------------- overhead


def make_trivial_suite(root: Path, tests: int, per_file: int = 100) -> int:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    files = max(1, tests // per_file)
    for f in range(files):
        body = "".join(f"def test_{i}():\n    assert {i} == {i}\n\n\n" for i in range(per_file))
        (root / f"test_trivial_{f:03d}.py").write_text(body)
    return files * per_file


def _timed(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def _timed_cpu(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Wall time and CPU time (user + sys) of one child process: CPU time is less sensitive than wall time
    to other load on a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, proc = _timed(cmd, env, cwd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


def bench_overhead(plan: Plan, workdir: Path) -> dict[str, Any]:
    env = clean_env()
    suites: dict[str, Any] = {}
    for size, reps in zip(plan.overhead_sizes, plan.overhead_reps, strict=True):
        root = workdir / f"trivial-{size}"
        count = make_trivial_suite(root, size)
        base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root)]
        variants = {"with": base, "without": [*base, "-p", "no:sglworker"]}
        for cmd in variants.values():  # warm: bytecode of pytest, the plugin and the rewritten test modules
            _, proc = _timed(cmd, env, root)
            if f"{count} passed" not in proc.stdout:
                raise RuntimeError(f"the trivial suite did not pass {count} tests:\n{proc.stdout[-2000:]}")
        wall: dict[str, dict[int, float]] = {k: {} for k in variants}
        cpu: dict[str, dict[int, float]] = {k: {} for k in variants}
        for rnd in range(reps):
            progress(f"overhead: {count} trivial tests, round {rnd + 1}/{reps}")
            for key in (list(variants) if rnd % 2 == 0 else list(reversed(variants))):
                w, c, _ = _timed_cpu(variants[key], env, root)
                wall[key][rnd], cpu[key][rnd] = w, c
        suites[str(count)] = {
            "tests": count, "reps": reps,
            "with_median": median(list(wall["with"].values())),
            "without_median": median(list(wall["without"].values())),
            "with_samples": [round(v, 3) for v in wall["with"].values()],
            "without_samples": [round(v, 3) for v in wall["without"].values()],
            "ratio": ratio(median(list(wall["with"].values())), median(list(wall["without"].values()))),
            "range": spread([(wall["with"][k], wall["without"][k]) for k in range(reps)]),
            "cpu_with_median": median(list(cpu["with"].values())),
            "cpu_without_median": median(list(cpu["without"].values())),
            "cpu_ratio": ratio(median(list(cpu["with"].values())), median(list(cpu["without"].values()))),
            "cpu_range": spread([(cpu["with"][k], cpu["without"][k]) for k in range(reps)]),
        }

    # Import: fresh interpreters; pytest first (the baseline), then the plugin on top of it (what the
    # entry point costs a pytest run that has pytest imported already).
    code = ("import time; t0 = time.perf_counter(); import pytest; t1 = time.perf_counter(); "
            "import pytest_sglworker.plugin; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    pytest_t: list[float] = []
    plugin_t: list[float] = []
    for _ in range(plan.import_reps):
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.PIPE,
                             text=True).stdout.split()
        pytest_t.append(float(out[0]))
        plugin_t.append(float(out[1]))
    breakdown = importtime_breakdown(env)
    first = workdir / f"trivial-{plan.overhead_sizes[0]}"
    breakdown["package_modules_in_unused_run"] = package_modules_in_run(env, first)
    return {
        "suites": suites,
        "import": {
            "pytest_median": median(pytest_t), "plugin_after_pytest_median": median(plugin_t),
            "ratio": ratio(median(plugin_t), median(pytest_t)),
            "range": spread(list(zip(plugin_t, pytest_t, strict=True))),
            **breakdown,
        },
    }


def package_modules_in_run(env: dict[str, str], root: Path) -> list[dict[str, Any]]:
    """The package's modules that a run using no worker imports (``-X importtime``)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(root)], env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
    slowest = sorted(modules, key=lambda x: -x[1])[:4]
    heavy = sorted({name.split(".")[0] for name, _, _ in modules
                    if name.split(".")[0] in {"httpx", "psutil", "filelock", "pynvml", "sglang", "torch",
                                              "httpcore", "anyio", "h11", "certifi", "ssl", "xdist"}})
    return {"modules_imported_by_plugin": len(modules),
            "slowest_self_us": [{"module": n, "self_us": s, "cumulative_us": c} for n, s, c in slowest],
            "heavy_modules_imported": heavy}


# ---------------------------------------------------------------------------------------------- soak


def bench_soak(plan: Plan, workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    settings = ["--launches", str(plan.soak_launches), "-n", "2", "--gpus", "2"]  # soak.py's defaults but --quick
    for name, extra in (("plain", settings), ("hostile", ["--hostile", *settings])):
        progress(f"soak: bench/soak.py {' '.join(extra)}")
        out = workdir / f"soak-{name}.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(BENCH / "soak.py"), *extra, "--json", str(out)], cwd=REPO,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = proc.stdout.splitlines()
        result[name] = {"rc": proc.returncode, "seconds": time.perf_counter() - t0, "args": extra,
                        "figures": json.loads(out.read_text()) if out.exists() else None,
                        "summary": [line for line in lines if not line.startswith("  ..")][-16:]}
    return result


# ---------------------------------------------------------------------------------------------- report


def goal(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "**missed**"


def machine_line(results: dict[str, Any]) -> str:
    meta = results["meta"]
    settings = ("`bench/run.py --quick` (smaller samples: NOT the README's figures)" if meta["quick"]
                else "`bench/run.py` full settings")
    if meta["parts"] != sorted(DEFAULT_PARTS):
        settings += f", parts {', '.join(meta['parts'])}"
    return where_and_when(meta, settings)


def real_goal(launch: dict[str, Any]) -> bool | None:
    latency = launch["latency_after_line"]
    return None if latency is None else latency <= READY_GOAL and not launch["generations_after_line"]


def readme_section(results: dict[str, Any]) -> str:
    """The README's ``## Speed`` section, as it is to be pasted."""
    meta = results["meta"]
    out = ["## Speed", ""]
    if meta["quick"]:
        out += ["> **A `--quick` run: smaller samples and shorter startups. These are not the README's figures.**", ""]
    out += [
        "`bench/run.py` measures what the plugin costs and saves against the simulated engine: each figure is a",
        "ratio, ours / a baseline measured in the same run, the two interleaved so that load hits both alike; the",
        "median, with the range of the per-round ratios in brackets (below 1: ours takes less). Every sample and",
        "what each figure means: `bench/README.md`. Rendered from the run's `bench/results/run.json` (by",
        "`bench/render.py`; `bench/all.py` measures again), which ran on:",
        "",
        machine_line(results),
        "",
        "| what | baseline | ours / baseline | goal |",
        "|---|---|---|---|",
    ]
    rows: list[tuple[str, str, str, str]] = []
    r = results.get("readiness")
    if r:
        S = r["startup"]
        for mode, desc in (("warmup", "an engine that warms up (503 until ready)"),
                           ("ready-at-bind", "an engine ready when it binds")):
            ours, poll = readiness_row(r, mode, "ours"), readiness_row(r, mode, "ours-poll")
            vllm, prop = readiness_row(r, mode, "vllm"), readiness_row(r, mode, "previous")
            assert ours and poll and vllm and prop
            c = comparison(r, mode, "ours", "ours-poll")
            lat = ours["latency_median"]
            rows.append((f"readiness after the engine is ready, {desc}, simulated startup {S:g} s: ours "
                         f"{fmt_s(lat)}", f"our plain polling (line watch off): {fmt_s(poll['latency_median'])}",
                         fmt_ratio(c["ratio"], c["range"]) if c else "-",
                         f"ours ≤ 20 ms: {goal(None if lat is None else lat <= READY_GOAL)}"))
            c = comparison(r, mode, "ours", "vllm")
            gets = vllm["health_requests_median"] or 0
            rows.append(("the same, against the vLLM habit", f"`/health` every 0.5 s, a non-200 re-polled at once: "
                         f"{fmt_s(vllm['latency_median'])}, health GETs a launch: {gets:.0f}",
                         fmt_ratio(c["ratio"], c["range"]) if c else "-", ""))
            c = comparison(r, mode, "ours", "previous")
            plat = prop["latency_median"]
            rows.append(("the same, against the code before the fixes (bench/previous.py: psutil's ownership check)",
                         f"{fmt_s(plat)}", fmt_ratio(c["ratio"], c["range"]) if c else "-", ""))
        sg = readiness_row(r, "warmup", "sglang")
        c = comparison(r, "warmup", "ours", "sglang")
        if sg and sg["n"]:
            rows.append((f"readiness, warmup engine, {sg['n']} startups spread over the 10 s poll period: ours "
                         f"{fmt_s(sg['ours_same_startups_median'])}",
                         f"sglang's `popen_launch_server` habit (`/health_generate` every 10 s, real): "
                         f"{fmt_s(sg['latency_median'])}", fmt_ratio(c["ratio"], c["range"]) if c else "-", ""))
    real = results.get("real")
    if real and "skipped" not in real:
        ours = next(x for x in real["launches"] if x["variant"] == "ours")
        prop = next(x for x in real["launches"] if x["variant"] == "previous")
        rows.append((f"readiness after the real sglang's ready line (CPU, tiny model, 1 launch each): ours "
                     f"{fmt_after_line(ours['latency_after_line'])} and {ours['generations_after_line']} "
                     f"generation(s)",
                     "-", "-", f"≤ 20 ms, no generation: {goal(real_goal(ours))}"))
        rows.append(("the same, against the probe it replaced (`/health_generate`, bench/previous.py)",
                     f"{fmt_after_line(prop['latency_after_line'])}, {prop['generations_after_line']} generation(s)",
                     ("≤ " if real.get("ratio_is_bound") else "") + fmt_x(real["ratio"]), ""))
    elif real:
        rows.append(("readiness after the real sglang's ready line", "-", "not measured", real["skipped"]))
    u = results.get("reuse")
    if u:
        v = u["variants"]
        rows.append((f"the pool, {u['tests']} tests of {u['configurations']} configurations, simulated startup "
                     f"{u['startup']:g} s: wall {fmt_s(v['pool']['wall_median'])}, {v['pool']['launches']:.0f} "
                     f"launches", f"a worker per test (`--sgl-reuse off`): {fmt_s(v['reuse-off']['wall_median'])}, "
                     f"{v['reuse-off']['launches']:.0f} launches",
                     f"wall {fmt_ratio(u['wall']['ratio'], u['wall']['range'])}, launches "
                     f"{fmt_x(u['launches']['ratio'])}", ""))
        for shape, desc in GROUP_REUSE_SHAPES.items():
            gs = u.get("groups", {}).get(shape)
            if not gs:
                continue
            gv = gs["variants"]
            rows.append((f"{desc} pooled across {gs['tests']} tests, simulated startup {u['startup']:g} s, "
                         f"`sim:{gs['gpus']}`: wall {fmt_s(gv['pool']['wall_median'])}, group launches "
                         f"{gv['pool']['launches']:.0f}",
                         f"a group per test (`--sgl-reuse off`): {fmt_s(gv['reuse-off']['wall_median'])}, group "
                         f"launches {gv['reuse-off']['launches']:.0f}",
                         f"wall {fmt_ratio(gs['wall']['ratio'], gs['wall']['range'])}, launches "
                         f"{fmt_x(gs['launches']['ratio'])}", ""))
    x = results.get("xdist")
    if x:
        v = x["variants"]
        for key in ("n4-load", "n4-loadgroup", "n4-ours"):
            c = x["walls"][key]
            rows.append((f"{XDIST_LABELS[key]}, {x['tests']} tests of {x['configurations']} configurations on "
                         f"`sim:4`, startup {x['startup']:g} s, {meta['machine']['cores']} CPUs: "
                         f"{fmt_s(v[key]['wall_median'])}, {v[key]['launches']:.0f} launches",
                         f"`-n 1`: {fmt_s(v['n1']['wall_median'])}, {v['n1']['launches']:.0f} launches",
                         fmt_ratio(c["ratio"], c["range"]), ""))
    a = results.get("ahead")
    if a:
        v = a["variants"]
        rows.append((f"launch ahead (default `--sgl-launch-ahead 1`), {a['tests']} tests of {a['configurations']} "
                     f"configurations, simulated startup {a['startup']:g} s, `sim:2`: {fmt_s(v['on']['wall_median'])}",
                     f"`--sgl-launch-ahead 0`: {fmt_s(v['off']['wall_median'])} (ideal, the first startup plus the "
                     f"tests: {fmt_x(a['ideal_ratio'])}; the best of any schedule on 2 GPUs, "
                     f"{math.ceil(a['configurations'] / a['gpus'])} startups in a row plus the tests: "
                     f"{fmt_x(a.get('two_gpu_bound_ratio'))})", fmt_ratio(a["on"]["ratio"], a["on"]["range"]),
                     f"≤ 0.6x: {goal(None if a['on']['ratio'] is None else a['on']['ratio'] <= AHEAD_GOAL)}"))
        rows.append((f"the same with `--sgl-launch-ahead 2`: {fmt_s(v['two']['wall_median'])}",
                     f"`--sgl-launch-ahead 0`: {fmt_s(v['off']['wall_median'])}",
                     fmt_ratio(a["two"]["ratio"], a["two"]["range"]),
                     f"≤ 0.6x: {goal(None if a['two']['ratio'] is None else a['two']['ratio'] <= AHEAD_GOAL)}"))
    g = results.get("groups")
    if g:
        for shape, desc in (("pd", "a 1+1 prefill/decode group"), ("four", "a 4-worker group")):
            s = g["shapes"].get(shape)
            if not s or not s["n"]:
                continue
            rows.append((f"{desc} from its request to its test, simulated startup {g['startup']:g} s, `sim:4`, "
                         f"launches: {s['n']}: {fmt_s(s['group_median'])}",
                         f"its slowest member's startup: {fmt_s(s['slowest_median'])}",
                         fmt_ratio(s["ratio"], s["range"]),
                         f"≤ 1.1x: {goal(None if s['ratio'] is None else s['ratio'] <= GROUP_GOAL)}"))
        rt = g.get("router")
        if rt:
            rows.append((f"the router ready (every worker healthy), launches: {rt['n']}: {fmt_s(rt['ours_median'])}",
                         f"a bare copy of the same router polled every 1 ms: {fmt_s(rt['bare_median'])}",
                         fmt_ratio(rt["ratio"], rt["range"]), ""))
    o = results.get("overhead")
    if o:
        for size, s in sorted(o["suites"].items(), key=lambda kv: int(kv[0])):
            rows.append((f"installed but unused: `pytest` of {size} trivial tests: {fmt_s(s['with_median'])}",
                         f"`-p no:sglworker`: {fmt_s(s['without_median'])}",
                         f"{fmt_ratio(s['ratio'], s['range'])}; CPU time {fmt_ratio(s['cpu_ratio'], s['cpu_range'])}",
                         f"≤ 1.03x: {goal(None if s['ratio'] is None else s['ratio'] <= OVERHEAD_GOAL)}"))
        i = o["import"]
        rows.append((f"`import pytest_sglworker.plugin` after pytest: {fmt_s(i['plugin_after_pytest_median'])}",
                     f"`import pytest`: {fmt_s(i['pytest_median'])}", fmt_ratio(i["ratio"], i["range"]), ""))
    if rows:
        out += [f"| {a_} | {b_} | {c_} | {d_} |" for a_, b_, c_, d_ in rows]
    else:
        del out[-2:]  # no table
    out += [""]
    out += readme_notes(results)
    sk = results.get("soak")
    if sk:
        out += ["", *soak_lines(sk)]
    return "\n".join(out).rstrip() + "\n"


def readme_notes(results: dict[str, Any]) -> list[str]:
    """Why the figures that miss their goal miss it, with the run's own evidence, next to the fix."""
    notes: list[str] = []
    r = results.get("readiness")
    if r:
        ours = [readiness_row(r, m, "ours") for m in READINESS_MODES]
        prop = [readiness_row(r, m, "previous") for m in READINESS_MODES]
        if any(x and x["latency_median"] is not None and x["latency_median"] > READY_GOAL for x in ours):
            check = median([x["own_check_median"] for x in ours if x])
            fast = median([x["own_check_median"] for x in prop if x])
            sockets = median([x["tcp_sockets_median"] for x in ours if x])
            read = median([x["tcp_read_median"] for x in ours if x])
            notes.append(
                f"- **Readiness over 20 ms on the simulated engine:** the ownership check "
                f"(`ModelInstance.owns_port`) took {fmt_s(check)} by median ({fmt_s(fast)} before the fixes, "
                f"through psutil); one read of `/proc/net/tcp` and `tcp6` took {fmt_s(read)} here, with "
                f"{sockets or 0:.0f} sockets in them. The rest is the probe and the line watch's poll, on a machine "
                f"whose 2 CPUs the engine and the bench share.")
    real = results.get("real")
    if real and "skipped" not in real:
        hg = median(real["probe_seconds"]["/health_generate"])
        rd = median(real["probe_seconds"]["/ready"])
        notes.append(
            f"- **Why the probe is `GET /ready`:** sglang 0.5.23's `/health_generate` (and `/health`) schedules a "
            f"one-token generation and sleeps 1 s before it answers: {fmt_s(hg)} per probe on the running engine "
            f"against {fmt_s(rd)} for `GET /ready`, {real['probe_generations']} generations for "
            f"{real['probes_per_endpoint']} probes of each. The simulated engine answers both at once, so the "
            f"simulated figures above do not show this.")
    a = results.get("ahead")
    if a and a["on"]["ratio"] is not None and a["on"]["ratio"] > AHEAD_GOAL:
        gaps = a["gpu_idle_gap_median"]
        notes.append(
            f"- **Launch ahead misses 0.6x at its default:** a GPU stood idle {fmt_s(gaps.get('on'))} (median) "
            f"between a worker's stop and the next launch on it, against {fmt_s(gaps.get('two'))} with "
            f"`--sgl-launch-ahead 2` and {fmt_s(gaps.get('off'))} without launch ahead; the bound of any schedule "
            f"on these GPUs is {fmt_x(a.get('two_gpu_bound_ratio'))}.")
    g = results.get("groups")
    if g and g.get("router") and g["router"]["ratio"] is not None and g["router"]["ratio"] > GROUP_GOAL:
        notes.append(
            "- **The router's wait:** it has no ready line to watch (`wait_until_ready(..., ready_line=None)`), so "
            "after each not-ready answer (`/workers` not yet listing every worker healthy) it polls again only "
            "0.1 s later, and its last probe pays the same ownership check as a worker's; the bare copy polls "
            "every millisecond.")
    o = results.get("overhead")
    if o and any(s["ratio"] is not None and s["ratio"] > OVERHEAD_GOAL for s in o["suites"].values()):
        sizes = sorted((int(k), v) for k, v in o["suites"].items())
        added = [(n, v["with_median"] - v["without_median"]) for n, v in sizes
                 if v["with_median"] is not None and v["without_median"] is not None]
        text = ", ".join(f"{fmt_s(d)} to {n} tests" for n, d in added)
        if len(added) >= 2 and added[-1][0] != added[0][0]:
            per_test = (added[-1][1] - added[0][1]) / (added[-1][0] - added[0][0])
            fixed = added[0][1] - per_test * added[0][0]
            text += (": a fixed cost, no measurable part per test" if per_test <= 0
                     else f": about {fmt_s(fixed)} fixed and {per_test * 1e6:.0f} µs a test" if fixed >= 0
                     else ", which no fixed cost fits (the load moved more than the plugin adds)")
        cpu = ", ".join(f"{fmt_s(v['cpu_with_median'] - v['cpu_without_median'])} to {n} tests" for n, v in sizes
                        if v.get("cpu_with_median") is not None and v.get("cpu_without_median") is not None)
        mods = o["import"].get("package_modules_in_unused_run") or []
        notes.append(
            f"- **Installed but unused over 1.03x:** the plugin adds {text} (by median wall; by median CPU time "
            f"{cpu or '-'}). Of its fixed part, {sum(m['self_us'] for m in mods) / 1000:.0f} ms is the execution of "
            f"the {len(mods)} package modules a run that uses no worker imports (`-X importtime`; listed in "
            f"bench/README.md); the rest is the plugin's hooks (configure, collection, the terminal summary) and "
            f"the per-test hook calls.")
    return notes


def soak_lines(sk: dict[str, Any]) -> list[str]:
    lines = []
    for name in ("plain", "hostile"):
        s = sk.get(name)
        if not s or not s["figures"]:
            continue
        f = s["figures"]
        fds = sum(v["fd_growth"] for v in f["fd_growth"].values())
        leases = len(f["leaked_lease_records"]) + len(f["held_locks"])
        text = (f"`bench/soak.py {' '.join(s['args'])}`: {f['launch_attempts']} launches and teardowns in "
                f"{f['wall_seconds']:.0f} s ({f['launches']} healthy, {f['failed_launches']} failed to start on "
                f"purpose); leaked {len(f['leaked_processes'])} processes, {fds} file descriptors, "
                f"{len(f['leaked_ports'])} ports, {leases} leases, {len(f['leftover_logs'])} logs")
        if name == "hostile":
            text += (f"; {f['failures_reported_correctly']} of {f['expected_failures']} failures reported correctly, "
                     f"a startup failure at most {f['longest_past_deadline_s']:.2f} s past its deadline, a stopped "
                     f"worker's teardown at most {f['longest_stopped_teardown_s']:.2f} s, "
                     f"{len(f['listened_after_teardown'])} ports listened on after their teardown")
        lines.append(text + f" (exit {s['rc']}).")
    return lines


def details_section(results: dict[str, Any]) -> str:
    """bench/README.md's ``## Latest figures``: every figure with its samples."""
    meta = results["meta"]
    out = ["## Latest figures", ""]
    if meta["quick"]:
        out += ["> **A `--quick` run: not the figures bench/README.md states.**", ""]
    out += [machine_line(results), ""]
    r = results.get("readiness")
    if r:
        out += [f"**1. Readiness latency** (simulated startup {r['startup']:g} s; {r['reps']} launches per method and "
                f"mode, the methods' order rotated each round; median and range):", "",
                "| engine mode | method | latency after ready | range | health GETs a launch | ownership check | "
                "TCP sockets, one read of both tables |", "|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            if row["method"] == "sglang":
                continue
            own = fmt_s(row["own_check_median"]) if row["own_check_median"] is not None else "-"
            socks = (f"{row['tcp_sockets_median']:.0f}, {fmt_s(row['tcp_read_median'])}"
                     if row["tcp_sockets_median"] is not None else "-")
            out.append(f"| {row['mode']} | {row['label']} | {fmt_s(row['latency_median'])} | "
                       f"{fmt_range(row['latency_samples'])} | {row['health_requests_median'] or 0:.0f} | {own} | "
                       f"{socks} |")
        sg = readiness_row(r, "warmup", "sglang")
        if sg and sg["n"]:
            out.append(f"| warmup | {sg['label']} (startups {', '.join(f'{s:g}' for s in sg['startups'])} s) | "
                       f"{fmt_s(sg['latency_median'])} | {fmt_range(sg['latency_samples'])} | "
                       f"{sg['health_requests_median'] or 0:.0f} | - | - |")
            out.append(f"| warmup | ours, the same startups | {fmt_s(sg['ours_same_startups_median'])} | "
                       f"{fmt_range(sg['ours_same_startups_samples'])} | - | - | - |")
        elif sg:
            out.append(f"| warmup | {sg['label']} | not measured (analytical: "
                       f"{fmt_s(sg['expected_latency_analytical'])}) | - | - | - | - |")
        out += ["", "Ratios (candidate / baseline; range of the per-round ratios):", ""]
        for c in r["comparisons"]:
            out.append(f"- {c['mode']}: {c['candidate']} / {c['baseline']} = {fmt_ratio(c['ratio'], c['range'])}")
        ours = [readiness_row(r, m, "ours") for m in READINESS_MODES]
        vllm = [readiness_row(r, m, "vllm") for m in READINESS_MODES]
        out += ["", f"Launch overhead (the call to the engine's `start` event): ours "
                f"{fmt_s(median([x['launch_overhead_median'] for x in ours if x]))}, bare `Popen` "
                f"{fmt_s(median([x['launch_overhead_median'] for x in vllm if x]))}. Teardown: ours `stop()` "
                f"{fmt_s(median([x['teardown_median'] for x in ours if x]))}, `SIGTERM` + `wait` "
                f"{fmt_s(median([x['teardown_median'] for x in vllm if x]))}."]
        for note in r["retried"]:
            out.append(f"Retried once (not counted): {note}.")
        for err in r["errors"]:
            out.append(f"ERROR: {err}.")
        out.append("")
    real = results.get("real")
    if real:
        if "skipped" in real:
            out += [f"**1b. Real engine:** not measured: {real['skipped']}", ""]
        else:
            out += ["**1b. Readiness after the real sglang's ready line** (sglang 0.5.23, CPU build, the tiny model; "
                    "one launch each; the line is seen by a thread that reads the log every millisecond):", "",
                    "| method | startup | after the ready line | generations after the line | health GETs after the "
                    "line |", "|---|---|---|---|---|"]
            for x in real["launches"]:
                gets = ", ".join(x["health_gets_after_line"]) or "none"
                label = ("ours as committed" if x["variant"] == "ours"
                         else "ours before the fixes: `/health_generate` probe (bench/previous.py)")
                out.append(f"| {label} | {fmt_s(x['startup_seconds'])} | {fmt_after_line(x['latency_after_line'])} | "
                           f"{x['generations_after_line']} | {gets} |")
            p = real["probe_seconds"]
            out += ["", f"On the running engine, {real['probes_per_endpoint']} probes of each, alternating: "
                    f"`/health_generate` {fmt_s(median(p['/health_generate']))} "
                    f"({fmt_range(p['/health_generate'])}), `/ready` {fmt_s(median(p['/ready']))} "
                    f"({fmt_range(p['/ready'])}); {real['probe_generations']} generations in all.", ""]
    for key, title, names in (("reuse", "2. Reuse", {"pool": "pool (default)", "reuse-off": "`--sgl-reuse off`"}),
                              ("xdist", "3. xdist", XDIST_LABELS),
                              ("ahead", "4. Launch ahead", {"off": "`--sgl-launch-ahead 0`", "on": "default (1)",
                                                            "two": "`--sgl-launch-ahead 2`"})):
        s = results.get(key)
        if not s:
            continue
        gpus = f", `sim:{s['gpus']}`" if "gpus" in s else ""
        out += [f"**{title}** ({s['tests']} tests, {s['configurations']} configurations, simulated startup "
                f"{s['startup']:g} s{gpus}; {next(iter(s['variants'].values()))['n']} runs of each, interleaved):", "",
                "| variant | wall (median) | samples | launches | GPU-seconds | ok |", "|---|---|---|---|---|---|"]
        for k, v in s["variants"].items():
            out.append(f"| {names[k]} | {fmt_s(v['wall_median'])} | {', '.join(f'{w:.1f}' for w in v['wall_samples'])} "
                       f"| {', '.join(str(n) for n in v['launch_samples'])} | {v['gpu_seconds'] or 0:.1f} | "
                       f"{'yes' if v['ok'] else 'NO'} |")
        for shape, desc in GROUP_REUSE_SHAPES.items() if key == "reuse" else ():
            gs = s.get("groups", {}).get(shape)
            if not gs:
                continue
            out += ["", f"{desc[0].upper()}{desc[1:]} ({gs['tests']} tests, one configuration, `sim:{gs['gpus']}`, "
                    f"{gs['members']} processes a launch):", "",
                    "| variant | wall (median) | samples | group launches | GPU-seconds | ok |",
                    "|---|---|---|---|---|---|"]
            for k, v in gs["variants"].items():
                out.append(f"| {names[k]} | {fmt_s(v['wall_median'])} | "
                           f"{', '.join(f'{w:.1f}' for w in v['wall_samples'])} | "
                           f"{', '.join(str(n) for n in v['launch_samples'])} | {v['gpu_seconds'] or 0:.1f} | "
                           f"{'yes' if v['ok'] else 'NO'} |")
        if key == "ahead":
            gaps = s["gpu_idle_gap_median"]
            out += ["", "Median time a GPU stood idle between a worker's stop and the next launch on it: "
                    + ", ".join(f"{names[k]} {fmt_s(gaps.get(k))}" for k in s["variants"])
                    + f". Ideal (the first startup plus the tests, from the runs without): "
                    f"{fmt_s(s['ideal_seconds'])}; the best of any schedule on {s['gpus']} GPUs "
                    f"({math.ceil(s['configurations'] / s['gpus'])} startups in a row plus the tests): "
                    f"{fmt_s(s.get('two_gpu_bound_seconds'))}."]
        out.append("")
    g = results.get("groups")
    if g:
        out += [f"**5. Groups and the router** (simulated startup {g['startup']:g} s, `sim:4`, no launch ahead):", "",
                "| group | from its request to its test | slowest member's startup | ratio |", "|---|---|---|---|"]
        for shape, desc in (("pd", "1 prefill + 1 decode"), ("four", "4 workers")):
            for row in g["shapes"].get(shape, {}).get("rows", []):
                out.append(f"| {desc} | {fmt_s(row['group_seconds'])} | {fmt_s(row['slowest_member_seconds'])} | "
                           f"{fmt_x(row['ratio'])} |")
        if g["routers"]:
            out += ["", "| router | ours (start to every worker healthy) | bare copy, 1 ms polling | ratio |",
                    "|---|---|---|---|"]
            for row in g["routers"]:
                out.append(f"| {row['order']} | {fmt_s(row['ours_seconds'])} | {fmt_s(row['bare_seconds'])} | "
                           f"{fmt_x(row['ratio'])} |")
        out.append("")
    o = results.get("overhead")
    if o:
        out += ["**6. Installed but unused** (`pytest -q -p no:cacheprovider` of trivial tests, bytecode cached; "
                "with and without alternating):", "",
                "| tests | runs | with | without | wall ratio | CPU with | CPU without | CPU ratio |",
                "|---|---|---|---|---|---|---|---|"]
        for size, s in sorted(o["suites"].items(), key=lambda kv: int(kv[0])):
            out.append(f"| {size} | {s['reps']} | {fmt_s(s['with_median'])} ({fmt_range(s['with_samples'])}) | "
                       f"{fmt_s(s['without_median'])} ({fmt_range(s['without_samples'])}) | "
                       f"{fmt_ratio(s['ratio'], s['range'])} | {fmt_s(s['cpu_with_median'])} | "
                       f"{fmt_s(s['cpu_without_median'])} | {fmt_ratio(s['cpu_ratio'], s['cpu_range'])} |")
        i = o["import"]
        slow = ", ".join(f"{m['module']} {m['self_us'] / 1000:.1f} ms" for m in i["slowest_self_us"])
        run_mods = i.get("package_modules_in_unused_run") or []
        out += ["", f"`import pytest_sglworker.plugin` after pytest: {fmt_s(i['plugin_after_pytest_median'])} against "
                f"{fmt_s(i['pytest_median'])} for `import pytest` ({fmt_ratio(i['ratio'], i['range'])}); it adds "
                f"{i['modules_imported_by_plugin']} modules (slowest: {slow}), heavy packages: "
                f"{', '.join(i['heavy_modules_imported']) or 'none'}. A run that uses no worker imports "
                f"{len(run_mods)} of the package's modules "
                f"({sum(m['self_us'] for m in run_mods) / 1000:.1f} ms of module execution): "
                + ", ".join(f"{m['module'].removeprefix('pytest_sglworker.')} {m['self_us'] / 1000:.1f}"
                            for m in sorted(run_mods, key=lambda m: -m["self_us"])) + " (ms).", ""]
    sk = results.get("soak")
    if sk:
        out += ["**7. Soak**:", "", *[f"- {line}" for line in soak_lines(sk)], ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller samples: NOT the README's figures")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure and sample as JSON")
    parser.add_argument("--only", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated parts: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, run reports)")
    parser.add_argument("--real-engine", default=None, metavar="VENV",
                        help="the real engine's venv for part real (default: $SGLWORKER_REAL_ENGINE, else this "
                             "tree's .cache/real-engine)")
    add_render_option(parser)
    ns = parser.parse_args(argv)
    if ns.render is not None:
        return print_rendered(ns.render, lambda saved: readme_section(saved) + "\n" + details_section(saved))
    parts = {p.strip() for p in ns.only.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    plan = QUICK if ns.quick else FULL
    if plan.quick:
        progress("--quick: smaller samples and shorter startups; NOT the README's figures")

    real_engine = ns.real_engine or os.environ.get("SGLWORKER_REAL_ENGINE")
    # Measured processes, including the engines that spawn_worker starts from this process's environment.
    for key in list(os.environ):
        if key in _DROPPED_ENV or key.startswith(_DROPPED_PREFIXES):
            del os.environ[key]
    sys.dont_write_bytecode = False
    # This tree's package, in this process and in every measured one (ahead of an editable install elsewhere).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    sys.path[:0] = [str(REPO), str(BENCH)]  # and bench/previous.py
    package = subprocess.run([sys.executable, "-c", "import pytest_sglworker; print(pytest_sglworker.__file__)"],
                             env=clean_env(), cwd=SUITES, capture_output=True, text=True).stdout.strip()
    if not package.startswith(str(REPO) + os.sep):
        parser.error(f"the measured processes import pytest_sglworker from {package or '?'}, not from {REPO}")
    if real_engine:
        os.environ["BENCH_REAL_ENGINE"] = real_engine
    t_start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="sglworker-bench-"))
    results: dict[str, Any] = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "quick": plan.quick, "plan": asdict(plan), "parts": sorted(parts),
        "load_before": round(os.getloadavg()[0], 2),
    }}
    benches: dict[str, Callable[[Plan, Path], dict[str, Any]]] = {
        "readiness": bench_readiness, "real": bench_real, "reuse": bench_reuse, "xdist": bench_xdist,
        "ahead": bench_ahead, "groups": bench_groups, "overhead": bench_overhead, "soak": bench_soak,
    }
    try:
        warm_bytecode()
        for part in PARTS:
            if part in parts and not (part == "real" and plan.quick):
                t0 = time.perf_counter()
                results[part] = benches[part](plan, workdir)
                results[part]["seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        if ns.keep:
            progress(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results["meta"]["load_after"] = round(os.getloadavg()[0], 2)
    results["meta"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
    sys.stdout.write(readme_section(results))
    sys.stdout.write("\n")
    sys.stdout.write(details_section(results))
    sys.stdout.flush()
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        progress(f"figures written to {ns.json}")
    bad = [f"{part}/{k}" for part in ("reuse", "xdist", "ahead")
           for k, v in results.get(part, {}).get("variants", {}).items() if not v["ok"]]
    bad += [f"reuse/{shape}/{k}" for shape, g in results.get("reuse", {}).get("groups", {}).items()
            for k, v in g["variants"].items() if not v["ok"]]
    if "groups" in results and not results["groups"]["ok"]:
        bad.append("groups")
    bad += results.get("readiness", {}).get("errors", [])
    bad += [f"soak {k}" for k, v in results.get("soak", {}).items() if isinstance(v, dict) and v.get("rc")]
    for item in bad:
        progress(f"FAILED: {item}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
