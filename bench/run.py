#!/usr/bin/env python
"""Benchmark of pytest-sglworker (issues 6 and 16): ratios measured side by side in one run.

Run by hand from the repository root::

    .venv/bin/python bench/run.py                  # full run: the README's figures, about 20 minutes on 2 CPUs
    .venv/bin/python bench/run.py --quick          # about 4 minutes, smaller samples: NOT the README's figures
    .venv/bin/python bench/run.py --only readiness,overhead --json figures.json
    .venv/bin/python bench/run.py --only soak      # bench/soak.py, plain and --hostile, about 3 minutes
    .venv/bin/python bench/readiness.py --quick    # one part alone: the same as --only readiness

Every figure is a ratio against a baseline measured in the same run, baseline and candidate interleaved (a
burst of load hits both alike), with the range of the per-round ratios as its spread. stdout gets two markdown
sections, exactly as they are meant to be pasted: the README's ``## Speed`` section and bench/README.md's
``## Latest figures``; progress goes to stderr. What each figure means: bench/README.md.

Each part (``--only``; all of them by default) is a module of bench/ of its own, listed in :data:`PARTS` in the
order they run and render; each has ``NAME`` (its part), ``MEASURES`` (what its figures measure: bench/render.py
says, in each region, which of those paths changed since the commit the figures ran at), ``measure(plan,
workdir)`` (its key of the JSON), ``speed_rows``, ``speed_notes`` and ``details`` (its share of the two sections)
and ``failures``. What they share is bench/common.py.

- ``readiness`` (bench/readiness.py): from the moment the simulated engine is ready (its ``SGLSIM_RECORD``
  ``ready`` event) to the moment the wait returns: ours as committed (ready-line watch + one probe), ours with the
  line watch off (the plain polling it falls back to), ours before the fixes of bench/previous.py, and the peers'
  habits (vLLM's ``RemoteOpenAIServer``, sglang's ``popen_launch_server``), for an engine that warms up (503 until
  ready) and one that is ready when it binds.
- ``real`` (bench/real.py): the same latency after the real sglang's ready line (CPU build, tiny model; needs
  ``scripts/install-real-engine.sh``), ours against the probe it replaced, and what each health endpoint costs.
- ``reuse`` (bench/reuse.py): an e2e suite of 6 worker configurations, the pool against ``--sgl-reuse off``; then
  a 2-worker regular group and a 1+1 prefill/decode group, each over 20 tests, pooled against ``--sgl-reuse off``.
- ``xdist`` (bench/xdist_walls.py): the same suite under ``-n 4`` (``--dist load``, ``--dist loadgroup``, the
  plugin's scheduler) against ``-n 1``.
- ``ahead`` (bench/ahead.py): the same suite with a startup long next to its tests on 2 GPUs, launch ahead on (the
  default 1, and 2) against off.
- ``groups`` (bench/groups.py): how long a 1+1 prefill/decode group and a 4-worker group take against their
  slowest member's startup; the plugin's router against a bare copy of it polled every millisecond.
- ``overhead`` (bench/overhead.py): the plugin installed but unused: trivial suites of 300 and 3000 tests with
  and without ``-p no:sglworker``; the import of the plugin against the import of pytest.
- ``soak`` (bench/soak_runs.py): bench/soak.py and bench/soak.py --hostile at their defaults, their summary lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ahead
import groups
import overhead
import readiness
import real
import reuse
import soak_runs
import xdist_walls
from common import (
    _DROPPED_ENV,
    _DROPPED_PREFIXES,
    BENCH,
    FULL,
    QUICK,
    REPO,
    SUITES,
    add_render_option,
    clean_env,
    machine,
    print_rendered,
    progress,
    warm_bytecode,
    where_and_when,
)

#: The parts, in the order they run and render (the README's rows, bench/README.md's numbered blocks).
PART_MODULES = (readiness, real, reuse, xdist_walls, ahead, groups, overhead, soak_runs)
PARTS = tuple(part.NAME for part in PART_MODULES)
DEFAULT_PARTS = PARTS
#: What the figures of each part measure, by part (bench/render.py's staleness line of the regions of run.json)
MEASURES = {name: paths for part in PART_MODULES for name, paths in part.MEASURES.items()}


def machine_line(results: dict[str, Any]) -> str:
    meta = results["meta"]
    settings = ("`bench/run.py --quick` (smaller samples: NOT the README's figures)" if meta["quick"]
                else "`bench/run.py` full settings")
    if meta["parts"] != sorted(DEFAULT_PARTS):
        settings += f", parts {', '.join(meta['parts'])}"
    return where_and_when(meta, settings)


def readme_section(results: dict[str, Any]) -> str:
    """The README's ``## Speed`` section, as it is to be pasted."""
    meta = results["meta"]
    out = ["## Speed", ""]
    if meta["quick"]:
        out += ["> **A `--quick` run: smaller samples and shorter startups. These are not the README's figures.**", ""]
    out += [
        "`bench/run.py` measures what the plugin costs and saves against the simulated engine: each figure is a",
        "ratio, ours / a baseline measured in the same run, the two interleaved so that load hits both alike; the",
        "median, with the range of the per-round ratios in brackets (below 1: ours takes less). Every sample and",
        "what each figure means: `bench/README.md`. Rendered from the run's `bench/results/run.json` (by",
        "`bench/render.py`; `bench/all.py` measures again), which ran on:",
        "",
        machine_line(results),
        "",
        "| what | baseline | ours / baseline | goal |",
        "|---|---|---|---|",
    ]
    rows = [row for part in PART_MODULES for row in part.speed_rows(results)]
    if rows:
        out += [f"| {a_} | {b_} | {c_} | {d_} |" for a_, b_, c_, d_ in rows]
    else:
        del out[-2:]  # no table
    out += [""]
    out += [line for part in PART_MODULES for line in part.speed_notes(results)]
    return "\n".join(out).rstrip() + "\n"


