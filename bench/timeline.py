#!/usr/bin/env python
"""How the run timeline's rendering (``--sgl-timeline``: the HTML page and the trace events) scales with the
number of launches: ratios measured side by side in one run, as bench/README.md describes.

    .venv/bin/python bench/timeline.py                 # 30 vs 300 launches, 7 interleaved rounds
    .venv/bin/python bench/timeline.py --small 50 --large 500 --rounds 11
    .venv/bin/python bench/timeline.py --json bench/results/timeline.json   # also every sample, with provenance
    .venv/bin/python bench/timeline.py --render bench/results/timeline.json # measure nothing: print it again

A run's report of N launches (8 xdist workers on 8 GPUs, 4 tests each, one death in 37) is rendered once per
round at each size, the order alternating from round to round. The figure is the ratio of the median render
times, large / small, with the range of the per-round ratios: a renderer linear in the launches gives about
large / small (10x by default), a quadratic one its square. Progress goes to stderr, the table (and the line
saying where it ran, as every bench/ section) to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # bench/common.py: the provenance of every figure, --render
    add_render_option,
    finish_meta,
    print_rendered,
    provenance_line,
    start_meta,
)

from pytest_sglworker.plugin.timeline import render_html, trace_events

#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {"timeline": ("pytest_sglworker/plugin/timeline.py",)}
T0 = 1_733_150_000.0


def _launch(i: int) -> dict[str, Any]:
    gpu, at = i % 8, (i // 8) * 26.0
    req = T0 + at
    ready, stop = req + 3.55, req + 23.55
    port = 20000 + 4 * i
    return {
        "id": f"gw{gpu}-{i}", "config": "qwen3-0.6b", "label": "qwen3-0.6b", "model": "Qwen/Qwen3-0.6B",
        "role": "worker", "group": None, "xdist_worker": f"gw{gpu}", "node": "node-a", "gpus": [gpu],
        "gpu_names": [f"sim-gpu-{gpu}"], "port": port, "pid": 4000 + i,
        "argv": f"python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --port {port}",
        "log_path": f"/tmp/logs/sglang-worker-gw{gpu}-{i}.log", "t_lease_requested": req, "t_leased": req + 0.5,
        "t_started": req + 0.55, "t_ready": ready, "t_stop_requested": stop, "t_stopped": stop + 0.7,
        "t_released": stop + 1.0, "outcome": "died" if i % 37 == 0 else "ok", "failure": None,
        "tests": [{"nodeid": f"tests/test_e2e.py::test_{i}_{k}[qwen3-0.6b]", "t_start": ready + k * 5.0,
                   "t_end": ready + k * 5.0 + 4.0, "outcome": "passed"} for k in range(4)]}


def _report(n: int) -> dict[str, Any]:
    launches = [_launch(i) for i in range(n)]
    end = max(r["t_released"] for r in launches) + 1
    return {"schema": "pytest-sglworker/report/v1", "engine": "sim", "models": ["qwen3-0.6b"], "exitstatus": 0,
            "workers": {}, "started_at": T0 - 1, "interrupted": False, "finished_at": end, "launches": launches}


def _render_seconds(report: dict[str, Any]) -> float:
    start = time.perf_counter()
    render_html(report)
    trace_events(report)
    return time.perf_counter() - start


def measure(small_n: int, large_n: int, rounds: int) -> dict[str, Any]:
    """Render times of a ``small_n``- and a ``large_n``-launch report, ``rounds`` rounds interleaved."""
    small, large = _report(small_n), _report(large_n)
    _render_seconds(small)  # imports and caches warmed before the first measured round
    times: dict[str, list[float]] = {"small": [], "large": []}
    for round_ in range(rounds):
        order = ("small", "large") if round_ % 2 == 0 else ("large", "small")
        for name in order:
            times[name].append(_render_seconds(small if name == "small" else large))
        print(f"round {round_ + 1}/{rounds}: {small_n} launches {times['small'][-1] * 1000:.0f} ms, "
              f"{large_n} launches {times['large'][-1] * 1000:.0f} ms", file=sys.stderr)
    return {"small": small_n, "large": large_n, "rounds": rounds, "times": times}


def render(data: dict[str, Any]) -> str:
    """The markdown section of bench/README.md ("The run timeline's rendering"), from ``measure``'s JSON."""
    small, large, times = data["small"], data["large"], data["times"]
    per_round = [b / a for a, b in zip(times["small"], times["large"], strict=True)]
    ratio = statistics.median(times["large"]) / statistics.median(times["small"])
    return "\n".join([
        f"| launches | median render (HTML + trace) | ratio to {small} | linear would be |",
        "|---:|---:|---:|---:|",
        f"| {small} | {statistics.median(times['small']) * 1000:.0f} ms | 1.00x | 1.00x |",
        f"| {large} | {statistics.median(times['large']) * 1000:.0f} ms | **{ratio:.2f}x** "
        f"({min(per_round):.2f}-{max(per_round):.2f}) | {large / small:.2f}x |",
        "", f"{data['rounds']} rounds; {provenance_line(data['meta'], 'bench/timeline.py')}", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=30, help="launches of the baseline report (default 30)")
    parser.add_argument("--large", type=int, default=300, help="launches of the measured report (default 300)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--json", type=Path, default=None, help="also write every sample as JSON")
    add_render_option(parser)
    args = parser.parse_args(argv)
    if args.render is not None:
        return print_rendered(args.render, render)
    t0 = time.perf_counter()
    meta = start_meta(argv if argv is not None else sys.argv[1:])
    data = {"meta": meta, **measure(args.small, args.large, args.rounds)}
    finish_meta(meta, time.perf_counter() - t0)
    sys.stdout.write(render(data))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
