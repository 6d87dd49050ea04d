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

``--hostile`` mixes hostile engines among the healthy ones (issue #12), one kind per test, round robin:

- ``trickle``: answers every request with ``HTTP/1.1 200 OK`` and then one header line every 0.5 s, forever;
  the test has ``startup_timeout=2``: its setup must fail naming the timeout, within 2 s + a margin;
- ``frozen``: a healthy simulated engine that the test SIGSTOPs; its teardown must be quick;
- ``escape``: a healthy engine whose grandchild calls setsid, drops the ownership marker and inherits the
  listening socket (the issue's escaped listener), so it keeps LISTEN on the worker's port after teardown;
- ``crash``: the simulated engine's CUDA OOM during graph capture (``crash_oom``): the setup must fail with
  the exit and the diagnosis;
- ``die``: dies (SIGKILL) on its first inference request during the test: the teardown must report it;
- ``healthy``, ``escape_child``: as in the plain soak.

It then also counts the **failures reported correctly** (each test's outcome and message against what its kind
must give, from a per-phase record every xdist worker writes), the **longest time past a deadline** (setup
of a startup failure beyond its startup timeout) and the longest teardown of a stopped worker; the logs of
the failed launches are expected to be kept, any other log is a leak.

Usage (from the repository root)::

    .venv/bin/python bench/soak.py                     # 300 launches, -n 2, sim:2
    .venv/bin/python bench/soak.py --launches 40       # a short one
    .venv/bin/python bench/soak.py --json soak.json    # also write the figures as JSON
    .venv/bin/python bench/soak.py --hostile           # 300 launches, hostile engines among healthy ones
    .venv/bin/python bench/soak.py --hostile --kinds trickle,frozen,healthy   # only some kinds

Exit status: 0 when nothing leaked (and, with ``--hostile``, every failure was reported correctly), 1 on a leak,
2 when the soak itself failed (a test failed unexpectedly, a failure was misreported, pytest crashed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

from pytest_sglworker.engine.sglang_facts import READY_PATH

HOSTILE_KINDS = ("trickle", "frozen", "escape", "crash", "die", "healthy", "escape_child", "healthy")
#: startup timeout of the tests whose engine never becomes healthy
HOSTILE_STARTUP_TIMEOUT = 2.0
#: a startup failure may end this long after its deadline (the wait's last probe, the teardown)
DEADLINE_MARGIN = 2.0

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


HOSTILE_ENGINE = r'''
"""The soak's engine: SOAK_ENGINE=trickle|escape run here, anything else is the simulated engine."""
import json, os, runpy, socket, subprocess, sys, threading, time

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
kind = os.environ.get("SOAK_ENGINE", "healthy")
line = json.dumps({"port": port, "kind": kind, "pid": os.getpid()}) + "\n"
fd = os.open(os.path.join(os.environ["SOAK_OUT"], "engines.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
os.write(fd, line.encode())
os.close(fd)
if kind not in ("trickle", "escape"):
    sys.argv = ["pytest_sglworker.sim", *argv]
    runpy.run_module("pytest_sglworker.sim", run_name="__main__", alter_sys=True)
    sys.exit(0)

server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen(64)

if kind == "escape":
    ESCAPEE = "import socket, sys, time\nheld = socket.socket(fileno=int(sys.argv[1]))\ntime.sleep(30)\n"
    SPAWNER = (
        "import os, subprocess, sys\n"
        "env = {k: v for k, v in os.environ.items() if k != 'SGLWORKER_OWNER'}\n"
        "subprocess.Popen([sys.executable, '-c', sys.argv[2], sys.argv[1]], pass_fds=(int(sys.argv[1]),), env=env,"
        " start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    )
    subprocess.run([sys.executable, "-c", SPAWNER, str(server.fileno()), ESCAPEE], pass_fds=(server.fileno(),),
                   check=True)
    print("The server is fired up and ready to roll!", flush=True)


def serve(conn):
    with conn:
        try:
            conn.recv(65536)
            if kind == "escape":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                conn.recv(65536)  # keep-alive until the client closes
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            n = 0
            while True:
                time.sleep(0.5)
                conn.sendall(f"X-Trickle-{n}: 1\r\n".encode())
                n += 1
        except OSError:
            pass


while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''

HOSTILE_CONFTEST = '''
import json, os, time
import pytest

OUT = os.environ["SOAK_OUT"]


def _write(name, record):
    with open(os.path.join(OUT, f"{name}-{os.getpid()}.jsonl"), "a") as fh:
        fh.write(json.dumps(record) + "\\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _write("phases", {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                      "duration": round(call.stop - call.start, 3), "message": str(report.longrepr or "")[:4000]})
    return report


def _listeners(port):
    import psutil

    try:
        return sorted({c.pid or -1 for c in psutil.net_connections("tcp")
                       if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port})
    except psutil.AccessDenied:
        found = []
        for proc in psutil.process_iter():
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                       for c in proc.net_connections("tcp")):
                    found.append(proc.pid)
            except psutil.Error:
                continue
        return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    worker = item.funcargs.get("sgl_worker")
    result = yield
    if worker is not None:  # after its teardown, nothing may listen on the worker's ports any more
        deadline = time.monotonic() + 1.0
        for port in (worker.port, worker.port + 1):
            while (pids := _listeners(port)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pids:
                _write("listeners", {"nodeid": item.nodeid, "port": port, "pids": pids})
    return result
'''

HOSTILE_TESTS = '''
import json, os, signal, time
import pytest

N = int(os.environ["SOAK_LAUNCHES"])
OUT = os.environ["SOAK_OUT"]
KINDS = os.environ["SOAK_KINDS"].split(",")
TIMEOUT = float(os.environ["SOAK_STARTUP_TIMEOUT"])
MARKS = {
    "healthy": {}, "frozen": {},
    "escape_child": {"env": {"SGLSIM_FAULT": "escape_child"}},
    "trickle": {"env": {"SOAK_ENGINE": "trickle"}, "startup_timeout": TIMEOUT},
    "escape": {"env": {"SOAK_ENGINE": "escape"}},
    "crash": {"env": {"SGLSIM_FAULT": "crash_oom"}},
    "die": {"env": {"SGLSIM_FAULT": "die_after=1"}},
}


def _sample(worker, kind):
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/statm") as fh:
        rss_pages = int(fh.read().split()[1])
    assert worker.client.get("/health").status_code == 200
    record = {"xdist": os.getpid(), "t": time.time(), "fds": fds, "rss_kib": rss_pages * os.sysconf("SC_PAGE_SIZE")
              // 1024, "port": worker.port, "worker": worker.pid, "kind": kind}
    with open(os.path.join(OUT, f"samples-{os.getpid()}.jsonl"), "a") as fh:
        fh.write(json.dumps(record) + "\\n")


# One test per launch, the kinds interleaved (run with --sgl-reorder off), so that hostile engines run among
# healthy ones all along, and escapees are alive at the end too.
PARAMS = [pytest.param(KINDS[i % len(KINDS)], i, marks=pytest.mark.sgl_worker(**MARKS[KINDS[i % len(KINDS)]]),
                       id=f"{KINDS[i % len(KINDS)]}-{i}") for i in range(N)]


@pytest.mark.parametrize(("kind", "i"), PARAMS)
def test_launch(kind, i, sgl_worker):
    if kind in ("trickle", "crash"):
        raise AssertionError(f"a {kind} engine can never be healthy")
    _sample(sgl_worker, kind)
    if kind == "frozen":
        os.kill(sgl_worker.pid, signal.SIGSTOP)
    elif kind == "die":
        sgl_worker.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        sgl_worker.process.wait(10)
'''

#: kind -> (phase that must fail or None, fragments its message must hold)
EXPECTED: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "healthy": (None, ()), "escape_child": (None, ()), "frozen": (None, ()), "escape": (None, ()),
    "trickle": ("setup", (f"did not become healthy within {HOSTILE_STARTUP_TIMEOUT:g} s",
                          f"no complete answer to GET {READY_PATH} in time")),
    "crash": ("setup", ("exited during startup with code -9 (SIGKILL)", "CUDA out of memory")),
    "die": ("teardown", ("exited with code -9 (SIGKILL) during the test", "simulated death after 1 requests")),
}


def _judge(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per test: the phases recorded for it against what its kind must give."""
    by_test: dict[str, dict[str, dict[str, Any]]] = {}
    for p in phases:
        by_test.setdefault(p["nodeid"], {})[p["when"]] = p
    wrong: list[str] = []
    expected_failures = correct = 0
    past_deadline: list[float] = []
    stopped_teardowns: list[float] = []
    per_kind: dict[str, int] = {}
    for nodeid, seen in sorted(by_test.items()):
        named = re.search(r"-([a-z_]+)-\d+\]$", nodeid)  # test_launch[qwen3-0.6b-<kind>-<i>]
        if named is None or named.group(1) not in EXPECTED:
            wrong.append(f"{nodeid}: not a test of the hostile mix")
            continue
        kind = named.group(1)
        per_kind[kind] = per_kind.get(kind, 0) + 1
        failing, fragments = EXPECTED[kind]
        failed = [when for when, p in seen.items() if p["outcome"] == "failed"]
        if failing is not None:
            expected_failures += 1
            message = seen.get(failing, {}).get("message", "")
            if failed == [failing] and all(f in message for f in fragments) and "_pytest/" not in message:
                correct += 1
            else:
                wrong.append(f"{nodeid}: failed in {failed or 'no phase'}, expected {failing} with {fragments}")
        elif failed:
            wrong.append(f"{nodeid}: unexpected failure in {failed}: {seen[failed[0]]['message'][:300]}")
        if failing == "setup" and "setup" in seen:
            deadline = HOSTILE_STARTUP_TIMEOUT if kind == "trickle" else 0.0
            if deadline:
                past_deadline.append(max(seen["setup"]["duration"] - deadline, 0.0))
        if kind == "frozen" and "teardown" in seen:
            stopped_teardowns.append(seen["teardown"]["duration"])
    return {
        "tests": sum(per_kind.values()), "per_kind": per_kind, "expected_failures": expected_failures,
        "failures_reported_correctly": correct, "misreported": wrong,
        "longest_past_deadline_s": round(max(past_deadline, default=0.0), 2),
        "longest_stopped_teardown_s": round(max(stopped_teardowns, default=0.0), 2),
        "stopped_teardowns_over_3s": sum(1 for t in stopped_teardowns if t > 3.0),
    }


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
            for pconn in psutil.Process(pid).net_connections("tcp"):
                if pconn.status == psutil.CONN_LISTEN and pconn.laddr:
                    result[pconn.laddr.port] = pid
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
    kinds = args.kinds.split(",") if args.kinds else list(HOSTILE_KINDS)
    if args.hostile:
        (work / "test_soak.py").write_text(HOSTILE_TESTS)
        (work / "conftest.py").write_text(HOSTILE_CONFTEST)
        (work / "soak_engine.py").write_text(HOSTILE_ENGINE)
    else:
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
    if args.hostile:
        env.update({"SOAK_KINDS": ",".join(kinds), "SOAK_STARTUP_TIMEOUT": str(HOSTILE_STARTUP_TIMEOUT)})
    if "SGLWORKER_TEST_MARK" in os.environ:  # run from the project's tests: keep their leftover check working
        env["SGLWORKER_TEST_MARK"] = os.environ["SGLWORKER_TEST_MARK"]
    report = work / "report.json"
    cmd = [sys.executable, "-m", "pytest", "test_soak.py", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-n", str(args.workers), "--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b",
           "--sgl-gpus", f"sim:{args.gpus}", "--sgl-reuse", "off", f"--sgl-report={report}",
           "--sgl-log-retention-policy", "failed"]
    if args.hostile:
        cmd += ["--sgl-launcher", f"{sys.executable} {work / 'soak_engine.py'}", "--sgl-reorder", "off"]
    mix = f", hostile mix {','.join(kinds)}" if args.hostile else ""
    print(f"soak: {args.launches} launches, -n {args.workers}, sim:{args.gpus}, startup {args.startup:g} s{mix}, "
          f"in {work}", file=sys.stderr)
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - start

    # Leftovers: give watchdogs and the kernel a moment, then count.
    deadline = time.monotonic() + args.grace
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = _marked(mark)
    samples = [json.loads(line) for f in out.glob("samples-*.jsonl") for line in f.read_text().splitlines()]
    engines = [json.loads(line) for line in (out / "engines.jsonl").read_text().splitlines()] \
        if (out / "engines.jsonl").exists() else []
    used_ports = {s["port"] for s in samples} | {e["port"] for e in engines}
    # Ports are counted before the leftovers are ended: a leftover's listening socket is a leaked port too.
    listening = _listening_ports()
    leaked_ports = sorted(p for p in used_ports if p in listening)
    leaked_ports += sorted(p for p in _listening_ports(set(leftover)) if p not in leaked_ports)
    for pid in leftover:  # counted; now end them, so that a leaky run leaves nothing behind either
        with contextlib.suppress(Exception):
            import psutil

            psutil.Process(pid).kill()
    records = sorted(p.name for p in lock_dir.glob("gpu-*.json")) if lock_dir.is_dir() else []
    held = sorted(p.name for p in lock_dir.glob("*.lock") if _locked(p)) if lock_dir.is_dir() else []
    logs = sorted(p.name for p in log_dir.glob("sglang-worker-*.log")) if log_dir.is_dir() else []
    fds = _fd_growth(samples)
    launches = failed_launches = 0
    if report.exists():
        workers = json.loads(report.read_text())["workers"].values()
        launches = sum(w["launches"] for w in workers)
        failed_launches = sum(w["failures"] for w in workers)
    judged: dict[str, Any] = {}
    expected_logs = 0
    if args.hostile:
        phases = [json.loads(line) for f in out.glob("phases-*.jsonl") for line in f.read_text().splitlines()]
        judged = _judge(phases)
        judged["listened_after_teardown"] = [
            json.loads(line) for f in out.glob("listeners-*.jsonl") for line in f.read_text().splitlines()]
        expected_logs = judged["expected_failures"]
        logs = logs[expected_logs:]  # as many logs as failed launches are kept on purpose

    figures: dict[str, Any] = {
        "launches_requested": args.launches, "launches": launches, "failed_launches": failed_launches,
        "launch_attempts": launches + failed_launches, "tests_sampled": len(samples), **judged,
        "xdist_workers": len(fds), "wall_seconds": round(wall, 1),
        "launches_per_second": round(launches / wall, 2) if wall else None,
        "pytest_exit": done.returncode,
        "leaked_processes": leftover, "leaked_ports": leaked_ports, "leaked_lease_records": records,
        "held_locks": held, "leftover_logs": logs,
        "fd_growth": {str(k): v for k, v in fds.items()},
    }
    fd_leak = sum(v["fd_growth"] for v in fds.values())
    attempts = launches + failed_launches
    print(f"launches            {attempts} of {args.launches} in {wall:.1f} s ({launches} healthy, {failed_launches} "
          f"failed to start; {figures['launches_per_second']}/s), pytest exit {done.returncode}")
    if args.hostile:
        print(f"tests by kind       {judged['per_kind']}")
        print(f"failures reported   {judged['failures_reported_correctly']} of {judged['expected_failures']} "
              "correctly" + (f"; misreported: {judged['misreported'][:5]}" if judged["misreported"] else ""))
        print(f"past a deadline     longest {judged['longest_past_deadline_s']:.2f} s (startup timeout "
              f"{HOSTILE_STARTUP_TIMEOUT:g} s, margin {DEADLINE_MARGIN:g} s)")
        print(f"stopped teardowns   longest {judged['longest_stopped_teardown_s']:.2f} s, "
              f"{judged['stopped_teardowns_over_3s']} over 3 s")
        after = judged["listened_after_teardown"]
        print(f"ports still listened on after their worker's teardown: {len(after)}"
              + (f"  e.g. {after[:3]}" if after else ""))
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
    leaked = bool(leftover or fd_leak or leaked_ports or records or held or logs
                  or judged.get("listened_after_teardown"))
    if args.hostile:
        failed = (done.returncode not in (0, 1) or "INTERNALERROR" in done.stdout + done.stderr
                  or attempts != args.launches or judged["tests"] != args.launches or bool(judged["misreported"])
                  or judged["longest_past_deadline_s"] > DEADLINE_MARGIN)
    else:
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
    parser.add_argument("--hostile", action="store_true",
                        help="hostile engines (trickling, frozen, escaping, crashing, dying) among healthy ones")
    parser.add_argument("--kinds", default="", help=f"with --hostile: the kinds, round robin (default "
                        f"{','.join(HOSTILE_KINDS)})")
    args = parser.parse_args(argv)
    if args.launches < 1 or args.workers < 1 or args.gpus < 1:
        parser.error("--launches, --workers and --gpus must be at least 1")
    if args.kinds and not args.hostile:
        parser.error("--kinds needs --hostile")
    unknown = sorted(set(filter(None, args.kinds.split(","))) - set(HOSTILE_KINDS))
    if unknown:
        parser.error(f"unknown kind(s) {', '.join(unknown)}; known: {', '.join(sorted(set(HOSTILE_KINDS)))}")
    if args.hostile and args.inject_leak:
        parser.error("--inject-leak is for the plain soak")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
