#!/usr/bin/env python
"""Part ``xdist`` of ``bench/run.py``: the e2e suite under ``-n 4`` (``--dist load``, ``--dist loadgroup``, the
plugin's scheduler) against ``-n 1``. What each figure means: bench/README.md, "3. xdist". (Not ``xdist.py``: that
name would shadow pytest-xdist for every script of bench/.)

    .venv/bin/python bench/xdist_walls.py --quick   # this part alone: bench/run.py --only xdist
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from common import SUITES, Plan, compare, e2e_env, fmt_ratio, fmt_s, interleaved, suite_table, summary

NAME = "xdist"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {NAME: ("pytest_sglworker/plugin/xdist_scheduling.py", "pytest_sglworker/plugin/xdist_hooks.py",
                   "pytest_sglworker/plugin/planner.py", "pytest_sglworker/workers/pool.py",
                   "pytest_sglworker/workers/pool_ahead.py", "bench/suites/e2e")}

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


def measure(plan: Plan, workdir: Path) -> dict[str, Any]:
    env = e2e_env(plan.xdist_startup, plan.xdist_per_set)
    suite = SUITES / "e2e"
    variants = {k: (suite, [*v, "--sgl-gpus", "sim:4"], env) for k, v in XDIST_VARIANTS.items()}
    runs = interleaved(workdir, variants, plan.xdist_reps, "xdist")
    tests = plan.xdist_per_set * 6
    return {"startup": plan.xdist_startup, "tests": tests, "configurations": 6, "gpus": 4,
            "variants": {k: summary(v, tests) for k, v in runs.items()},
            "walls": {k: compare(runs, k, "n1") for k in XDIST_VARIANTS if k != "n1"}}


# ---------------------------------------------------------------------------------------------- figures


def speed_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Its rows of the README's ``## Speed`` table (what, baseline, ours / baseline, goal)."""
    rows: list[tuple[str, str, str, str]] = []
    meta = results["meta"]
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
    return rows


def speed_notes(results: dict[str, Any]) -> list[str]:
    """Its lines under the README's ``## Speed`` table: why a figure that misses its goal misses it."""
    return []


def details(results: dict[str, Any]) -> list[str]:
    """Its block of bench/README.md's ``## Latest figures``: every figure with its samples."""
    s = results.get(NAME)
    return [*suite_table(s, "3. xdist", XDIST_LABELS), ""] if s else []


def failures(results: dict[str, Any]) -> list[str]:
    """What of its run failed (bench/run.py's exit status is 1 when anything did)."""
    return [f"xdist/{k}" for k, v in results.get(NAME, {}).get("variants", {}).items() if not v["ok"]]


if __name__ == "__main__":  # this part alone, as bench/run.py --only xdist runs it
    import run

    sys.exit(run.main(sys.argv[1:], only="xdist"))
