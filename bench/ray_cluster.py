#!/usr/bin/env python
"""Benchmark of ``--sgl-cluster ray`` (issue 13): a local Ray cluster against local file leases, side by side.

    .venv/bin/python bench/ray_cluster.py            # 2 rounds, about 3 minutes on 2 CPUs
    .venv/bin/python bench/ray_cluster.py --reps 3

One suite of 8 worker configurations (3 tests each, 0.1 s a test) under ``-n 4``, the simulated engine
starting in 1 s: once with ``--sgl-gpus sim:4`` (file-lock leases), once with ``--sgl-cluster ray`` on a local
Ray cluster started here with 4 declared GPUs (``ray start --head --num-gpus 4 --num-cpus 4``), rounds
interleaved, the order rotated. Wall is the whole ``pytest`` process; the ratio is ray / local of the medians,
the spread the range of the per-round ratios. Prints one markdown line; exit status 1 when a run failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUITE = "import time\nimport pytest\n" + "".join(f"""

@pytest.mark.sgl_worker(args=["--max-total-tokens", "{4096 + 64 * c}"])
@pytest.mark.parametrize("i", range(3))
def test_config_{c}(sgl_worker, i):
    assert sgl_worker.client.get("/health").status_code == 200
    time.sleep(0.1)
""" for c in range(8))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_cluster(temp: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--num-gpus=4", "--num-cpus=4", f"--port={port}",
                             "--disable-usage-stats", "--include-dashboard=false", f"--temp-dir={temp}",
                             "--node-ip-address=127.0.0.1"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    probe = "import ray, sys; ray.init(address=sys.argv[1]); assert ray.cluster_resources().get('GPU') == 4"
    deadline = time.monotonic() + 120
    while subprocess.run([sys.executable, "-c", probe, address], capture_output=True).returncode != 0:
        if time.monotonic() > deadline or head.poll() is not None:
            raise SystemExit("the local Ray cluster did not come up")
        time.sleep(0.5)
    return head, address


def _run(work: Path, variant: str, address: str) -> float:
    env = dict(os.environ, SGLSIM_STARTUP_SECONDS="1", SGLWORKER_LOG_DIR=str(work / "logs"),
               SGLWORKER_LOCK_DIR=str(work / "locks"), RAY_ADDRESS=address)
    args = ["--sgl-gpus", "sim:4"] if variant == "local" else ["--sgl-cluster", "ray"]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4",
                           "--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", *args, str(work / "suite")],
                          env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-2000:])
        raise SystemExit(f"the {variant} run failed ({done.returncode})")
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sglbench-ray-"))
    (work / "suite").mkdir()
    (work / "suite" / "test_suite.py").write_text(SUITE)
    temp = tempfile.mkdtemp(prefix="sglray-", dir="/tmp")
    head, address = _start_cluster(temp)
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    try:
        for rep in range(args.reps):
            order = ["local", "ray"] if rep % 2 == 0 else ["ray", "local"]
            for variant in order:
                wall = _run(work, variant, address)
                walls[variant].append(wall)
                print(f"round {rep + 1}: {variant} {wall:.1f} s", file=sys.stderr)
    finally:
        with __import__("contextlib").suppress(OSError):
            os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    local, ray = statistics.median(walls["local"]), statistics.median(walls["ray"])
    ratios = [r / loc for r, loc in zip(walls["ray"], walls["local"], strict=True)]
    print(f"| 8 configurations x 3 tests, -n 4, 4 GPUs | local leases {local:.1f} s | Ray cluster {ray:.1f} s | "
          f"ray / local {ray / local:.2f} [{min(ratios):.2f}-{max(ratios):.2f}] | {args.reps} rounds |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
