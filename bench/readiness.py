#!/usr/bin/env python
"""Part ``readiness`` of ``bench/run.py``: from the moment the simulated engine is ready (its ``SGLSIM_RECORD``
``ready`` event) to the moment the wait returns: ours as committed (ready-line watch + one probe), ours with the
line watch off (the plain polling it falls back to), ours before the fixes of bench/previous.py, and the peers'
habits (vLLM's ``RemoteOpenAIServer``, sglang's ``popen_launch_server``), for an engine that warms up (503 until
ready) and one that is ready when it binds. What each figure means: bench/README.md, "1. Readiness latency".

    .venv/bin/python bench/readiness.py --quick     # this part alone: bench/run.py --only readiness
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (
    Plan,
    clean_env,
    fmt_range,
    fmt_ratio,
    fmt_s,
    free_port,
    goal,
    median,
    progress,
    ratio,
    spread,
)

NAME = "readiness"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {NAME: ("pytest_sglworker/workers/launcher.py", "pytest_sglworker/workers/health.py",
                   "pytest_sglworker/workers/process.py", "pytest_sglworker/resources/ports.py",
                   "pytest_sglworker/sim/startup.py", "bench/previous.py")}

SGLANG_INTERVAL = 10.0  # sglang test_utils.popen_launch_server: time.sleep(10) between /health_generate polls
VLLM_INTERVAL = 0.5  # vLLM tests/utils.py RemoteOpenAIServer: time.sleep(0.5) after a failed GET /health
READY_GOAL = 0.020  # issue 16: readiness within 20 ms (median) of the engine being ready


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


def measure(plan: Plan, workdir: Path) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------- figures


def speed_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Its rows of the README's ``## Speed`` table (what, baseline, ours / baseline, goal)."""
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
    return rows


def speed_notes(results: dict[str, Any]) -> list[str]:
    """Its lines under the README's ``## Speed`` table: why a figure that misses its goal misses it."""
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
    return notes


def details(results: dict[str, Any]) -> list[str]:
    """Its block of bench/README.md's ``## Latest figures``: every figure with its samples."""
    out: list[str] = []
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
    return out


def failures(results: dict[str, Any]) -> list[str]:
    """What of its run failed (bench/run.py's exit status is 1 when anything did)."""
    return list(results.get(NAME, {}).get("errors", []))


if __name__ == "__main__":  # this part alone, as bench/run.py --only readiness runs it
    import run

    sys.exit(run.main(sys.argv[1:], only="readiness"))
