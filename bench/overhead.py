#!/usr/bin/env python
"""Part ``overhead`` of ``bench/run.py``: the plugin installed but unused: trivial suites of 300 and 3000 tests with
and without ``-p no:sglworker``; the import of the plugin against the import of pytest. What each figure means:
bench/README.md, "6. Installed but unused".

    .venv/bin/python bench/overhead.py --quick      # this part alone: bench/run.py --only overhead
"""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import Plan, clean_env, fmt_range, fmt_ratio, fmt_s, goal, median, progress, ratio, spread

NAME = "overhead"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit):
#: the plugin's hooks and the modules a run that uses no worker imports
MEASURES = {NAME: ("pytest_sglworker/plugin", "pytest_sglworker/__init__.py")}
OVERHEAD_GOAL = 1.03  # issue 16: installed but unused / -p no:sglworker <= 1.03


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


def measure(plan: Plan, workdir: Path) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------- figures


def speed_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Its rows of the README's ``## Speed`` table (what, baseline, ours / baseline, goal)."""
    rows: list[tuple[str, str, str, str]] = []
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
    return rows


def speed_notes(results: dict[str, Any]) -> list[str]:
    """Its lines under the README's ``## Speed`` table: why a figure that misses its goal misses it."""
    notes: list[str] = []
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


def details(results: dict[str, Any]) -> list[str]:
    """Its block of bench/README.md's ``## Latest figures``: every figure with its samples."""
    out: list[str] = []
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
    return out


def failures(results: dict[str, Any]) -> list[str]:
    """What of its run failed (bench/run.py's exit status is 1 when anything did)."""
    return []


if __name__ == "__main__":  # this part alone, as bench/run.py --only overhead runs it
    import run

    sys.exit(run.main(sys.argv[1:], only="overhead"))
