#!/usr/bin/env python
"""Part ``reuse`` of ``bench/run.py``: an e2e suite of 6 worker configurations, the pool against ``--sgl-reuse
off``; then a 2-worker regular group and a 1+1 prefill/decode group, each over 20 tests, pooled against
``--sgl-reuse off``. What each figure means: bench/README.md, "2. Reuse".

    .venv/bin/python bench/reuse.py --quick         # this part alone: bench/run.py --only reuse
"""

from __future__ import annotations

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
    interleaved,
    suite_table,
    summary,
    variant_rows,
)

NAME = "reuse"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {NAME: ("pytest_sglworker/workers/pool.py",
                   "pytest_sglworker/workers/pool_ahead.py", "pytest_sglworker/workers/pool_parts.py",
                   "pytest_sglworker/workers/group.py", "pytest_sglworker/plugin/fixtures.py",
                   "pytest_sglworker/plugin/session.py", "bench/suites/e2e", "bench/suites/group_reuse")}
VARIANT_NAMES = {"pool": "pool (default)", "reuse-off": "`--sgl-reuse off`"}


def measure(plan: Plan, workdir: Path) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------- figures


def speed_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Its rows of the README's ``## Speed`` table (what, baseline, ours / baseline, goal)."""
    rows: list[tuple[str, str, str, str]] = []
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
    return rows


def speed_notes(results: dict[str, Any]) -> list[str]:
    """Its lines under the README's ``## Speed`` table: why a figure that misses its goal misses it."""
    notes: list[str] = []
    return notes


def details(results: dict[str, Any]) -> list[str]:
    """Its block of bench/README.md's ``## Latest figures``: every figure with its samples."""
    out: list[str] = []
    s = results.get(NAME)
    if s:
        out += suite_table(s, "2. Reuse", VARIANT_NAMES)
        for shape, desc in GROUP_REUSE_SHAPES.items():
            gs = s.get("groups", {}).get(shape)
            if not gs:
                continue
            out += ["", f"{desc[0].upper()}{desc[1:]} ({gs['tests']} tests, one configuration, `sim:{gs['gpus']}`, "
                    f"{gs['members']} processes a launch):", "",
                    "| variant | wall (median) | samples | group launches | GPU-seconds | ok |",
                    "|---|---|---|---|---|---|", *variant_rows(gs["variants"], VARIANT_NAMES)]
        out.append("")
    return out


def failures(results: dict[str, Any]) -> list[str]:
    """What of its run failed (bench/run.py's exit status is 1 when anything did)."""
    u = results.get(NAME, {})
    bad = [f"reuse/{k}" for k, v in u.get("variants", {}).items() if not v["ok"]]
    return bad + [f"reuse/{shape}/{k}" for shape, g in u.get("groups", {}).items()
                  for k, v in g["variants"].items() if not v["ok"]]


if __name__ == "__main__":  # this part alone, as bench/run.py --only reuse runs it
    import run

    sys.exit(run.main(sys.argv[1:], only="reuse"))
