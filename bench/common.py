"""What every part of ``bench/run.py`` shares: the sizes of a run (:class:`Plan`), the environment of a measured
process, the statistics (a ratio of medians and the range of the per-round ratios), the formatting of figures, the
provenance every benchmark's JSON carries (``machine``, ``start_meta``, ``finish_meta``, ``provenance_line``) and
the runs of a bench suite (``run_suite``, ``interleaved``, ``summary``, ``compare``). The other benchmarks
(``bench/warm.py``, ``bench/timeline.py``, ``bench/xdist_sched.py``, ``bench/ray_cluster.py``) import their
conventions from here too. Each part of ``bench/run.py`` is a module of its own (``bench/run.py`` lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
SUITES = BENCH / "suites"


#: Variables that would change what is measured: dropped from every measured process.
_DROPPED_ENV = ("PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
_DROPPED_PREFIXES = ("SGLWORKER_", "SGLSIM_")


# ---------------------------------------------------------------------------------------------- plumbing


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (``--quick`` shrinks them)."""

    quick: bool
    ready_startup: float  # simulated startup of the readiness launches
    ready_reps: int  # launches per method and mode
    sglang_reps: int  # launches with the real 10 s interval (0: analytical only)
    real: bool  # launch the real engine (part real)
    reuse_startup: float
    reuse_per_set: int  # tests per argument set and model (x 3 sets x 2 models)
    reuse_reps: int
    reuse_group_tests: int  # tests of each group shape (part reuse)
    xdist_startup: float
    xdist_per_set: int
    xdist_reps: int
    ahead_startup: float
    ahead_per_set: int
    ahead_reps: int
    group_startup: float
    group_reps: int  # groups of each shape launched
    router_reps: int  # routers launched
    overhead_sizes: tuple[int, ...]  # trivial suites (tests)
    overhead_reps: tuple[int, ...]  # runs of each variant, per size
    import_reps: int
    soak_launches: int


FULL = Plan(quick=False, ready_startup=1.0, ready_reps=5, sglang_reps=3, real=True,
            reuse_startup=1.0, reuse_per_set=5, reuse_reps=2, reuse_group_tests=20,
            xdist_startup=1.0, xdist_per_set=10, xdist_reps=2,
            ahead_startup=5.0, ahead_per_set=10, ahead_reps=2,
            group_startup=5.0, group_reps=3, router_reps=4,
            overhead_sizes=(300, 3000), overhead_reps=(11, 15), import_reps=15, soak_launches=300)
QUICK = Plan(quick=True, ready_startup=0.3, ready_reps=2, sglang_reps=0, real=False,
             reuse_startup=0.2, reuse_per_set=2, reuse_reps=1, reuse_group_tests=20,
             xdist_startup=0.2, xdist_per_set=3, xdist_reps=1,
             ahead_startup=1.0, ahead_per_set=3, ahead_reps=1,
             group_startup=1.0, group_reps=1, router_reps=2,
             overhead_sizes=(300, 1000), overhead_reps=(3, 3), import_reps=5, soak_launches=40)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a measured process: bytecode caching on (as users have it), no plugin settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in _DROPPED_ENV and not k.startswith(_DROPPED_PREFIXES)}
    env.update(extra)
    return env


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def spread(pairs: Sequence[tuple[float | None, float | None]]) -> tuple[float, float] | None:
    """The range of the per-round ratios candidate / baseline (rounds are interleaved)."""
    ratios = [r for a, b in pairs if (r := ratio(a, b)) is not None]
    return (min(ratios), max(ratios)) if ratios else None


def fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 10:
        return f"{value:.1f} s"
    if abs(value) >= 1:
        return f"{value:.2f} s"
    if abs(value) >= 0.0095:
        return f"{value * 1000:.0f} ms"
    return f"{value * 1000:.1f} ms"


def fmt_x(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    if value >= 0.095:
        return f"{value:.2f}x"
    if value >= 0.0095:
        return f"{value:.3f}x"
    return f"{value:.4f}x"


def fmt_ratio(value: float | None, rng: tuple[float, float] | None) -> str:
    """``0.53x (0.41-0.88)``: the ratio of the medians, and the range of the per-round ratios."""
    if value is None:
        return "-"
    if rng is None or math.isclose(rng[0], rng[1]):
        return fmt_x(value)
    return f"{fmt_x(value)} ({fmt_x(rng[0]).rstrip('x')}-{fmt_x(rng[1])})"


def fmt_range(values: Sequence[float]) -> str:
    return f"{fmt_s(min(values))}-{fmt_s(max(values))}" if values else "-"


def progress(text: str) -> None:
    sys.stderr.write(f"  .. {text}\n")
    sys.stderr.flush()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])



