#!/usr/bin/env python
"""A suite's wall time against the lower bound of any schedule, at GPU-box scale (issue 33).

    .venv/bin/python bench/bound.py                        # 2 rounds of everything, about 25 minutes on 2 CPUs
    .venv/bin/python bench/bound.py --quick                # 1 round, -n 8 only
    .venv/bin/python bench/bound.py --json bench/bound.json
    .venv/bin/python bench/bound.py --render bench/bound.json   # measure nothing: print the section again

**The lower bound.** A suite is a set of worker configurations, each with a known startup (the simulated
engine's ``SGLSIM_STARTUP_SECONDS``), known test times (each test holds its workers that long) and a GPU count
(``tp=1``: 1, ``tp=2``: 2, a 1+1 prefill/decode group: 2). On ``G`` GPUs no schedule that launches each
configuration once can finish before ``max(sum over configurations of GPUs x (startup + tests) / G, the longest
configuration's startup + tests)``. (A schedule that starts extra copies of a configuration, as work stealing
does, can beat the second term, never the first.) **The ratio** is the wall time of the whole ``pytest``
process less pytest's own floor (the same command on an empty selection, ``-k`` matching nothing: the
interpreter, xdist's workers, collection, measured in the same round), over that bound.

**The suites** (bench/suites/gpu_box, its plan written by this script), on 8 declared GPUs (``--sgl-gpus
sim:8``), startups and test times scaled by :data:`SCALE` from what they would be on a GPU box:

- ``box``: 16 configurations, 10 of ``tp=1``, 5 of ``tp=2`` and one prefill/decode pair; startups from 5 to 40
  s, 2 to 8 tests each from 0.1 to 10 s (seeded, so every run has the same plan);
- ``skew``: the worst case for affinity: one huge configuration (30 s to start, 24 tests of 4 s) and 15 small
  ones (5 s to start, 2 tests of 0.5 s).

Each under ``-n 8`` and ``-n 4``, with the plugin's scheduler (plain ``-n``) with pytest's cache (``ours``: a cache
directory of its own per suite and ``-n``, filled by one unmeasured run first and by every round after, so that the
scheduler orders configurations by what earlier runs measured) and without it (``cold``: ``-p no:cacheprovider``, by
test count), the same with the pool as it was before issue 33's fixes (``before``: bench/previous_pool.py patched
into each pytest process), xdist's ``--dist load`` and ``--dist loadgroup``, in rounds, the order rotated from round
to round, so that load on the machine hits every variant alike. From each run's ``--sgl-report`` the script also
reads where the time went: the GPUs' busy share of the run (GPU-seconds leased over GPUs x the span from the first
lease request to the last release), the launches, the seconds the launches waited for a lease, the *tail*: how long
the last configuration ran alone after every other GPU had been given back, and a *late launch*: when the last
configuration asked for its first lease, into the run, with the GPU-seconds left idle before that (free GPUs while a
configuration waited to start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "bench" / "suites" / "gpu_box"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {"bound": ("pytest_sglworker/plugin/xdist_scheduling.py", "pytest_sglworker/plugin/xdist_hooks.py",
                    "pytest_sglworker/plugin/planner.py", "pytest_sglworker/plugin/durations.py",
                    "pytest_sglworker/workers/pool.py", "pytest_sglworker/workers/pool_ahead.py",
                    "pytest_sglworker/workers/pool_parts.py",
                    "bench/suites/gpu_box", "bench/previous_pool.py")}
GPUS = 8
#: seconds on the simulated engine per second on a GPU box: a run of the box suite takes about a minute
SCALE = 0.2
NS = (8, 4)
VARIANTS: dict[str, list[str]] = {"ours": [], "cold": [], "before": ["-p", "previous_pool"],
                                  "load": ["--dist", "load"], "loadgroup": ["--dist", "loadgroup"]}
#: variants that run with pytest's cache (its own directory per suite and -n, filled by an unmeasured run first):
#: the plugin's scheduler orders configurations by what the runs before measured
CACHED = ("ours",)
KIND_GPUS = {"tp1": 1, "tp2": 2, "pd": 2}
_DROPPED_ENV = ("PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
_DROPPED_PREFIXES = ("SGLWORKER_", "SGLSIM_")


# ---------------------------------------------------------------------------------------------- the suites


def box_plan(seed: int = 33) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    kinds = ["tp1"] * 10 + ["tp2"] * 5 + ["pd"]
    rng.shuffle(kinds)
    configs = []
    for i, kind in enumerate(kinds):
        startup = rng.uniform(5, 40)
        tests = [rng.choice((0.1, 0.3, 1.0, 2.0, 5.0, 10.0)) for _ in range(rng.randint(2, 8))]
        configs.append({"name": f"c{i:02d}", "kind": kind, "startup": startup, "tests": tests})
    return configs


def skew_plan() -> list[dict[str, Any]]:
    configs = [{"name": "huge", "kind": "tp1", "startup": 30.0, "tests": [4.0] * 24}]
    configs += [{"name": f"s{i:02d}", "kind": "tp1", "startup": 5.0, "tests": [0.5, 0.5]} for i in range(15)]
    return configs


def scaled(configs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**c, "startup": round(c["startup"] * SCALE, 3), "tests": [round(t * SCALE, 3) for t in c["tests"]]}
            for c in configs]


SUITES = {"box": lambda: scaled(box_plan()), "skew": lambda: scaled(skew_plan())}


def bound(configs: Sequence[dict[str, Any]], gpus: int = GPUS) -> dict[str, float]:
    """The lower bound of any schedule that launches each configuration once (see the module docstring)."""
    work = sum(KIND_GPUS[c["kind"]] * (c["startup"] + sum(c["tests"])) for c in configs)
    longest = max(c["startup"] + sum(c["tests"]) for c in configs)
    return {"gpu_work": work, "work_over_gpus": work / gpus, "longest": longest, "bound": max(work / gpus, longest)}


def bound_at(configs: Sequence[dict[str, Any]], n: int, gpus: int = GPUS) -> dict[str, float]:
    """:func:`bound` at ``-n n`` (bench/box_suites.py's): also no sooner than the tests' seconds over the ``n`` xdist
    workers that run them one at a time."""
    b = bound(configs, gpus)
    tests = sum(sum(c["tests"]) for c in configs) / n
    return {**b, "tests_over_n": tests, "bound": max(b["bound"], tests)}


def first_startups_bound(configs: Sequence[dict[str, Any]], n: int) -> float:
    """A tighter lower bound at ``-n n`` than :func:`bound_at`'s ``tests / n`` term, for schedules that launch each
    configuration once: no xdist worker runs a test before a configuration is ready, and a ready group serves one
    xdist worker at a time, so by time ``t`` at most as many xdist workers run tests as configurations have finished
    starting (and never more than ``n``). The ``i``-th xdist worker to start is idle until the ``i``-th shortest
    startup at the soonest; the bound is the wall ``W`` at which those workers' time, ``sum over i <= n of
    max(0, W - startup_i)``, first holds every test's seconds. Where ``W`` passes the ``n``-th shortest startup it
    is ``(the n shortest startups + the tests' seconds) / n``."""
    startups = sorted(float(c["startup"]) for c in configs)[:max(1, n)]
    tests = sum(sum(c["tests"]) for c in configs)
    waited = 0.0
    for k, startup in enumerate(startups, start=1):
        waited += startup
        wall = (waited + tests) / k
        if k == len(startups) or wall <= startups[k]:
            return wall
    return 0.0  # no configuration: nothing to bound


# ---------------------------------------------------------------------------------------------- running


@dataclass
class Run:
    suite: str
    n: int
    variant: str
    wall: float
    rc: int
    passed: int
    launches: int = 0
    lease_wait: float = 0.0
    busy: float | None = None
    tail: float | None = None
    startup_over: float | None = None
    last_request: float | None = None
    idle_early: float | None = None
    out: str = field(default="", repr=False)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV and not k.startswith(_DROPPED_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(REPO / "bench"), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def progress(text: str) -> None:
    sys.stderr.write(f"  .. {text}\n")
    sys.stderr.flush()


def run_once(workdir: Path, suite: str, configs: Sequence[dict[str, Any]], n: int, variant: str,
             *, floor: bool = False) -> Run:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{suite}-{n}-{variant}-", dir=workdir))
    plan = run_dir / "plan.json"
    plan.write_text(json.dumps({"configurations": list(configs)}))
    report = run_dir / "report.json"
    cache = (["-o", f"cache_dir={workdir / f'cache-{suite}-{n}'}"] if variant in CACHED and not floor
             else ["-p", "no:cacheprovider"])
    cmd = [sys.executable, "-m", "pytest", str(SUITE), *cache, "-q", "--sgl-engine", "sim",
           "--sgl-model", ",".join(c["name"] for c in configs), "--sgl-gpus", f"sim:{GPUS}", "-n", str(n),
           "--sgl-report", str(report), "--sgl-log-dir", str(run_dir / "logs"), "--sgl-lock-dir",
           str(run_dir / "locks"), *VARIANTS[variant]]
    if floor:
        cmd += ["-k", "no_test_is_called_this"]
    env = clean_env(BENCH_BOX_PLAN=str(plan))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", proc.stdout)) else 0
    run = Run(suite, n, "floor" if floor else variant, wall, proc.returncode, passed,
              out="\n".join(proc.stdout.splitlines()[-20:]))
    if report.exists():
        read_report(run, json.loads(report.read_text()), configs)
    return run


def read_report(run: Run, report: dict[str, Any], configs: Sequence[dict[str, Any]]) -> None:
    """Where the time went, from the run report's launch records."""
    launches = [r for r in report.get("launches", []) if r.get("t_leased") and r.get("gpus")]
    run.launches = sum(w["launches"] for w in report.get("workers", {}).values())
    run.lease_wait = sum(w["lease_wait_seconds"] for w in report.get("workers", {}).values())
    if not launches:
        return
    first = min(r["t_lease_requested"] for r in launches)
    ends = [(r.get("t_released") or r.get("t_stopped") or report["finished_at"]) for r in launches]
    last = max(ends)
    held = sum(len(r["gpus"]) * (end - r["t_leased"]) for r, end in zip(launches, ends, strict=True))
    run.busy = held / (GPUS * (last - first)) if last > first else None
    # the tail: from the moment every GPU but the last configuration's was given back to the run's last release
    last_config = max(zip(ends, launches, strict=True), key=lambda p: p[0])[1]["config"]
    others = [end for end, r in zip(ends, launches, strict=True) if r["config"] != last_config]
    run.tail = last - max(others) if others else None
    # a late launch: when the last configuration's first lease was asked for, into the run; and the GPU-seconds
    # left idle before it (free GPUs while a configuration had still not asked for its lease)
    firsts: dict[str, float] = {}
    for r in launches:
        firsts[r["config"]] = min(firsts.get(r["config"], r["t_lease_requested"]), r["t_lease_requested"])
    late = max(firsts.values())
    run.last_request = late - first
    edges = (t for r, end in zip(launches, ends, strict=True) for t in (r["t_leased"], end))
    steps = [*sorted(t for t in edges if first <= t <= late), late]
    idle, t0 = 0.0, first
    for t in steps:
        held = sum(len(r["gpus"]) for r, end in zip(launches, ends, strict=True) if r["t_leased"] <= t0 < end)
        idle += max(0, GPUS - held) * (t - t0)
        t0 = t
    run.idle_early = idle
    declared = {c["name"]: c["startup"] for c in configs}
    over = [r["t_ready"] - r["t_started"] - declared.get(r["label"].split()[0], 0.0)
            for r in launches if r.get("t_ready") and r.get("t_started")]
    run.startup_over = statistics.median(over) if over else None


# ---------------------------------------------------------------------------------------------- figures


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: Sequence[Run], suites: Sequence[str], ns: Sequence[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for suite in suites:
        configs = SUITES[suite]()
        b = bound(configs)
        per_n: dict[str, Any] = {}
        for n in ns:
            floors = [r.wall for r in runs if r.suite == suite and r.n == n and r.variant == "floor"]
            floor = median(floors) or 0.0
            variants: dict[str, Any] = {}
            for variant in VARIANTS:
                mine = [r for r in runs if r.suite == suite and r.n == n and r.variant == variant]
                walls = [r.wall for r in mine]
                wall = median(walls)
                variants[variant] = {
                    "wall": wall, "samples": [round(w, 2) for w in walls],
                    "ratio": None if wall is None else (wall - floor) / b["bound"],
                    "ratios": [round((w - floor) / b["bound"], 3) for w in walls],
                    "launches": median([r.launches for r in mine]),
                    "lease_wait": median([r.lease_wait for r in mine]),
                    "busy": median([r.busy for r in mine if r.busy is not None]),
                    "tail": median([r.tail for r in mine if r.tail is not None]),
                    "startup_over": median([r.startup_over for r in mine if r.startup_over is not None]),
                    "last_request": median([r.last_request for r in mine if r.last_request is not None]),
                    "idle_early": median([r.idle_early for r in mine if r.idle_early is not None]),
                    "ok": all(r.rc == 0 and r.passed == sum(len(c["tests"]) for c in configs) for r in mine),
                }
            per_n[str(n)] = {"floor": floor, "floor_samples": [round(f, 2) for f in floors], "variants": variants}
        out[suite] = {"configurations": configs, "bound": b, "tests": sum(len(c["tests"]) for c in configs),
                      "n": per_n}
    return out


def fmt(value: float | None, unit: str = " s", digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def render(figures: dict[str, Any]) -> str:
    lines = ["### A suite's wall time against its lower bound (`bench/bound.py`)", "",
             f"{figures['machine']}; `bench/bound.py` {figures['settings']}; {figures['date']}, "
             f"{figures['seconds']} s, load average {figures['load_before']} before, {figures['load_after']} "
             "after.", ""]
    for suite, f in figures["suites"].items():
        b = f["bound"]
        kinds = {k: sum(1 for c in f["configurations"] if c["kind"] == k) for k in KIND_GPUS}
        lines += [f"**{suite}**: {len(f['configurations'])} configurations ({kinds['tp1']} tp=1, {kinds['tp2']} "
                  f"tp=2, {kinds['pd']} prefill/decode pair(s)), {f['tests']} tests, on `--sgl-gpus sim:{GPUS}`, "
                  f"times x{SCALE:g}; GPU-work {b['gpu_work']:.1f} s / {GPUS} = {b['work_over_gpus']:.1f} s, longest "
                  f"configuration {b['longest']:.1f} s: **bound {b['bound']:.1f} s**.", "",
                  "| `-n` | variant | wall (median) | less the floor | / bound (median, rounds) | launches | lease "
                  "wait | GPUs busy | tail alone | last launch asked at | GPU-s idle before it | startup beyond "
                  "declared | ok |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for n, per in f["n"].items():
            for variant, v in per["variants"].items():
                rounds = ", ".join(f"{r:.2f}" for r in v["ratios"])
                less = None if v["wall"] is None else v["wall"] - per["floor"]
                lines.append(
                    f"| {n} | {variant} | {fmt(v['wall'])} | {fmt(less)} | **{fmt(v['ratio'], 'x', 2)}** ({rounds}) | "
                    f"{fmt(v['launches'], '', 0)} | "
                    f"{fmt(v['lease_wait'])} | {fmt(None if v['busy'] is None else 100 * v['busy'], ' %', 0)} | "
                    f"{fmt(v['tail'])} | {fmt(v.get('last_request'))} | {fmt(v.get('idle_early'))} | "
                    f"{fmt(v['startup_over'], ' s', 2)} | {'yes' if v['ok'] else 'NO'} |")
        floors = "; ".join(f"-n {n}: {fmt(per['floor'], ' s', 2)}" for n, per in f["n"].items())
        lines += ["", f"pytest's own floor (the same command, nothing selected): {floors}.", ""]
    for suite, f in figures["suites"].items():
        for n, per in f["n"].items():
            v = per["variants"]
            ours = v["ours"]["ratio"] if "ours" in v else None
            best = min((v[k]["ratio"] for k in ("load", "loadgroup") if k in v and v[k]["ratio"] is not None),
                       default=None)
            goal = ours is not None and ours <= 1.15
            lines.append(f"- {suite}, -n {n}: ours {fmt(ours, 'x', 2)} of the bound (goal <= 1.15: "
                         f"{'met' if goal else 'MISSED'}); best of load and loadgroup {fmt(best, 'x', 2)} "
                         f"({'ours better' if ours is not None and best is not None and ours < best else 'NOT better'})"
                         )
    return "\n".join(lines)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "pytest_sglworker", "bench"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}; commit `{commit}`"
            + (" (with uncommitted changes)" if dirty else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round, -n 8 only")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 2)")
    parser.add_argument("--only", default=",".join(SUITES), help=f"suites ({', '.join(SUITES)})")
    parser.add_argument("--n", default=None, help="xdist worker counts, comma-separated (default 8,4)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="variants (default all)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure and sample as JSON")
    parser.add_argument("--render", type=Path, default=None, help="measure nothing: print the section from JSON")
    args = parser.parse_args(argv)
    if args.render is not None:
        print(render(json.loads(args.render.read_text())))
        return 0
    rounds = args.rounds or (1 if args.quick else 2)
    suites = [s for s in args.only.split(",") if s]
    ns = [int(n) for n in (args.n or ("8" if args.quick else ",".join(map(str, NS)))).split(",")]
    variants = [v for v in args.variants.split(",") if v]
    started, load_before = time.time(), os.getloadavg()[0]
    runs: list[Run] = []
    jobs = [(s, n, v) for s in suites for n in ns for v in ["floor", *variants]]
    with tempfile.TemporaryDirectory(prefix="sglworker-bound-") as tmp:
        workdir = Path(tmp)
        progress("warming up (one unmeasured floor run)")
        run_once(workdir, suites[0], SUITES[suites[0]](), ns[0], "ours", floor=True)
        for suite, n in {(s, n) for s, n, v in jobs if v in CACHED}:
            progress(f"filling the cache: {suite} -n {n} (unmeasured)")
            run_once(workdir, suite, SUITES[suite](), n, "ours")
        for r in range(rounds):
            order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]
            for suite, n, variant in order:
                progress(f"round {r + 1}/{rounds}: {suite} -n {n} {variant}")
                run = run_once(workdir, suite, SUITES[suite](), n, variant if variant != "floor" else "ours",
                               floor=variant == "floor")
                if run.rc not in (0, 5):
                    progress(f"exit {run.rc}:\n{run.out}")
                runs.append(run)
    figures = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
               "seconds": round(time.time() - started), "machine": machine(),
               "settings": f"--rounds {rounds} --only {','.join(suites)} --n {','.join(map(str, ns))}",
               "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
               "gpus": GPUS, "scale": SCALE, "suites": summarize(runs, suites, ns),
               "runs": [{k: v for k, v in asdict(r).items() if k != "out"} for r in runs]}
    for suite in figures["suites"].values():
        for per in suite["n"].values():
            per["variants"] = {k: v for k, v in per["variants"].items() if k in variants}
    print(render(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if all(r.rc in (0, 5) if r.variant == "floor" else r.rc == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
