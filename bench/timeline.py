#!/usr/bin/env python
"""How the run timeline's rendering (``--sgl-timeline``: the HTML page and the trace events) scales with the
number of launches: ratios measured side by side in one run, as bench/README.md describes.

    .venv/bin/python bench/timeline.py                 # 30 vs 300 launches, 7 interleaved rounds
    .venv/bin/python bench/timeline.py --small 50 --large 500 --rounds 11

A run's report of N launches (8 xdist workers on 8 GPUs, 4 tests each, one death in 37) is rendered once per
round at each size, the order alternating from round to round. The figure is the ratio of the median render
times, large / small, with the range of the per-round ratios: a renderer linear in the launches gives about
large / small (10x by default), a quadratic one its square. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_sglworker.plugin.timeline import render_html, trace_events

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=30, help="launches of the baseline report (default 30)")
    parser.add_argument("--large", type=int, default=300, help="launches of the measured report (default 300)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = parser.parse_args(argv)
    small, large = _report(args.small), _report(args.large)
    _render_seconds(small)  # imports and caches warmed before the first measured round
    times: dict[str, list[float]] = {"small": [], "large": []}
    for round_ in range(args.rounds):
        order = ("small", "large") if round_ % 2 == 0 else ("large", "small")
        for name in order:
            times[name].append(_render_seconds(small if name == "small" else large))
        print(f"round {round_ + 1}/{args.rounds}: {args.small} launches {times['small'][-1] * 1000:.0f} ms, "
              f"{args.large} launches {times['large'][-1] * 1000:.0f} ms", file=sys.stderr)
    per_round = [b / a for a, b in zip(times["small"], times["large"], strict=True)]
    ratio = statistics.median(times["large"]) / statistics.median(times["small"])
    linear = args.large / args.small
    print(f"| launches | median render (HTML + trace) | ratio to {args.small} | linear would be |")
    print("|---:|---:|---:|---:|")
    print(f"| {args.small} | {statistics.median(times['small']) * 1000:.0f} ms | 1.00x | 1.00x |")
    print(f"| {args.large} | {statistics.median(times['large']) * 1000:.0f} ms | **{ratio:.2f}x** "
          f"({min(per_round):.2f}-{max(per_round):.2f}) | {linear:.2f}x |")
    print(f"\n{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{args.rounds} rounds, {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
