#!/usr/bin/env python
"""Benchmark of the xdist scheduler that knows worker configurations (issue #16): ratios measured side by side
in one run.

    .venv/bin/python bench/xdist_sched.py            # 3 runs of each variant of each suite, about 4 minutes
    .venv/bin/python bench/xdist_sched.py --quick    # 1 run each, about a minute and a half
    .venv/bin/python bench/xdist_sched.py --json figures.json --reps 5
    .venv/bin/python bench/xdist_sched.py --render bench/results/xdist_sched.json   # measure nothing: print it again

Two suites, each under ``-n 4 --sgl-gpus sim:4`` with xdist's ``--dist load``, xdist's ``--dist loadgroup`` and
ours (plain ``-n 4``: ``--sgl-dist auto``), repetitions interleaved (a burst of load hits every variant alike):

- ``e2e``: bench/suites/e2e, 60 tests of 6 worker configurations, one small request each (many configurations,
  fast tests: affinity is what counts);
- ``two_large``: bench/suites/two_large, 2 configurations of 24 tests, each asking for 16 tokens at 12.5 ms a
  token (0.2 s a test, on the engine's side, as a GPU would take it): few, large configurations (work
  stealing is what counts).

The simulated engine starts in 1 s (``SGLSIM_STARTUP_SECONDS``). Launches come from the ``--sgl-report`` JSON,
wall from the whole ``pytest`` process. Goals (issue #16): launches <= configurations + xdist workers - 1, wall
<= the better of load and loadgroup, on both suites. Progress goes to stderr, the table to stdout; the exit
status is 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (  # bench/common.py: the conventions and the provenance of every figure of the bench
    add_render_option,
    clean_env,
    finish_meta,
    fmt_x,
    median,
    print_rendered,
    progress,
    provenance_line,
    start_meta,
)

REPO = Path(__file__).resolve().parent.parent
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {"xdist_sched": ("pytest_sglworker/plugin/xdist_scheduling.py", "pytest_sglworker/plugin/xdist_hooks.py",
                          "pytest_sglworker/plugin/planner.py", "pytest_sglworker/workers/pool.py",
                          "pytest_sglworker/workers/pool_ahead.py", "bench/suites/e2e",
                          "bench/suites/two_large")}
SUITES: dict[str, dict[str, Any]] = {
    "e2e": {"path": REPO / "bench" / "suites" / "e2e", "configurations": 6, "tests": 60,
            "env": {"BENCH_E2E_TESTS_PER_SET": "10"}},
    "two_large": {"path": REPO / "bench" / "suites" / "two_large", "configurations": 2, "tests": 48,
                  "env": {"BENCH_LARGE_TESTS": "24", "BENCH_LARGE_TOKENS": "16", "SGLSIM_TOKEN_SECONDS": "0.0125"}},
}
VARIANTS: dict[str, list[str]] = {
    "load": ["--dist", "load"],
    "loadgroup": ["--dist", "loadgroup"],
    "ours": [],
}
WORKERS = 4
STARTUP = 1.0


@dataclass
class Run:
    suite: str
    variant: str
    wall: float
    rc: int
    passed: int
    launches: int
    steals: int | None
    tail: str


def run_once(workdir: Path, suite: str, variant: str) -> Run:
    spec = SUITES[suite]
    run_dir = Path(tempfile.mkdtemp(prefix=f"{suite}-{variant}-", dir=workdir))
    report = run_dir / "report.json"
    cmd = [sys.executable, "-m", "pytest", str(spec["path"]), "-p", "no:cacheprovider", "--sgl-engine", "sim",
           "--sgl-model", "a,b", "--sgl-gpus", f"sim:{WORKERS}", "-n", str(WORKERS), "--sgl-report", str(report),
           "--sgl-log-dir", str(run_dir / "logs"), "--sgl-lock-dir", str(workdir / "locks"), *VARIANTS[variant]]
    env = clean_env(SGLSIM_STARTUP_SECONDS=str(STARTUP), **spec["env"])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    out = proc.stdout
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", out)) else 0
    steals = int(m.group(1)) if (m := re.search(r"(\d+) of them extra copies by work stealing", out)) else None
    launches = 0
    if report.exists():
        launches = sum(w["launches"] for w in json.loads(report.read_text()).get("workers", {}).values())
    return Run(suite, variant, wall, proc.returncode, passed, launches, steals, "\n".join(out.splitlines()[-15:]))


def summarize(runs: list[Run], suites: list[str], reps: int) -> dict[str, Any]:
    """Every figure of the section, from the runs (medians over the repetitions, the goals)."""
    figures: dict[str, Any] = {"workers": WORKERS, "startup": STARTUP, "reps": reps, "suites": {}}
    for suite in suites:
        spec = SUITES[suite]
        bound = spec["configurations"] + WORKERS - 1
        summary: dict[str, Any] = {}
        for variant in VARIANTS:
            mine = [r for r in runs if r.suite == suite and r.variant == variant]
            summary[variant] = {"wall": median([r.wall for r in mine]), "samples": [round(r.wall, 2) for r in mine],
                                "launches": median([r.launches for r in mine]),
                                "steals": median([r.steals for r in mine if r.steals is not None]),
                                "ok": all(r.rc == 0 and r.passed == spec["tests"] for r in mine)}
        ours = summary["ours"]["wall"]
        best = min(summary["load"]["wall"] or float("inf"), summary["loadgroup"]["wall"] or float("inf"))
        for s in summary.values():
            s["ours_over_variant_wall"] = None if not s["wall"] or ours is None else ours / s["wall"]
        figures["suites"][suite] = {
            "configurations": spec["configurations"], "tests": spec["tests"], "bound": bound, "variants": summary,
            "goal_launches": summary["ours"]["launches"] is not None and summary["ours"]["launches"] <= bound,
            "goal_wall": ours is not None and ours <= best,
            "ours_over_best_wall": None if ours is None or best == float("inf") else ours / best}
    figures["runs"] = [{k: v for k, v in asdict(r).items() if k != "tail"} for r in runs]
    return figures


def render(figures: dict[str, Any]) -> str:
    """The markdown section of bench/README.md ("The xdist scheduler on two suites"), from ``--json``'s file."""
    workers = figures["workers"]
    lines = [f"xdist scheduling by worker configuration: `-n {workers} --sgl-gpus sim:{workers}`, simulated startup "
             f"{figures['startup']:g} s, {figures['reps']} run(s) of each variant, interleaved, median wall; "
             + provenance_line(figures["meta"], "bench/xdist_sched.py"), "",
             "| suite | variant | wall (median) | samples | launches | goal: launches <= | ours / variant (wall) |",
             "|---|---|---|---|---|---|---|"]
    for suite, f in figures["suites"].items():
        for variant, s in f["variants"].items():
            samples = ", ".join(f"{w:.1f}" for w in s["samples"])
            steals = f" ({s['steals']:g} stolen)" if variant == "ours" and s["steals"] is not None else ""
            wall = "-" if s["wall"] is None else f"{s['wall']:.2f} s"
            failed = "" if s["ok"] else " (**a run failed**)"
            lines.append(f"| {suite} ({f['tests']} tests, {f['configurations']} configs) | {variant}{failed} | "
                         f"{wall} | {samples} | {s['launches']:g}{steals} | {f['bound']} | "
                         f"{'1' if variant == 'ours' else fmt_x(s['ours_over_variant_wall'])} |")
    lines.append("")
    for suite, f in figures["suites"].items():
        lines.append(f"- {suite}: launches {f['variants']['ours']['launches']:g} <= {f['bound']}: "
                     f"{'met' if f['goal_launches'] else '**missed**'}; wall ours / best of load and loadgroup = "
                     f"{fmt_x(f['ours_over_best_wall'])}: {'met' if f['goal_wall'] else '**missed**'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 run of each variant (default 3)")
    parser.add_argument("--reps", type=int, default=None, help="runs of each variant of each suite")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure and sample as JSON")
    add_render_option(parser)
    parser.add_argument("--only", default=",".join(SUITES), help=f"suites, comma-separated ({', '.join(SUITES)})")
    args = parser.parse_args(argv)
    if args.render is not None:
        return print_rendered(args.render, render)
    reps = args.reps or (1 if args.quick else 3)
    suites = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(suites) - set(SUITES)
    if unknown:
        parser.error(f"unknown suite(s): {', '.join(sorted(unknown))}")
    t0 = time.perf_counter()
    meta = start_meta(argv if argv is not None else sys.argv[1:])
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="sglworker-xdist-sched-") as tmp:
        workdir = Path(tmp)
        progress("warming up (one unmeasured run)")
        run_once(workdir, suites[0], "ours")
        for rep in range(reps):  # round robin over suites and variants
            for suite in suites:
                for variant in VARIANTS:
                    progress(f"{suite} {variant} {rep + 1}/{reps}")
                    run = run_once(workdir, suite, variant)
                    if run.rc != 0:
                        progress(f"{suite} {variant} exited {run.rc}:\n{run.tail}")
                    runs.append(run)
    finish_meta(meta, time.perf_counter() - t0)
    figures = {"meta": meta, **summarize(runs, suites, reps)}
    sys.stdout.write(render(figures))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    ok = all(r.rc == 0 for r in runs) and all(
        s["ok"] for f in figures["suites"].values() for s in f["variants"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
