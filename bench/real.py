#!/usr/bin/env python
"""Part ``real`` of ``bench/run.py``: the readiness latency after the real sglang's ready line (CPU build, tiny
model; needs ``scripts/install-real-engine.sh``), ours against the probe it replaced, and what each health endpoint
costs the running engine. What each figure means: bench/README.md, "1b. The real engine". ``--quick`` skips it.

    .venv/bin/python bench/real.py                  # this part alone: bench/run.py --only real
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import REPO, Plan, fmt_range, fmt_s, fmt_x, goal, median, progress, ratio
from readiness import READY_GOAL

NAME = "real"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {NAME: ("pytest_sglworker/workers/launcher.py", "pytest_sglworker/workers/health.py",
                   "pytest_sglworker/workers/process.py", "pytest_sglworker/engine/cpu_engine.py",
                   "pytest_sglworker/engine/sglang_facts.py", "bench/previous.py")}


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


def measure(plan: Plan, workdir: Path) -> dict[str, Any]:
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


def real_goal(launch: dict[str, Any]) -> bool | None:
    latency = launch["latency_after_line"]
    return None if latency is None else latency <= READY_GOAL and not launch["generations_after_line"]


# ---------------------------------------------------------------------------------------------- figures


def speed_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Its rows of the README's ``## Speed`` table (what, baseline, ours / baseline, goal)."""
    rows: list[tuple[str, str, str, str]] = []
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
    return rows


def speed_notes(results: dict[str, Any]) -> list[str]:
    """Its lines under the README's ``## Speed`` table: why a figure that misses its goal misses it."""
    notes: list[str] = []
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
    return notes


def details(results: dict[str, Any]) -> list[str]:
    """Its block of bench/README.md's ``## Latest figures``: every figure with its samples."""
    out: list[str] = []
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
    return out


def failures(results: dict[str, Any]) -> list[str]:
    """What of its run failed (bench/run.py's exit status is 1 when anything did)."""
    return []


if __name__ == "__main__":  # this part alone, as bench/run.py --only real runs it
    import run

    sys.exit(run.main(sys.argv[1:], only="real"))
