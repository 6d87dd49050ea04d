#!/usr/bin/env python
"""Part ``ahead`` of ``bench/run.py``: the e2e suite with a startup long next to its tests on 2 GPUs, launch ahead
on (the default 1, and 2) against off. What each figure means: bench/README.md, "4. Launch ahead".

    .venv/bin/python bench/ahead.py --quick         # this part alone: bench/run.py --only ahead
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from common import (
    SUITES,
    Plan,
    compare,
    e2e_env,
    fmt_ratio,
    fmt_s,
    fmt_x,
    goal,
    interleaved,
    median,
    ratio,
    suite_table,
    summary,
)

NAME = "ahead"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {NAME: ("pytest_sglworker/plugin/planner.py", "pytest_sglworker/plugin/launch_hints.py",
                   "pytest_sglworker/plugin/hint_follower.py", "pytest_sglworker/plugin/session.py",
                   "pytest_sglworker/workers/pool.py", "pytest_sglworker/workers/pool_ahead.py", "bench/suites/e2e")}
AHEAD_GOAL = 0.6  # issue 16: launch ahead on / off <= 0.6
VARIANT_NAMES = {"off": "`--sgl-launch-ahead 0`", "on": "default (1)", "two": "`--sgl-launch-ahead 2`"}


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


def measure(plan: Plan, workdir: Path) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------- figures


def speed_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Its rows of the README's ``## Speed`` table (what, baseline, ours / baseline, goal)."""
    rows: list[tuple[str, str, str, str]] = []
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
    return rows


def speed_notes(results: dict[str, Any]) -> list[str]:
    """Its lines under the README's ``## Speed`` table: why a figure that misses its goal misses it."""
    notes: list[str] = []
    a = results.get("ahead")
    if a and a["on"]["ratio"] is not None and a["on"]["ratio"] > AHEAD_GOAL:
        gaps = a["gpu_idle_gap_median"]
        notes.append(
            f"- **Launch ahead misses 0.6x at its default:** a GPU stood idle {fmt_s(gaps.get('on'))} (median) "
            f"between a worker's stop and the next launch on it, against {fmt_s(gaps.get('two'))} with "
            f"`--sgl-launch-ahead 2` and {fmt_s(gaps.get('off'))} without launch ahead; the bound of any schedule "
            f"on these GPUs is {fmt_x(a.get('two_gpu_bound_ratio'))}.")
    return notes


def details(results: dict[str, Any]) -> list[str]:
    """Its block of bench/README.md's ``## Latest figures``: every figure with its samples."""
    s = results.get(NAME)
    if not s:
        return []
    gaps = s["gpu_idle_gap_median"]
    return [*suite_table(s, "4. Launch ahead", VARIANT_NAMES),
            "", "Median time a GPU stood idle between a worker's stop and the next launch on it: "
            + ", ".join(f"{VARIANT_NAMES[k]} {fmt_s(gaps.get(k))}" for k in s["variants"])
            + f". Ideal (the first startup plus the tests, from the runs without): "
            f"{fmt_s(s['ideal_seconds'])}; the best of any schedule on {s['gpus']} GPUs "
            f"({math.ceil(s['configurations'] / s['gpus'])} startups in a row plus the tests): "
            f"{fmt_s(s.get('two_gpu_bound_seconds'))}.", ""]


def failures(results: dict[str, Any]) -> list[str]:
    """What of its run failed (bench/run.py's exit status is 1 when anything did)."""
    return [f"ahead/{k}" for k, v in results.get(NAME, {}).get("variants", {}).items() if not v["ok"]]


if __name__ == "__main__":  # this part alone, as bench/run.py --only ahead runs it
    import run

    sys.exit(run.main(sys.argv[1:], only="ahead"))
