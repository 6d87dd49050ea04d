#!/usr/bin/env python
"""Part ``groups`` of ``bench/run.py``: how long a 1+1 prefill/decode group and a 4-worker group take against their
slowest member's startup; the plugin's router against a bare copy of it polled every millisecond. What each figure
means: bench/README.md, "5. Groups and the router".

    .venv/bin/python bench/groups.py --quick        # this part alone: bench/run.py --only groups
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import SUITES, Plan, fmt_ratio, fmt_s, fmt_x, goal, median, progress, ratio, run_suite

NAME = "groups"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {NAME: ("pytest_sglworker/workers/group.py", "pytest_sglworker/workers/router.py",
                   "pytest_sglworker/workers/pool.py",
                   "pytest_sglworker/workers/pool_ahead.py", "pytest_sglworker/workers/health.py",
                   "pytest_sglworker/sim/pd.py", "bench/suites/groups")}
GROUP_GOAL = 1.1  # issue 16: group ready / slowest member's startup <= 1.1


def measure(plan: Plan, workdir: Path) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------- figures


def speed_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Its rows of the README's ``## Speed`` table (what, baseline, ours / baseline, goal)."""
    rows: list[tuple[str, str, str, str]] = []
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
    return rows


def speed_notes(results: dict[str, Any]) -> list[str]:
    """Its lines under the README's ``## Speed`` table: why a figure that misses its goal misses it."""
    notes: list[str] = []
    g = results.get("groups")
    if g and g.get("router") and g["router"]["ratio"] is not None and g["router"]["ratio"] > GROUP_GOAL:
        notes.append(
            "- **The router's wait:** it has no ready line to watch (`wait_until_ready(..., ready_line=None)`), so "
            "after each not-ready answer (`/workers` not yet listing every worker healthy) it polls again only "
            "0.1 s later, and its last probe pays the same ownership check as a worker's; the bare copy polls "
            "every millisecond.")
    return notes


def details(results: dict[str, Any]) -> list[str]:
    """Its block of bench/README.md's ``## Latest figures``: every figure with its samples."""
    out: list[str] = []
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
    return out


def failures(results: dict[str, Any]) -> list[str]:
    """What of its run failed (bench/run.py's exit status is 1 when anything did)."""
    return ["groups"] if NAME in results and not results[NAME]["ok"] else []


if __name__ == "__main__":  # this part alone, as bench/run.py --only groups runs it
    import run

    sys.exit(run.main(sys.argv[1:], only="groups"))