def warm_bytecode() -> None:
    """Import everything the measured processes import once, with bytecode caching on, so that every
    measured process finds its .pyc files (the environment of this session may disable them)."""
    code = ("import pytest, xdist, httpx, psutil, filelock, pytest_sglworker.plugin, "
            "pytest_sglworker.workers.launcher, pytest_sglworker.workers.pool, pytest_sglworker.resources.gpus, "
            "pytest_sglworker.resources.ports, pytest_sglworker.resources.reaper, pytest_sglworker.sim, "
            "pytest_sglworker.resources.state, pytest_sglworker.workers.router\n"
            "for name in ('diagnosis', 'ledger', 'xdist_scheduling', 'sim_pd'):\n"
            "    try: __import__('pytest_sglworker.' + name)\n"
            "    except ImportError: pass\n")
    subprocess.run([sys.executable, "-c", code], env=clean_env(), check=True, cwd=REPO)


def machine() -> dict[str, Any]:
    """What the figures ran on: CPU model, cores, memory, Python, the commit and what differs from it."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024)
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    # what the measured code (the package, the bench) has that the commit has not; not the figures' JSON
    # (bench/results/, bench/bound.json), which bench/all.py writes while the later benchmarks run
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "pytest_sglworker", "bench").splitlines()
             if len(line) > 3 and not line[3:].endswith((".pyc", "/", ".json"))]
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": mem_gib, "python": platform.python_version(),
            "platform": platform.platform(), "commit": git("rev-parse", "--short=7", "HEAD").strip() or "unknown",
            "dirty": dirty}


def add_render_option(parser: argparse.ArgumentParser) -> None:
    """``--render JSON``, the same in every bench script: measure nothing, print the section(s) again from a JSON
    file the script wrote with ``--json`` (:func:`print_rendered`)."""
    parser.add_argument("--render", type=Path, default=None, metavar="JSON",
                        help="measure nothing: print the section(s) again from an earlier --json file")


def print_rendered(path: Path, render: Callable[[dict[str, Any]], str]) -> int:
    """What ``--render`` does: the section(s) ``render`` makes of the JSON at ``path``, on stdout; exit status 0."""
    sys.stdout.write(render(json.loads(path.read_text())))
    return 0


def start_meta(argv: Sequence[str]) -> dict[str, Any]:
    """The provenance every benchmark's JSON carries, as its run begins: the date, the machine (``machine()``: the
    commit and what differs from it), the settings (the script's command line) and the load average before."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "argv": shlex.join(argv), "load_before": round(os.getloadavg()[0], 2)}


def finish_meta(meta: dict[str, Any], seconds: float) -> None:
    """The rest of it, as the run ends: the load average after and the run's duration."""
    meta["load_after"] = round(os.getloadavg()[0], 2)
    meta["total_seconds"] = round(seconds, 1)


def provenance_line(meta: dict[str, Any], script: str) -> str:
    """The line under every rendered section that says where its figures ran (``start_meta``, ``finish_meta``)."""
    return where_and_when(meta, f"`{script}{' ' + meta['argv'] if meta['argv'] else ''}`")


def where_and_when(meta: dict[str, Any], settings: str) -> str:
    m = meta["machine"]
    commit = f"commit `{m['commit']}`"
    if m["dirty"]:
        commit += f" plus uncommitted changes in {', '.join(f'`{p}`' for p in m['dirty'])}"
    return (f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']}; {commit}; {settings}; "
            f"{meta['date']}, {meta['total_seconds']:.0f} s, load average {meta['load_before']} before, "
            f"{meta['load_after']} after.")


# ---------------------------------------------------------------------------------------------- suites


@dataclass
class SuiteRun:
    label: str
    args: list[str]
    rnd: int
    wall: float
    rc: int
    passed: int
    failed: int
    launches: int
    reuses: int
    startup_median: float | None
    gpu_seconds: float
    report: dict[str, Any] = field(default_factory=dict, repr=False)
    tail: str = field(default="", repr=False)


def run_suite(workdir: Path, suite: Path, label: str, args: Sequence[str], env_extra: dict[str, str],
              rnd: int = 0, models: str = "a,b") -> SuiteRun:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=workdir))
    report = run_dir / "report.json"
    cmd = [sys.executable, "-m", "pytest", str(suite), "-p", "no:cacheprovider",
           "--sgl-engine", "sim", "--sgl-model", models, "--sgl-report", str(report),
           "--sgl-log-dir", str(run_dir / "logs"), "--sgl-lock-dir", str(workdir / "locks"), *args]
    env = clean_env(**env_extra)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    out = proc.stdout
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", out)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) (?:failed|error)", out)) else 0
    launches = reuses = 0
    startups: list[float] = []
    gpu_seconds = 0.0
    data: dict[str, Any] = {}
    if report.exists():
        data = json.loads(report.read_text())
        for worker in data.get("workers", {}).values():
            if worker.get("model") == "sglang-router":
                continue
            launches += worker["launches"]
            reuses += worker["reuses"]
            startups += worker["startup_seconds"]["samples"]
            gpu_seconds += worker["gpu_seconds"]
    run = SuiteRun(label, list(args), rnd, wall, proc.returncode, passed, failed, launches, reuses,
                   median(startups), gpu_seconds, data, "\n".join(out.splitlines()[-15:]))
    if run.rc != 0:
        progress(f"{label} exited {run.rc}:\n{run.tail}")
    return run


