#!/usr/bin/env python
"""Benchmark of ``--sgl-keep-warm``: an unchanged suite run twice, with the option against without it, side by side.

Run by hand from the repository root::

    .venv/bin/python bench/warm.py                    # 3 rounds on the simulated engine, then 1 on the real engine
    .venv/bin/python bench/warm.py --no-real          # the simulated engine only (about 5 minutes)
    .venv/bin/python bench/warm.py --rounds 1 --json warm.json
    .venv/bin/python bench/warm.py --render bench/results/warm.json   # measure nothing: print the section again

The suite is ``bench/suites/warm``: 3 worker configurations, ``BENCH_WARM_TESTS`` tests each (4), every test sending
``/generate`` requests for ``BENCH_WARM_TEST_SECONDS`` (1.0 s), so that its own time is the same whatever the engine.
A **pair** is two runs of it, one right after the other, on a lock directory of their own: the **warm** pair runs
both with ``--sgl-keep-warm`` (the second adopts what the first kept), the **cold** pair both without (today's
behaviour); after a warm pair ``pytest --sgl-warm stop`` ends what it kept (not timed). Each round runs one pair of
each kind, their order rotated from round to round, so that a burst of load hits both alike. Figures, each the
median over rounds with the range of the per-round values:

- **second-run launches**: the launches of the second run of a pair (goal for the warm pair: 0), and its adoptions;
- **second-run wall / tests' own time**: the wall of the second run's whole ``pytest`` process against the sum of
  its tests' call phases (from the run report's launch records) (goal for the warm pair: at most 1.1);
- **cost when nothing is warm**: the wall of the first run of the warm pair (``--sgl-keep-warm``, nothing warm to
  adopt: each pooled group starts with a keeper, and is handed to it at the end) against the first run of the cold
  pair (goal: at most 1.02).

The simulated engine starts in ``SGLSIM_STARTUP_SECONDS=5`` (a realistic startup); the real engine is sglang on a
CPU with the tiny model (``scripts/install-real-engine.sh``), one round. The environment of the measured processes
is cleaned as in ``bench/common.py`` (``clean_env``) and this tree's package is first on ``PYTHONPATH``. Prints one
markdown section (bench/README.md, "Warm between runs"); ``--json PATH`` writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (  # bench/common.py: the conventions and the machine line of every figure of the bench
    REPO,
    SUITES,
    add_render_option,
    clean_env,
    finish_meta,
    fmt_ratio,
    fmt_s,
    median,
    print_rendered,
    progress,
    provenance_line,
    ratio,
    start_meta,
    warm_bytecode,
)

SUITE = SUITES / "warm"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {"warm": ("pytest_sglworker/workers/warm.py", "pytest_sglworker/resources/warm.py",
                   "pytest_sglworker/resources/warm_keeper.py", "pytest_sglworker/resources/warm_records.py",
                   "pytest_sglworker/workers/pool.py", "pytest_sglworker/workers/pool_ahead.py", "bench/suites/warm")}
SIM_STARTUP = 5.0
RATIO_GOAL = 1.1
COST_GOAL = 1.02


def run_once(workdir: Path, lock_dir: Path, label: str, args: list[str], env_extra: dict[str, str]) -> dict[str, Any]:
    """One ``pytest`` of the suite: its wall, outcome and the figures of its run report."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=workdir))
    report_path = run_dir / "report.json"
    cmd = [sys.executable, "-m", "pytest", str(SUITE), "-p", "no:cacheprovider", "--sgl-report", str(report_path),
           "--sgl-log-dir", str(run_dir / "logs"), "--sgl-lock-dir", str(lock_dir), *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=clean_env(**env_extra), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", proc.stdout)) else 0
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    spans = [t["t_end"] - t["t_start"] for launch in report.get("launches", []) for t in launch.get("tests", [])
             if t.get("t_end") is not None and t.get("t_start") is not None]
    starts = [t["t_start"] for launch in report.get("launches", []) for t in launch.get("tests", [])
              if t.get("t_start") is not None]
    warm = report.get("warm", {})
    result = {
        "label": label, "wall": wall, "rc": proc.returncode, "passed": passed,
        "launches": sum(w["launches"] for w in report.get("workers", {}).values()),
        "adopted": len(warm.get("adopted", [])), "kept": len(warm.get("kept", [])),
        "refused": [r.get("why") for r in warm.get("refused", [])],
        "tests_seconds": sum(spans),
        "before_first_test": (min(starts) - report["started_at"]) if starts and "started_at" in report else None,
    }
    if proc.returncode != 0:
        progress(f"{label} exited {proc.returncode}:\n" + "\n".join(proc.stdout.splitlines()[-20:]))
    return result


def stop_warm(lock_dir: Path) -> None:
    """``pytest --sgl-warm stop`` on the pair's lock directory, then wait (bounded) until nothing is warm there."""
    subprocess.run([sys.executable, "-m", "pytest", "--sgl-warm", "stop", "-p", "no:cacheprovider",
                    "--sgl-lock-dir", str(lock_dir)], env=clean_env(), cwd=SUITE, stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while list(lock_dir.glob("warm-*.json")) and time.monotonic() < deadline:
        time.sleep(0.1)


def pytest_floor(args: list[str], env: dict[str, str]) -> float:
    """The wall of ``pytest --collect-only`` of the suite: what any run of it costs before and around its tests
    (interpreter, imports, plugins, collection), with no worker at all."""
    cmd = [sys.executable, "-m", "pytest", str(SUITE), "-p", "no:cacheprovider", "--collect-only", "-q", *args]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=clean_env(**env), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return time.perf_counter() - t0


def run_pair(workdir: Path, kind: str, rnd: int, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    lock_dir = workdir / f"locks-{kind}-{rnd}"
    keep = ["--sgl-keep-warm"] if kind == "warm" else []
    progress(f"{kind} pair, round {rnd + 1}: first run")
    first = run_once(workdir, lock_dir, f"{kind}-{rnd}-first", [*args, *keep], env)
    progress(f"{kind} pair, round {rnd + 1}: second run")
    second = run_once(workdir, lock_dir, f"{kind}-{rnd}-second", [*args, *keep], env)
    if kind == "warm":
        stop_warm(lock_dir)
    return {"first": first, "second": second}


def measure(workdir: Path, engine: str, rounds: int, args: list[str], env: dict[str, str],
            tests: int) -> dict[str, Any]:
    pairs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    floors: list[float] = []
    for rnd in range(rounds):
        for kind in (("cold", "warm") if rnd % 2 == 0 else ("warm", "cold")):
            pairs[kind].append(run_pair(workdir, kind, rnd, args, env))
        floors.append(pytest_floor(args, env))

    def per_round(kind: str, run: str, key: str) -> list[Any]:
        return [p[run][key] for p in pairs[kind]]

    def own_ratio(kind: str) -> list[float]:
        return [r for p in pairs[kind] if (r := ratio(p["second"]["wall"], p["second"]["tests_seconds"]))]

    costs = [r for w, c in zip(pairs["warm"], pairs["cold"], strict=True)
             if (r := ratio(w["first"]["wall"], c["first"]["wall"])) is not None]
    ok = all(p[run]["rc"] == 0 and p[run]["passed"] == tests for k in pairs for p in pairs[k] for run in p)
    return {
        "engine": engine, "rounds": rounds, "tests": tests, "configurations": 3, "ok": ok, "pairs": pairs,
        "second_launches": {k: per_round(k, "second", "launches") for k in pairs},
        "second_adopted": {k: per_round(k, "second", "adopted") for k in pairs},
        "second_wall": {k: per_round(k, "second", "wall") for k in pairs},
        "second_tests_seconds": {k: per_round(k, "second", "tests_seconds") for k in pairs},
        "second_before_first_test": {k: per_round(k, "second", "before_first_test") for k in pairs},
        "first_wall": {k: per_round(k, "first", "wall") for k in pairs},
        "second_ratio": {k: own_ratio(k) for k in pairs},
        "cost": costs,
        "pytest_floor": floors,
    }


def _range(values: list[float]) -> tuple[float, float] | None:
    return (min(values), max(values)) if len(values) > 1 else None


def render(results: dict[str, Any]) -> str:
    """The markdown section of bench/README.md ("Warm between runs"), from ``--json``'s file."""
    lines = ["### Warm between runs (`bench/warm.py`)", "", provenance_line(results["meta"], "bench/warm.py"), ""]
    for part in ("sim", "real"):
        r = results.get(part)
        if r is None:
            continue
        if "skipped" in r:
            lines += [f"**{part}**: skipped ({r['skipped']})", ""]
            continue
        what = (f"simulated engine, startup {SIM_STARTUP:g} s" if part == "sim"
                else "the real sglang on a CPU, the tiny model")
        lines += [f"**{what}** (3 configurations x {r['tests'] // 3} tests, each test's own time "
                  f"{results['meta']['test_seconds']:g} s; {r['rounds']} round(s) of a cold and a warm pair, "
                  f"interleaved; all runs passed: {'yes' if r['ok'] else '**no**'}):", "",
                  "| second run of a pair | launches | adopted | wall | tests' own time | before its first test | "
                  "wall / tests' own time | beyond the tests and pytest's own floor |",
                  "|---|---|---|---|---|---|---|---|"]
        for kind, name in (("cold", "without `--sgl-keep-warm` (today)"), ("warm", "with `--sgl-keep-warm`")):
            ratios = r["second_ratio"][kind]
            beyond = [w - t - f for w, t, f in zip(r["second_wall"][kind], r["second_tests_seconds"][kind],
                                                   r["pytest_floor"], strict=False)]
            lines.append(
                f"| {name} | {', '.join(map(str, r['second_launches'][kind]))} | "
                f"{', '.join(map(str, r['second_adopted'][kind]))} | {fmt_s(median(r['second_wall'][kind]))} | "
                f"{fmt_s(median(r['second_tests_seconds'][kind]))} | "
                f"{fmt_s(median(r['second_before_first_test'][kind]))} | "
                f"{fmt_ratio(median(ratios), _range(ratios))} | "
                f"{fmt_s(median(beyond))} |")
        warm_ratio = median(r["second_ratio"]["warm"])
        ratio_met = warm_ratio is not None and warm_ratio <= RATIO_GOAL
        launches = max(r["second_launches"]["warm"], default=None)
        cost = median(r["cost"])
        lines += ["",
                  f"- second-run launches with `--sgl-keep-warm`: {launches} (goal 0: "
                  f"{'met' if launches == 0 else '**missed**'})",
                  f"- second-run wall / tests' own time with `--sgl-keep-warm`: {fmt_ratio(warm_ratio, None)} (goal at "
                  f"most {RATIO_GOAL:g}: {'met' if ratio_met else '**missed**'}); without: "
                  f"{fmt_ratio(median(r['second_ratio']['cold']), None)}",
                  f"- cost when nothing is warm (first run with `--sgl-keep-warm` / first run without): "
                  f"{fmt_ratio(cost, _range(r['cost']))} (goal at most {COST_GOAL:g}: "
                  f"{'met' if cost is not None and cost <= COST_GOAL else '**missed**'}); first-run walls "
                  f"{fmt_s(median(r['first_wall']['warm']))} and {fmt_s(median(r['first_wall']['cold']))}",
                  f"- pytest's own floor (`--collect-only` of the suite, no worker): "
                  f"{fmt_s(median(r['pytest_floor']))}", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds on the simulated engine (default 3)")
    parser.add_argument("--no-real", action="store_true", help="skip the real engine")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulated engine")
    parser.add_argument("--real-engine", default=None, metavar="VENV",
                        help="the real engine's venv (default: $SGLWORKER_REAL_ENGINE, else .cache/real-engine)")
    parser.add_argument("--tests", type=int, default=4, help="tests per configuration (default 4)")
    parser.add_argument("--test-seconds", type=float, default=1.0, help="each test's own time (default 1.0)")
    parser.add_argument("--json", type=Path, default=None, help="also write every sample as JSON")
    add_render_option(parser)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    ns = parser.parse_args(argv)
    if ns.render is not None:
        return print_rendered(ns.render, render)
    real_engine = ns.real_engine or os.environ.get("SGLWORKER_REAL_ENGINE")
    for key in list(os.environ):
        if key.startswith(("SGLWORKER_", "SGLSIM_")) or key in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
            del os.environ[key]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(REPO))
    t_start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="sglworker-bench-warm-"))
    results: dict[str, Any] = {"meta": {**start_meta(argv if argv is not None else sys.argv[1:]),
                                        "test_seconds": ns.test_seconds}}
    tests = 3 * ns.tests
    env = {"BENCH_WARM_TESTS": str(ns.tests), "BENCH_WARM_TEST_SECONDS": str(ns.test_seconds)}
    try:
        warm_bytecode()
        if not ns.no_sim:
            results["sim"] = measure(workdir, "sim", ns.rounds, ["--sgl-engine", "sim", "--sgl-model", "a"],
                                     {**env, "SGLSIM_STARTUP_SECONDS": str(SIM_STARTUP)}, tests)
        if not ns.no_real:
            results["real"] = bench_real(workdir, real_engine, env, tests)
    finally:
        if ns.keep:
            progress(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    finish_meta(results["meta"], time.perf_counter() - t_start)
    sys.stdout.write(render(results))
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        progress(f"figures written to {ns.json}")
    bad = [part for part in ("sim", "real") if part in results and not results[part].get("ok", True)]
    for part in bad:
        progress(f"FAILED: a run of part {part}")
    return 1 if bad else 0


def bench_real(workdir: Path, root: str | None, env: dict[str, str], tests: int) -> dict[str, Any]:
    from pytest_sglworker.engine.cpu_engine import (
        build_tiny_model,
        real_engine_launcher,
        real_engine_missing_reason,
        real_engine_python,
    )

    python = real_engine_python(root)
    if python is None:
        return {"skipped": real_engine_missing_reason(root)}
    progress("real: the tiny model (cached in .cache/bench-tiny-model)")
    model = build_tiny_model(python, REPO / ".cache" / "bench-tiny-model")
    args = ["--sgl-engine", "real", "--sgl-model", "real", "--sgl-launcher", shlex.join(real_engine_launcher(python)),
            "--sgl-gpus", "sim:3", "--sgl-startup-timeout", "900"]
    return measure(workdir, "real", 1, args, {**env, "BENCH_WARM_REAL_MODEL": str(model)}, tests)


if __name__ == "__main__":
    sys.exit(main())