def details_section(results: dict[str, Any]) -> str:
    """bench/README.md's ``## Latest figures``: every figure with its samples."""
    meta = results["meta"]
    out = ["## Latest figures", ""]
    if meta["quick"]:
        out += ["> **A `--quick` run: not the figures bench/README.md states.**", ""]
    out += [machine_line(results), ""]
    out += [line for part in PART_MODULES for line in part.details(results)]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None, only: str | None = None) -> int:
    """``only``: the part a part's own module runs (``bench/readiness.py`` is ``bench/run.py --only readiness``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller samples: NOT the README's figures")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure and sample as JSON")
    if only is None:
        parser.add_argument("--only", default=",".join(DEFAULT_PARTS),
                            help=f"comma-separated parts: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, run reports)")
    parser.add_argument("--real-engine", default=None, metavar="VENV",
                        help="the real engine's venv for part real (default: $SGLWORKER_REAL_ENGINE, else this "
                             "tree's .cache/real-engine)")
    add_render_option(parser)
    ns = parser.parse_args(argv)
    if ns.render is not None:
        return print_rendered(ns.render, lambda saved: readme_section(saved) + "\n" + details_section(saved))
    parts = {p.strip() for p in (only or ns.only).split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    plan = QUICK if ns.quick else FULL
    if plan.quick:
        progress("--quick: smaller samples and shorter startups; NOT the README's figures")

    real_engine = ns.real_engine or os.environ.get("SGLWORKER_REAL_ENGINE")
    # Measured processes, including the engines that spawn_worker starts from this process's environment.
    for key in list(os.environ):
        if key in _DROPPED_ENV or key.startswith(_DROPPED_PREFIXES):
            del os.environ[key]
    sys.dont_write_bytecode = False
    # This tree's package, in this process and in every measured one (ahead of an editable install elsewhere).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    sys.path[:0] = [str(REPO), str(BENCH)]  # and bench/previous.py
    package = subprocess.run([sys.executable, "-c", "import pytest_sglworker; print(pytest_sglworker.__file__)"],
                             env=clean_env(), cwd=SUITES, capture_output=True, text=True).stdout.strip()
    if not package.startswith(str(REPO) + os.sep):
        parser.error(f"the measured processes import pytest_sglworker from {package or '?'}, not from {REPO}")
    if real_engine:
        os.environ["BENCH_REAL_ENGINE"] = real_engine
    t_start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="sglworker-bench-"))
    results: dict[str, Any] = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "quick": plan.quick, "plan": asdict(plan), "parts": sorted(parts),
        "load_before": round(os.getloadavg()[0], 2),
    }}
    try:
        warm_bytecode()
        for part in PART_MODULES:
            if part.NAME in parts and not (part.NAME == "real" and plan.quick):
                t0 = time.perf_counter()
                results[part.NAME] = part.measure(plan, workdir)
                results[part.NAME]["seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        if ns.keep:
            progress(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results["meta"]["load_after"] = round(os.getloadavg()[0], 2)
    results["meta"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
    sys.stdout.write(readme_section(results))
    sys.stdout.write("\n")
    sys.stdout.write(details_section(results))
    sys.stdout.flush()
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        progress(f"figures written to {ns.json}")
    bad = [item for part in PART_MODULES for item in part.failures(results)]
    for item in bad:
        progress(f"FAILED: {item}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
