"""Worker groups and the router, for bench/run.py part ``groups`` (run with ``--sgl-gpus sim:4``).

- ``test_pd`` and ``test_four``: a fresh 1+1 prefill/decode group and a fresh 4-worker group per test
  (``BENCH_GROUP_REPS`` tests each, default 3); the bench reads, from the ``--sgl-report`` launch records, how
  long each group took from its request to its test against its slowest member's startup.
- ``test_router_*``: the real sglang router in front of a pooled 2-worker group, started fresh for each test
  (``BENCH_ROUTER_REPS`` tests, default 4). Each test also starts a bare copy of the same router (the same
  argv on other ports) and polls it every millisecond until it reports both workers healthy: the router's own
  time to ready, with the criterion of the plugin's ``RouterReadiness``. Half the tests start the bare router
  before the plugin's (fixture order), half after, so that neither always runs on a busier machine. The times
  go to ``$BENCH_GROUPS_OUT/bare-routers.jsonl``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

REPS = int(os.environ.get("BENCH_GROUP_REPS", "3"))
ROUTER_REPS = int(os.environ.get("BENCH_ROUTER_REPS", "4"))
OUT = os.environ.get("BENCH_GROUPS_OUT", "")


@pytest.mark.sgl_workers(prefill=1, decode=1, fresh=True)
@pytest.mark.parametrize("i", range(REPS))
def test_pd(sgl_workers, i):  # type: ignore[no-untyped-def]
    assert len(sgl_workers.prefill) == 1 and len(sgl_workers.decode) == 1


@pytest.mark.sgl_workers(count=4, fresh=True)
@pytest.mark.parametrize("i", range(REPS))
def test_four(sgl_workers, i):  # type: ignore[no-untyped-def]
    assert len(sgl_workers.workers) == 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _bare_router_seconds(argv: list[str], urls: list[str]) -> float:
    """Start ``argv`` on fresh ports; seconds from Popen to /health 200 and /workers listing ``urls`` healthy."""
    argv = list(argv)
    for flag in ("--port", "--prometheus-port"):
        argv[argv.index(flag) + 1] = str(_free_port())
    port = int(argv[argv.index("--port") + 1])
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while time.perf_counter() - t0 < 60:
            assert proc.poll() is None, f"the bare router exited with {proc.returncode}"
            try:
                status, _ = _get(port, "/health")
                if status == 200:
                    status, body = _get(port, "/workers")
                    workers = json.loads(body)["workers"] if status == 200 else []
                    healthy = [w for w in workers if w.get("is_healthy") and any(
                        str(w.get("url", "")).startswith(u) for u in urls)]
                    if len(healthy) >= len(urls):
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.001)
        raise AssertionError("the bare router did not get ready in 60 s")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _record(request, router, order: str, seconds: float) -> None:  # type: ignore[no-untyped-def]
    if OUT:
        with open(os.path.join(OUT, "bare-routers.jsonl"), "a") as fh:
            fh.write(json.dumps({"nodeid": request.node.nodeid, "order": order, "bare_seconds": seconds,
                                 "router_port": router.port}) + "\n")


@pytest.fixture
def bare_router_first(request, sgl_workers):  # type: ignore[no-untyped-def]
    """Set up after the workers and before ``sgl_router`` (the test lists it first)."""
    from pytest_sglworker.workers.router import default_router_launcher, router_argv

    argv = router_argv(default_router_launcher(), port=1, prometheus_port=2, group=sgl_workers, policy=None, args=())
    return _bare_router_seconds(argv, list(sgl_workers.urls))


@pytest.mark.sgl_workers(count=2)
@pytest.mark.parametrize("i", range(0, ROUTER_REPS, 2))
def test_router_bare_first(request, sgl_workers, bare_router_first, sgl_router, i):  # type: ignore[no-untyped-def]
    _record(request, sgl_router, "bare first", bare_router_first)


@pytest.mark.sgl_workers(count=2)
@pytest.mark.parametrize("i", range(1, ROUTER_REPS, 2))
def test_router_bare_after(request, sgl_workers, sgl_router, i):  # type: ignore[no-untyped-def]
    _record(request, sgl_router, "bare after", _bare_router_seconds(list(sgl_router.argv), list(sgl_workers.urls)))
