#!/usr/bin/env python
"""Re-run every benchmark at its documented settings, write its JSON, then re-render every figure of the documents.

    .venv/bin/python bench/all.py                        # every benchmark, then bench/render.py (hours on 2 CPUs)
    .venv/bin/python bench/all.py --only warm,timeline   # some of them, then render
    .venv/bin/python bench/all.py --render-only          # measure nothing: bench/render.py
    .venv/bin/python bench/all.py --quick                # each at its smallest settings: NOT the documents' figures

Each benchmark runs as its own process, one after the other (each measures side by side within itself; two at
once would load each other), with its JSON written where ``bench/render.py``'s ``REGIONS`` reads it. A benchmark
that fails (exit status not 0) is reported and the others still run; the documents are rendered from whatever JSON
is then committed, and the exit status is 1. Every JSON names the commit, the machine, the settings, the date and
the load average of its run: run this in a clean checkout of the commit the figures are to name.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import render  # noqa: E402  (bench/render.py, a sibling)

#: part -> (the script, its documented settings, its --quick settings); the JSON path is REGIONS' (bench/render.py).
#: bound first: its own provenance counts any changed file under bench/ as uncommitted changes, the JSON the others
#: write included (bench/common.py's ``machine``, which the others use, leaves the JSON out). Each part's script
#: declares what its figures measure (its ``MEASURES``: bench/render.py's staleness line of its regions).
PARTS: dict[str, tuple[str, list[str], list[str]]] = {
    "bound": ("bound.py", [], ["--quick"]),
    "run": ("run.py", [], ["--quick"]),
    "warm": ("warm.py", [], ["--rounds", "1", "--no-real"]),
    "timeline": ("timeline.py", [], ["--rounds", "3"]),
    "xdist_sched": ("xdist_sched.py", [], ["--quick"]),
    "ray_cluster": ("ray_cluster.py", [], ["--reps", "1"]),
    "box_suites": ("box_suites.py", [], ["--suites", "2", "--n", "4"]),
}


def json_path(part: str) -> str:
    """Where ``part`` writes its JSON: the one the regions it feeds read (relative to the repository root)."""
    paths = {region.json for region in render.REGIONS.values() if region.produced_by == part}
    if len(paths) != 1:
        raise SystemExit(f"bench/render.py's REGIONS name {len(paths)} JSON files for part {part!r}; expected one")
    return paths.pop()


def command(part: str, quick: bool) -> list[str]:
    script, settings, quick_settings = PARTS[part]
    return [sys.executable, str(BENCH / script), *(quick_settings if quick else settings), "--json", json_path(part)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    parser.add_argument("--render-only", action="store_true", help="measure nothing: render the documents")
    parser.add_argument("--quick", action="store_true",
                        help="each benchmark at its smallest settings (the JSON says so): NOT the documents' figures")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    failed: list[str] = []
    if not args.render_only:
        for part in parts:
            cmd = command(part, args.quick)
            print(f"== {part}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            rc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL).returncode
            print(f"== {part}: exit {rc} after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            if rc != 0:
                failed.append(f"{part} (exit {rc})")
    rc = render.main([])
    if failed:
        print(f"failed: {', '.join(failed)}; their figures are rendered as their JSON has them", file=sys.stderr)
    return 1 if failed or rc else 0


if __name__ == "__main__":
    sys.exit(main())
