#!/usr/bin/env python3
"""Soak: a few hundred worker launches and teardowns under xdist, and every leak counted. None is allowed.

Runs one real pytest session, ``-n N`` on a declared ``sim:G`` inventory with ``--sgl-reuse off``, so that every
test launches a fresh simulated engine and tears it down; every fourth worker also spawns a child that leaves
its process group (``SGLSIM_FAULT=escape_child``), which teardown must find by its environment marker. Then:

- **processes**: anything still alive that carries the soak's environment marker (workers, escaped children,
  watchdogs, xdist workers), after a grace of a few seconds;
- **file descriptors**: each test samples ``/proc/self/fd`` of its xdist worker at its start; the growth from
  the first samples (after warm-up) to the last ones, per xdist worker and per launch;
- **ports**: listening sockets on any port a worker used, and listening sockets of leftover marked processes;
- **leases**: GPU holder records (``gpu-*.json``) left in the lock directory, and lock files still locked;
- **logs**: worker logs left in the log directory (every test passes, so every log must be deleted).

Usage (from the repository root)::

    .venv/bin/python bench/soak.py                     # 300 launches, -n 2, sim:2
    .venv/bin/python bench/soak.py --launches 40       # a short one
    .venv/bin/python bench/soak.py --json soak.json    # also write the figures as JSON

Exit status: 0 when nothing leaked, 1 on a leak, 2 when the soak itself failed (a test failed, pytest crashed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

SOAK_MARK = "SGLWORKER_SOAK_MARK"
#: Samples skipped at the start of each xdist worker: the first launches import httpx, psutil, filelock.
WARMUP_SAMPLES = 5

TEST_FILE = '''
import json, os, subprocess, time
import pytest

N = int(os.environ["SOAK_LAUNCHES"])
OUT = os.environ["SOAK_OUT"]
INJECT = os.environ.get("SOAK_INJECT_LEAK") == "1"
KEPT = []


def _sample(worker, kind):
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/statm") as fh:
        rss_pages = int(fh.read().split()[1])
    assert worker.client.get("/health").status_code == 200
    record = {"xdist": os.getpid(), "t": time.time(), "fds": fds, "rss_kib": rss_pages * os.sysconf("SC_PAGE_SIZE")
              // 1024, "port": worker.port, "worker": worker.pid, "kind": kind}
    with open(os.path.join(OUT, f"samples-{os.getpid()}.jsonl"), "a") as fh:
        fh.write(json.dumps(record) + "\\n")
    if INJECT:  # --inject-leak: prove the detectors see a leak (an fd per launch, one detached process)
        KEPT.append(open(os.devnull))
        if len(KEPT) == 1:
            subprocess.Popen(["sleep", "60"], start_new_session=True)


@pytest.mark.parametrize("i", [i for i in range(N) if i % 4])
def test_plain(i, sgl_worker):
    _sample(sgl_worker, "plain")


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "escape_child"})
@pytest.mark.parametrize("i", [i for i in range(N) if i % 4 == 0])
def test_escaped_child(i, sgl_worker):
    _sample(sgl_worker, "escape_child")
'''


def _marked(mark: str) -> dict[int, str]:
    import psutil

    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            if proc.environ().get(SOAK_MARK) == mark:
                found[proc.pid] = " ".join(proc.info["cmdline"] or ())[:160]
        except (psutil.Error, OSError):
            continue
    return found


def _listening_ports(pids: set[int] | None = None) -> dict[int, int]:
    """port -> pid of every TCP listening socket (of ``pids`` only, if given)."""
    import psutil

    result: dict[int, int] = {}
    if pids is None:
        try:
            for conn in psutil.net_connections("tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr:
                    result[conn.laddr.port] = conn.pid or -1
            return result
        except psutil.AccessDenied:
            pids = {p.pid for p in psutil.process_iter()}
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections("tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr:
                    result[conn.laddr.port] = pid
        except psutil.Error:
            continue
    return result


def _locked(path: Path) -> bool:
    from filelock import FileLock, Timeout

    lock = FileLock(path, thread_local=False)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return True
    lock.release(force=True)
    return False


def _fd_growth(samples: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    per: dict[int, list[dict[str, Any]]] = {}
    for s in sorted(samples, key=lambda s: s["t"]):
        per.setdefault(s["xdist"], []).append(s)
    result = {}
    for pid, rows in per.items():
        fds = [r["fds"] for r in rows]
        rss = [r["rss_kib"] for r in rows]
        start = min(WARMUP_SAMPLES, len(fds) // 3)
        window = max(1, min(5, (len(fds) - start) // 4))
        head, tail = fds[start:start + window], fds[-window:]
        launches = len(fds) - start
        growth = min(tail) - max(head)  # windows: robust against a one-off spike at either end
        result[pid] = {
            "launches": len(fds), "fds_first": head[0], "fds_last": fds[-1], "fds_min": min(fds), "fds_max": max(fds),
            "fd_growth": max(growth, 0), "fd_growth_per_launch": max(growth, 0) / max(launches - 1, 1),
            "rss_kib_first": rss[start], "rss_kib_last": rss[-1],
        }
    return result


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="sglworker-soak-"))
    out = work / "out"
    out.mkdir()
    (work / "test_soak.py").write_text(TEST_FILE)
    log_dir, lock_dir = work / "logs", work / "locks"
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SGLWORKER_", "SGLSIM_")) and k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env.update({
        SOAK_MARK: mark, "SOAK_LAUNCHES": str(args.launches), "SOAK_OUT": str(out),
        "SGLWORKER_LOG_DIR": str(log_dir), "SGLWORKER_LOCK_DIR": str(lock_dir),
        "SGLSIM_STARTUP_SECONDS": str(args.startup),
    })
    if args.inject_leak:
        env["SOAK_INJECT_LEAK"] = "1"
    if "SGLWORKER_TEST_MARK" in os.environ:  # run from the project's tests: keep their leftover check working
        env["SGLWORKER_TEST_MARK"] = os.environ["SGLWORKER_TEST_MARK"]
    report = work / "report.json"
    cmd = [sys.executable, "-m", "pytest", "test_soak.py", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-n", str(args.workers), "--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b",
           "--sgl-gpus", f"sim:{args.gpus}", "--sgl-reuse", "off", f"--sgl-report={report}"]
    print(f"soak: {args.launches} launches, -n {args.workers}, sim:{args.gpus}, startup {args.startup:g} s, "
          f"in {work}", file=sys.stderr)
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - start

    # Leftovers: give watchdogs and the kernel a moment, then count.
    deadline = time.monotonic() + args.grace
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = _marked(mark)
    for pid in leftover:  # counted; now end them, so that a leaky run leaves nothing behind either
        with contextlib.suppress(Exception):
            import psutil

            psutil.Process(pid).kill()
    samples = [json.loads(line) for f in out.glob("samples-*.jsonl") for line in f.read_text().splitlines()]
    used_ports = {s["port"] for s in samples}
    listening = _listening_ports()
    leaked_ports = sorted(p for p in used_ports if p in listening)
    leaked_ports += sorted(p for p in _listening_ports(set(leftover)) if p not in leaked_ports)
    records = sorted(p.name for p in lock_dir.glob("gpu-*.json")) if lock_dir.is_dir() else []
    held = sorted(p.name for p in lock_dir.glob("*.lock") if _locked(p)) if lock_dir.is_dir() else []
    logs = sorted(p.name for p in log_dir.glob("sglang-worker-*.log")) if log_dir.is_dir() else []
    fds = _fd_growth(samples)
    launches = 0
    if report.exists():
        launches = sum(w["launches"] for w in json.loads(report.read_text())["workers"].values())

    figures: dict[str, Any] = {
        "launches_requested": args.launches, "launches": launches, "tests_sampled": len(samples),
        "xdist_workers": len(fds), "wall_seconds": round(wall, 1),
        "launches_per_second": round(launches / wall, 2) if wall else None,
        "pytest_exit": done.returncode,
        "leaked_processes": leftover, "leaked_ports": leaked_ports, "leaked_lease_records": records,
        "held_locks": held, "leftover_logs": logs,
        "fd_growth": {str(k): v for k, v in fds.items()},
    }
    fd_leak = sum(v["fd_growth"] for v in fds.values())
    print(f"launches            {launches} of {args.launches} in {wall:.1f} s "
          f"({figures['launches_per_second']}/s), pytest exit {done.returncode}")
    for pid, f in sorted(fds.items()):
        print(f"xdist worker {pid:<7} {f['launches']} launches; fds {f['fds_first']} -> {f['fds_last']} "
              f"(min {f['fds_min']}, max {f['fds_max']}), growth {f['fd_growth']} "
              f"({f['fd_growth_per_launch']:.3f}/launch); RSS {f['rss_kib_first']} -> {f['rss_kib_last']} KiB")
    print(f"leaked processes    {len(leftover)}" + (f"  {leftover}" if leftover else ""))
    print(f"leaked fds          {fd_leak}")
    print(f"leaked ports        {len(leaked_ports)}" + (f"  {leaked_ports}" if leaked_ports else ""))
    print(f"leaked leases       {len(records) + len(held)}" + (f"  {records + held}" if records or held else ""))
    print(f"leftover logs       {len(logs)}" + (f"  {logs[:5]}" if logs else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    leaked = bool(leftover or fd_leak or leaked_ports or records or held or logs)
    failed = done.returncode != 0 or launches != args.launches
    if failed:
        print("soak FAILED to run cleanly:\n" + textwrap.indent((done.stdout + done.stderr)[-6000:], "  "),
              file=sys.stderr)
    if not args.keep and not failed and not leaked:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory kept: {work}", file=sys.stderr)
    print("result              " + ("LEAK" if leaked else "FAILED" if failed else "no leak"))
    return 1 if leaked else 2 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=300, help="worker launches (one per test; default 300)")
    parser.add_argument("-n", "--workers", type=int, default=2, help="xdist workers (default 2)")
    parser.add_argument("--gpus", type=int, default=2, help="declared GPUs, sim:N (default 2)")
    parser.add_argument("--startup", type=float, default=0.05, help="simulated startup seconds (default 0.05)")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds leftovers get to go away (default 10)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="limit for the pytest run (default 1800 s)")
    parser.add_argument("--json", help="also write the figures as JSON to this path")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--inject-leak", action="store_true",
                        help="self-check of the detectors: each test leaks an fd, each xdist worker a process")
    args = parser.parse_args(argv)
    if args.launches < 1 or args.workers < 1 or args.gpus < 1:
        parser.error("--launches, --workers and --gpus must be at least 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
