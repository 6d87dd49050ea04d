#!/usr/bin/env python
"""Benchmark of ``--sgl-cluster ray`` and ``--sgl-shard`` (issue 13): ratios measured side by side in one run.

    .venv/bin/python bench/ray_cluster.py                    # 2 rounds, about 6 minutes on 2 CPUs
    .venv/bin/python bench/ray_cluster.py --reps 3 --json figures.json
    .venv/bin/python bench/ray_cluster.py --only shard       # the sharding part alone (no Ray cluster)
    .venv/bin/python bench/ray_cluster.py --render bench/results/ray_cluster.json   # measure nothing: print it again

One suite of 8 worker configurations of unequal cost (below), the simulated engine starting in 1 s.

- ``ray``: the suite under ``-n 4``, once with ``--sgl-gpus sim:4`` (local file-lock leases) and once with
  ``--sgl-cluster ray`` on a local Ray cluster started here with 4 declared GPUs (``ray start --head --num-gpus
  4 --num-cpus 4``, a private temp dir and port), each with ``--sgl-report``; one unmeasured run of each first,
  then rounds interleaved, the order rotated. Figures: the whole ``pytest`` wall, and per launch (from the
  report's launch records) lease requested -> ready and its phases (requested -> leased, leased -> process
  started, started -> ready), the median of a run's launches. A ratio is ray / local of the medians over the
  rounds, its spread the range of the per-round ratios.
- ``shard``: one runner without ``-n`` on ``sim:4`` with ``--sgl-launch-ahead 0`` (so that a configuration's
  launch is in the setup of its first test, as the shard planner assumes, not overlapped with whatever ran
  before it on the runner): the suite once unsharded with ``--sgl-report``, then, in each round, ``--sgl-shard
  k/4`` for k = 1..4 balanced by that report (``--sgl-shard-report``) and by test count (no report), the two
  plans alternating, k falling in every other round. A shard's measured cost is the sum of its tests'
  ``seconds`` in its own report; a round's balance is its largest shard's cost over a quarter of the sum of
  its 4 shards' (1.0 is perfect), the figure the median of the rounds', its spread their range (the costs
  printed are each shard's median over the rounds). The union of each plan's shards is checked
  against the unsharded selection.

The suite: 2 configurations of each of 4 shapes (tests x seconds a test): 6 x 0.15, 2 x 0.65, 1 x 1.7, 1 x 2.1,
so that a configuration's cost (launch plus tests) is not in proportion to its test count: balanced by count,
the 1-test configurations pile up on the shards of the 2-test ones.

Environment of every measured process as bench/common.py's ``clean_env`` (bytecode caching on, no plugin
settings, no ``RAY_ADDRESS`` but the cluster's), this tree's package first on ``PYTHONPATH`` (checked, in the
pytest process and in a Ray actor). Progress goes to stderr, the markdown section to stdout; the exit status is 1
when a run failed, a shard check failed or a Ray process of the cluster was left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
import common  # noqa: E402  (bench/common.py: clean_env, machine, the formatting of ratios)

#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit),
#: by part (``--only``): the Ray path against local leases; the shard planner
MEASURES = {"ray": ("pytest_sglworker/workers/sources/ray.py", "pytest_sglworker/workers/sources/ray_connect.py",
                    "pytest_sglworker/workers/sources/ray_hosts.py", "pytest_sglworker/workers/sources/local.py",
                    "pytest_sglworker/resources/gpus/leases.py"),
            "shard": ("pytest_sglworker/plugin/sharding.py", "pytest_sglworker/plugin/collection.py")}
#: (tests, seconds a test) of each configuration; 2 of each shape
SHAPES = ((6, 0.15), (2, 0.65), (1, 1.7), (1, 2.1))
CONFIGS = tuple(shape for shape in SHAPES for _ in range(2))
STARTUP = "1"
GPUS = 4
SHARDS = 4
XDIST = 4
CLUSTER_MARK = "SGLWORKER_BENCH_RAY_CLUSTER"  # in the environment of every process of the bench's cluster
#: What the cluster's head and its clients (the measured pytest runs) set, whatever the user's ~/.ray holds (as
#: tests/ray_local.py): token authentication off explicitly (``ray start --head`` turns it on by itself when
#: ~/.ray/auth_token exists), and Ray's single-machine mode, the one in which it keeps 127.0.0.1 as the node's
#: address instead of replacing it by the machine's other one (its servers then listen on loopback only).
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
RAY_DROPPED = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
BASE = ("-q", "-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b")
VARIANTS = {"local": ("--sgl-gpus", f"sim:{GPUS}"), "ray": ("--sgl-cluster", "ray")}
PHASES = (("total", "t_lease_requested", "t_ready"), ("lease", "t_lease_requested", "t_leased"),
          ("spawn", "t_leased", "t_started"), ("startup", "t_started", "t_ready"))
PHASE_LABELS = {"total": "per launch: lease requested -> ready", "lease": "  lease requested -> leased",
                "spawn": "  leased -> process started", "startup": "  process started -> ready"}


def suite_text() -> str:
    text = "import time\n\nimport pytest\n"
    for c, (tests, sleep) in enumerate(CONFIGS):
        text += f"""

