#!/usr/bin/env python
"""A group handed over while the giver's test runs (issue 43): a run at ``-n 2`` on ``sim:8`` of one configuration of
long tests beside several of short ones (bench/suites/handover). While one xdist worker runs the long tests, a group
it launched ahead is sent to the other: its follower thread hands it over at once, or, in the baseline
(``BENCH_HANDOVER_BETWEEN_TESTS=1``: as before the change), its main thread hands it over once its test has ended.
Both interleaved in the same run.

    .venv/bin/python bench/handover.py [--rounds 3] [--long-seconds 4] [--json PATH]

The wall of a run, and how many groups its report says were handed over.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import SUITES, compare, finish_meta, fmt_s, fmt_x, interleaved, median, start_meta

NAME = "handover"
MEASURES = {NAME: ("pytest_sglworker/workers/pool.py", "pytest_sglworker/workers/pool_warm.py",
                   "pytest_sglworker/workers/warm.py", "pytest_sglworker/plugin/hint_follower.py",
                   "bench/suites/handover")}
CANDIDATE, BASELINE = "while_running", "between_tests"


def handed_over(report: dict[str, Any]) -> int:
    """Groups the run's report says were handed over from one xdist worker to another."""
    return sum(1 for launch in report.get("launches", []) if launch.get("outcome") == "handed_over")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long-seconds", type=float, default=4.0, help="each of the long configuration's tests")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    meta = start_meta(sys.argv[1:] if argv is None else argv)
    began = time.monotonic()
    env = {"BENCH_HANDOVER_LONG_SECONDS": str(args.long_seconds)}
    common = ["--sgl-gpus", "sim:8", "-n", "2"]
    variants = {CANDIDATE: (SUITES / "handover", common, env),
                BASELINE: (SUITES / "handover", common, {**env, "BENCH_HANDOVER_BETWEEN_TESTS": "1"})}
    with tempfile.TemporaryDirectory(prefix="bench-handover-") as tmp:
        runs = interleaved(Path(tmp), variants, args.rounds, NAME, models="a")
    tests = 4 + 5 * 3  # the suite's defaults: four long tests, five configurations of three short ones
    result: dict[str, Any] = {"meta": meta, "settings": vars(args) | {"json": str(args.json)}, "variants": {}}
    for key, variant in runs.items():
        result["variants"][key] = {
            "walls": [round(r.wall, 3) for r in variant], "wall_median": median([r.wall for r in variant]),
            "handed_over": [handed_over(r.report) for r in variant],
            "ok": all(r.rc == 0 and r.passed == tests for r in variant)}
    result["ratio"] = compare(runs, CANDIDATE, BASELINE)
    finish_meta(meta, time.monotonic() - began)
    for key, v in result["variants"].items():
        print(f"{key}: wall {fmt_s(v['wall_median'])} ({v['walls']}), groups handed over {v['handed_over']}, "
              f"ok={v['ok']}")
    print(f"handed over while the test runs / between tests: {fmt_x(result['ratio']['ratio'])} "
          f"{result['ratio']['range']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(v["ok"] for v in result["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
