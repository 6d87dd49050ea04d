#!/usr/bin/env python
"""Retiring a group off the main thread (issue 43): a run (one process, or ``--xdist N``) of configurations, each
group's clean shutdown taking ``--shutdown`` seconds (sglang's: about 4 s), with the pool retiring groups on the main
thread (``BENCH_RETIRE_ON_MAIN=1``: the baseline, as before the change) and off it, interleaved in the same run.

    .venv/bin/python bench/retire.py [--rounds 3] [--shutdown 2] [--configs 4] [--xdist N] [--json PATH]

The wall of a run and, from its report, the seconds between one configuration's last test's end and the next
configuration's first test's start (what the main thread spent between them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import SUITES, compare, finish_meta, fmt_s, fmt_x, interleaved, median, start_meta

NAME = "retire"
MEASURES = {NAME: ("pytest_sglworker/workers/pool.py", "pytest_sglworker/workers/pool_retire.py",
                   "pytest_sglworker/workers/pool_ahead.py", "bench/suites/retire")}


def gaps(report: dict[str, Any]) -> list[float]:
    """Seconds from each configuration's last test's end to the next configuration's first test's start, on the same
    process (an xdist worker's own sequence)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for launch in report.get("launches", []):
        tests = launch.get("tests") or []
        if tests:
            where = spans.setdefault(str(launch.get("xdist_worker") or "main"), [])
            where.append((min(t["t_start"] for t in tests), max(t["t_end"] for t in tests)))
    return [later[0] - earlier[1] for seq in spans.values() for earlier, later in itertools.pairwise(sorted(seq))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shutdown", type=float, default=2.0, help="each group's clean shutdown, seconds")
    parser.add_argument("--configs", type=int, default=4)
    parser.add_argument("--xdist", type=int, default=0,
                        help="xdist workers (the plugin's scheduler, a follower thread each); 0: one process")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    meta = start_meta(sys.argv[1:] if argv is None else argv)
    began = time.monotonic()
    env = {"SGLSIM_STARTUP_SECONDS": "1", "BENCH_RETIRE_SHUTDOWN": str(args.shutdown),
           "BENCH_RETIRE_CONFIGS": str(args.configs)}
    variants = {}
    for gpus in (args.configs, 2):  # a GPU each (nothing waits for a retirement), then fewer GPUs than configurations
        common = ["--sgl-gpus", f"sim:{gpus}", *(["-n", str(args.xdist)] if args.xdist else ["-p", "no:xdist"])]
        variants[f"on_main_{gpus}"] = (SUITES / "retire", common, {**env, "BENCH_RETIRE_ON_MAIN": "1"})
        variants[f"off_main_{gpus}"] = (SUITES / "retire", common, env)
    with tempfile.TemporaryDirectory(prefix="bench-retire-") as tmp:
        runs = interleaved(Path(tmp), variants, args.rounds, "retire", models="a")
    tests = args.configs * 2
    result: dict[str, Any] = {"meta": meta, "settings": vars(args) | {"json": str(args.json)}, "variants": {},
                              "ratios": {}}
    for key, variant in runs.items():
        result["variants"][key] = {
            "walls": [round(r.wall, 3) for r in variant], "wall_median": median([r.wall for r in variant]),
            "gap_median": median([g for r in variant for g in gaps(r.report)]),
            "ok": all(r.rc == 0 and r.passed == tests for r in variant)}
    for gpus in (args.configs, 2):
        result["ratios"][f"sim:{gpus}"] = compare(runs, f"off_main_{gpus}", f"on_main_{gpus}")
    finish_meta(meta, time.monotonic() - began)
    for key, v in result["variants"].items():
        print(f"{key}: wall {fmt_s(v['wall_median'])} ({v['walls']}), gap between configurations "
              f"{fmt_s(v['gap_median'])}, ok={v['ok']}")
    for where, r in result["ratios"].items():
        print(f"{where}: off the main thread / on it: {fmt_x(r['ratio'])} {r['range']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(v["ok"] for v in result["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