@pytest.mark.sgl_worker(args=["--max-total-tokens", "{4096 + 64 * c}"])
@pytest.mark.parametrize("i", range({tests}))
def test_config_{c}(sgl_worker, i):
    assert sgl_worker.client.get("/health").status_code == 200
    time.sleep({sleep})
"""
    return text


def progress(text: str) -> None:
    sys.stderr.write(f"  .. {text}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------- the cluster


def cluster_processes(mark: str) -> list[Any]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(CLUSTER_MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def start_cluster(temp: str, mark: str) -> tuple[subprocess.Popen[bytes], str]:
    port = common.free_port()
    env = common.clean_env(**{CLUSTER_MARK: mark}, **RAY_ENV, RAY_TMPDIR=temp)
    for key in RAY_DROPPED:
        env.pop(key, None)
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--num-gpus={GPUS}", f"--num-cpus={GPUS}",
                             f"--port={port}", "--disable-usage-stats", "--include-dashboard=false",
                             f"--temp-dir={temp}", "--node-ip-address=127.0.0.1"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    # up, with its GPUs, and a Ray worker imports this tree's package (the actors run the plugin's code)
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False)\n"
             f"assert ray.cluster_resources().get('GPU') == {GPUS}\n"
             "where = ray.remote(lambda: __import__('pytest_sglworker').__file__)\n"
             "print(ray.get(where.options(num_cpus=0).remote(), timeout=60))\n")
    deadline = time.monotonic() + 120
    while True:
        if head.poll() is not None:
            raise SystemExit("ray start --head exited")
        done = subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True, text=True,
                              timeout=90)
        if done.returncode == 0:
            where = done.stdout.strip().splitlines()[-1]
            if not where.startswith(str(REPO) + os.sep):
                raise SystemExit(f"the Ray cluster's workers import pytest_sglworker from {where}, not {REPO}")
            return head, address
        if time.monotonic() > deadline:
            raise SystemExit(f"the local Ray cluster did not come up: {done.stderr[-1000:]}")
        time.sleep(0.5)


def stop_cluster(head: subprocess.Popen[bytes], mark: str) -> list[int]:
    """Stops the cluster (``ray start --block`` stops its processes on SIGTERM); what of it did not stop in
    time is killed by pid, only this cluster's. Returns the pids still alive after that."""
    with contextlib.suppress(OSError):
        os.killpg(head.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while cluster_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in cluster_processes(mark):
        with contextlib.suppress(Exception):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(10)
    deadline = time.monotonic() + 10
    while cluster_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p.pid for p in cluster_processes(mark)]


# ---------------------------------------------------------------------------------------------- runs


def run_pytest(work: Path, name: str, args: list[str], address: str | None) -> dict[str, Any]:
    """One ``pytest`` run of the suite with ``--sgl-report``: its wall, report and shard note."""
    report = work / "reports" / f"{name}.json"
    env = common.clean_env(SGLSIM_STARTUP_SECONDS=STARTUP, SGLWORKER_LOG_DIR=str(work / "logs"),
                           SGLWORKER_LOCK_DIR=str(work / "locks"))
    for key in RAY_DROPPED:
        env.pop(key, None)
    if address is not None:
        env.update(RAY_ENV, RAY_ADDRESS=address)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", *BASE, *args, "--sgl-report", str(report),
                           str(work / "suite")], env=env, cwd=work, capture_output=True, text=True)
    wall = time.monotonic() - start
    data = json.loads(report.read_text()) if report.exists() else {}
    note = re.search(r"shard \d+/\d+: .*?estimated ([\d.]+)(?:s| tests) of ([\d.]+)", done.stdout)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-2000:])
        progress(f"FAILED: {name} (exit {done.returncode})")
    return {"name": name, "rc": done.returncode, "wall": wall, "report": str(report), "tests": data.get("tests", {}),
            "launches": data.get("launches", []),
            "estimate": (float(note.group(1)), float(note.group(2))) if note else None}