def interleaved(workdir: Path, variants: dict[str, tuple[Path, list[str], dict[str, str]]], reps: int,
                what: str, models: str = "a,b") -> dict[str, list[SuiteRun]]:
    """Every variant once per round, the order rotated each round."""
    runs: dict[str, list[SuiteRun]] = {k: [] for k in variants}
    keys = list(variants)
    for rnd in range(reps):
        for key in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
            progress(f"{what}: {key} round {rnd + 1}/{reps}")
            suite, args, env = variants[key]
            runs[key].append(run_suite(workdir, suite, key, args, env, rnd, models))
    return runs


def summary(runs: list[SuiteRun], tests: int) -> dict[str, Any]:
    return {
        "args": runs[0].args if runs else [],
        "n": len(runs),
        "wall_median": median([r.wall for r in runs]),
        "wall_samples": [round(r.wall, 3) for r in runs],
        "launches": median([r.launches for r in runs]),
        "launch_samples": [r.launches for r in runs],
        "reuses": median([r.reuses for r in runs]),
        "startup_median": median([r.startup_median for r in runs]),
        "gpu_seconds": median([r.gpu_seconds for r in runs]),
        "ok": all(r.rc == 0 and r.passed == tests for r in runs),
    }


def compare(runs: dict[str, list[SuiteRun]], cand: str, base: str, key: str = "wall") -> dict[str, Any]:
    c = {r.rnd: getattr(r, key) for r in runs[cand]}
    b = {r.rnd: getattr(r, key) for r in runs[base]}
    return {"candidate": cand, "baseline": base, "of": key,
            "ratio": ratio(median(list(c.values())), median(list(b.values()))),
            "range": spread([(c.get(k), b.get(k)) for k in sorted(set(c) | set(b))])}


def e2e_env(startup: float, per_set: int) -> dict[str, str]:
    return {"SGLSIM_STARTUP_SECONDS": str(startup), "BENCH_E2E_TESTS_PER_SET": str(per_set)}



def suite_table(s: dict[str, Any], title: str, names: dict[str, str]) -> list[str]:
    """The head and the table of a suite part's variants in bench/README.md's ``## Latest figures`` (parts
    reuse, xdist and ahead): walls, their samples, launches, GPU-seconds and whether every run passed."""
    gpus = f", `sim:{s['gpus']}`" if "gpus" in s else ""
    return [f"**{title}** ({s['tests']} tests, {s['configurations']} configurations, simulated startup "
            f"{s['startup']:g} s{gpus}; {next(iter(s['variants'].values()))['n']} runs of each, interleaved):", "",
            "| variant | wall (median) | samples | launches | GPU-seconds | ok |", "|---|---|---|---|---|---|",
            *variant_rows(s["variants"], names)]


def variant_rows(variants: dict[str, Any], names: dict[str, str]) -> list[str]:
    """A row per variant of ``summary``: its wall, samples, launches, GPU-seconds and whether every run passed."""
    return [f"| {names[k]} | {fmt_s(v['wall_median'])} | {', '.join(f'{w:.1f}' for w in v['wall_samples'])} "
            f"| {', '.join(str(n) for n in v['launch_samples'])} | {v['gpu_seconds'] or 0:.1f} | "
            f"{'yes' if v['ok'] else 'NO'} |" for k, v in variants.items()]


# ---------------------------------------------------------------------------------------------- report


def goal(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "**missed**"