def launch_phases(launches: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per phase, the seconds of every launch that became ready."""
    out: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    for rec in launches:
        if rec.get("outcome") != "ok" or rec.get("t_ready") is None:
            continue
        for name, a, b in PHASES:
            if rec.get(a) is not None and rec.get(b) is not None:
                out[name].append(rec[b] - rec[a])
    return out


def bench_ray(work: Path, reps: int, address: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for variant, args in VARIANTS.items():  # bytecode, Ray's worker pool: not measured
        progress(f"warm-up: {variant}")
        if run_pytest(work, f"warmup-{variant}", ["-n", str(XDIST), *args], address)["rc"] != 0:
            raise SystemExit(f"the warm-up run of {variant} failed")
    for rep in range(reps):
        order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            run = run_pytest(work, f"{variant}-{rep + 1}", ["-n", str(XDIST), *VARIANTS[variant]], address)
            run["phases"] = launch_phases(run.pop("launches"))
            runs[variant].append(run)
            progress(f"round {rep + 1}: {variant} {run['wall']:.1f} s, {len(run['phases']['total'])} launches, "
                     f"median lease requested -> ready {common.fmt_s(common.median(run['phases']['total']))}")
    rows: dict[str, dict[str, Any]] = {}
    pairs = list(zip(runs["ray"], runs["local"], strict=True))
    rows["wall"] = {v: common.median([r["wall"] for r in runs[v]]) for v in VARIANTS}
    rows["wall"]["range"] = common.spread([(r["wall"], loc["wall"]) for r, loc in pairs])
    for name, _, _ in PHASES:
        rows[name] = {v: common.median([common.median(r["phases"][name]) for r in runs[v]]) for v in VARIANTS}
        rows[name]["range"] = common.spread([(common.median(r["phases"][name]), common.median(loc["phases"][name]))
                                             for r, loc in pairs])
    for row in rows.values():
        row["ratio"] = common.ratio(row["ray"], row["local"])
    return {"reps": reps, "rows": rows, "launches": {v: [len(r["phases"]["total"]) for r in runs[v]] for v in VARIANTS},
            "ok": all(r["rc"] == 0 for v in VARIANTS for r in runs[v]),
            "runs": {v: [{k: r[k] for k in ("wall", "rc", "phases")} for r in runs[v]] for v in VARIANTS}}


def bench_shard(work: Path, reps: int) -> dict[str, Any]:
    common_args = ["--sgl-gpus", f"sim:{GPUS}", "--sgl-launch-ahead", "0"]
    progress("shard: the unsharded reference run")
    ref = run_pytest(work, "unsharded", common_args, None)
    selection = set(ref["tests"])
    # runs[plan][round][k - 1]; the shards' order reversed every other round (a trend in the machine's load
    # then weighs on every shard alike), the plans' order alternating
    runs: dict[str, list[list[dict[str, Any]]]] = {"measured": [], "count": []}
    for rep in range(reps):
        done: dict[str, dict[int, dict[str, Any]]] = {plan: {} for plan in runs}
        shards = range(1, SHARDS + 1) if rep % 2 == 0 else range(SHARDS, 0, -1)
        for i, k in enumerate(shards):
            for plan in (list(runs) if i % 2 == 0 else list(reversed(runs))):
                extra = ["--sgl-shard-report", ref["report"]] if plan == "measured" else []
                run = run_pytest(work, f"shard-{plan}-{rep + 1}-{k}",
                                 [*common_args, "--sgl-shard", f"{k}/{SHARDS}", *extra], None)
                run["cost"] = sum(t["seconds"] for t in run["tests"].values())
                done[plan][k] = run
                progress(f"round {rep + 1}: shard {k}/{SHARDS} ({plan}): {len(run['tests'])} tests, "
                         f"{run['cost']:.1f} s measured")
        for plan in runs:
            runs[plan].append([done[plan][k] for k in range(1, SHARDS + 1)])
    out: dict[str, Any] = {"reps": reps, "reference_tests": len(selection),
                           "reference_cost": sum(t["seconds"] for t in ref["tests"].values()),
                           "reference_seconds": {n: t["seconds"] for n, t in ref["tests"].items()},
                           "reference_rc": ref["rc"], "plans": {}}
    for plan, rounds in runs.items():
        costs = [common.median([rnd[k]["cost"] for rnd in rounds]) for k in range(SHARDS)]
        balances = [max(r["cost"] for r in rnd) / (sum(r["cost"] for r in rnd) / SHARDS) for rnd in rounds]
        ids = [set(r["tests"]) for r in rounds[0]]
        same_every_round = all([set(r["tests"]) for r in rnd] == ids for rnd in rounds)
        configs = [{t["config"] for t in r["tests"].values()} for r in rounds[0]]
        estimates = [r["estimate"] for r in rounds[0] if r["estimate"] is not None]
        est_balance = (max(e[0] for e in estimates) / (estimates[0][1] / SHARDS)
                       if len(estimates) == SHARDS and estimates[0][1] > 0 else None)
        out["plans"][plan] = {
            "costs": costs, "tests": [len(x) for x in ids], "configurations": [len(c) for c in configs],
            "balance": common.median(balances), "balance_range": (min(balances), max(balances)),
            "estimated_balance": est_balance,
            "union_is_selection": set().union(*ids) == selection and same_every_round,
            "disjoint": sum(len(x) for x in ids) == len(set().union(*ids)),
            "configs_whole": sum(len(c) for c in configs) == len(set().union(*configs)),
            "ok": all(r["rc"] == 0 for rnd in rounds for r in rnd),
            "rounds": [[{"cost": r["cost"], "rc": r["rc"],
                         "seconds": {n: t["seconds"] for n, t in r["tests"].items()}} for r in rnd]
                       for rnd in rounds],
        }
    return out


# ---------------------------------------------------------------------------------------------- output


def machine_line(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    commit = f"commit `{m['commit']}`"
    if m["dirty"]:
        commit += f" plus uncommitted changes in {', '.join(f'`{p}`' for p in m['dirty'])}"
    settings = (f"`bench/ray_cluster.py` {' '.join(meta['argv']) or 'default settings'} ({meta['reps']} rounds, "
                f"simulated startup {STARTUP} s)")
    return (f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']}, Ray {meta['ray']}; "
            f"{commit}; {settings}; {meta['date']}, {meta['total_seconds']:.0f} s, load average "
            f"{meta['load_before']} before, {meta['load_after']} after.")


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    shapes = ", ".join(f"2 x ({n} test{'s' if n != 1 else ''} x {s:g} s)" for n, s in SHAPES)
    tests = sum(n for n, _ in CONFIGS)
    out = ["### Ray cluster and sharding (`bench/ray_cluster.py`)", "", machine_line(meta), "",
           f"Suite: {len(CONFIGS)} worker configurations, {tests} tests: {shapes}."]
    r = results.get("ray")
    if r:
        rows = r["rows"]
        out += ["", f"**Ray cluster against local file leases** (`-n {XDIST}`, {GPUS} GPUs; {r['reps']} rounds "
                f"interleaved after one unmeasured run of each; launches a run: local "
                f"{', '.join(map(str, r['launches']['local']))}, Ray {', '.join(map(str, r['launches']['ray']))}):",
                "", "| what (median) | local leases | Ray cluster | ray / local (range of the rounds) |",
                "|---|---|---|---|",
                f"| whole run, wall | {common.fmt_s(rows['wall']['local'])} | {common.fmt_s(rows['wall']['ray'])} | "
                f"{common.fmt_ratio(rows['wall']['ratio'], rows['wall']['range'])} |"]
        for name, _, _ in PHASES:
            row = rows[name]
            out.append(f"| {PHASE_LABELS[name]} | {common.fmt_s(row['local'])} | {common.fmt_s(row['ray'])} | "
                       f"{common.fmt_ratio(row['ratio'], row['range'])} |")
        extra = (rows["total"]["ray"] - rows["total"]["local"]
                 if rows["total"]["ray"] is not None and rows["total"]["local"] is not None else None)
        out += ["", f"Launch overhead of the Ray path: {common.fmt_s(extra)} a worker (median lease requested -> "
                f"ready, Ray minus local; the engine's own startup is {STARTUP} s in both)."]
    s = results.get("shard")
    if s:
        out += ["", f"**`--sgl-shard k/{SHARDS}`** (one runner each, no `-n`, `sim:{GPUS}`, `--sgl-launch-ahead 0`; "
                f"{s['reps']} rounds; the unsharded reference: {s['reference_tests']} tests, "
                f"{s['reference_cost']:.1f} s of test seconds):", "",
                "| plan | measured cost of shards 1-4 (median) | tests | largest / (total / 4) (median, range of "
                "the rounds) | the same, planner's estimate |",
                "|---|---|---|---|---|"]
        labels = {"measured": "by the reference's measured times (`--sgl-shard-report`)",
                  "count": "by test count (no report)"}
        for plan, p in s["plans"].items():
            est = "-" if p["estimated_balance"] is None else f"{p['estimated_balance']:.2f}"
            out.append(f"| {labels[plan]} | {', '.join(f'{c:.1f}' for c in p['costs'])} s | "
                       f"{', '.join(map(str, p['tests']))} | **{p['balance']:.2f}** "
                       f"({p['balance_range'][0]:.2f}-{p['balance_range'][1]:.2f}) | {est} |")
        checks = []
        for plan, p in s["plans"].items():
            good = p["union_is_selection"] and p["disjoint"] and p["configs_whole"]
            checks.append(f"{plan}: {'yes' if good else 'NO'}" + ("" if good else
                          f" (union = selection {p['union_is_selection']}, disjoint {p['disjoint']}, "
                          f"each configuration on one shard {p['configs_whole']})"))
        out += ["", "The planner's estimate is the same figure from the costs it planned with (seconds from the "
                "report; tests when by count). Union of the 4 shards = the unsharded selection (the same shards "
                "every round), shards disjoint, each configuration on one shard: " + "; ".join(checks) + "."]
    if results.get("leftover") is not None:
        left = results["leftover"]
        out += ["", f"Ray processes of the bench's cluster left after its stop: {len(left)}"
                + (f" ({', '.join(map(str, left))})" if left else "") + "."]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="rounds of the Ray / local comparison (default 2)")
    parser.add_argument("--only", default="ray,shard", help="comma-separated parts: ray, shard (default: both)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure and sample as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, run reports)")
    common.add_render_option(parser)
    ns = parser.parse_args(argv)
    if ns.render is not None:
        return common.print_rendered(ns.render, markdown)
    parts = {p.strip() for p in ns.only.split(",") if p.strip()}
    if not parts or parts - {"ray", "shard"}:
        parser.error("--only takes ray, shard or both")
    for key in list(os.environ):  # as bench/run.py: measured processes get no plugin settings
        if key in common._DROPPED_ENV or key.startswith(common._DROPPED_PREFIXES):
            del os.environ[key]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    work = Path(tempfile.mkdtemp(prefix="sglbench-ray-"))
    (work / "suite").mkdir()
    (work / "suite" / "test_suite.py").write_text(suite_text())
    package = subprocess.run([sys.executable, "-c", "import pytest_sglworker; print(pytest_sglworker.__file__)"],
                             env=common.clean_env(), cwd=work, capture_output=True, text=True).stdout.strip()
    if not package.startswith(str(REPO) + os.sep):
        parser.error(f"the measured processes import pytest_sglworker from {package or '?'}, not from {REPO}")
    ray_version = "-"
    if "ray" in parts:
        ray_version = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"],
                                     capture_output=True, text=True).stdout.strip() or "?"
    t_start = time.perf_counter()
    results: dict[str, Any] = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": common.machine(), "reps": ns.reps, "parts": sorted(parts),
        "argv": sys.argv[1:] if argv is None else argv,
        "ray": ray_version, "load_before": round(os.getloadavg()[0], 2), "package": package,
        "suite": [list(c) for c in CONFIGS]}}
    temp = tempfile.mkdtemp(prefix="sglray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        if "ray" in parts:
            mark = uuid.uuid4().hex
            progress("starting a local Ray cluster (4 GPUs declared)")
            head, address = start_cluster(temp, mark)
            try:
                results["ray"] = bench_ray(work, ns.reps, address)
            finally:
                results["leftover"] = stop_cluster(head, mark)
        if "shard" in parts:
            results["shard"] = bench_shard(work, ns.reps)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        if ns.keep:
            progress(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["meta"]["load_after"] = round(os.getloadavg()[0], 2)
    results["meta"]["total_seconds"] = round(time.perf_counter() - t_start, 1)
    sys.stdout.write(markdown(results))
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        progress(f"figures written to {ns.json}")
    bad = not results.get("ray", {}).get("ok", True) or bool(results.get("leftover"))
    shard = results.get("shard")
    if shard:
        bad = bad or shard["reference_rc"] != 0 or not all(
            p["ok"] and p["union_is_selection"] and p["disjoint"] and p["configs_whole"]
            for p in shard["plans"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
