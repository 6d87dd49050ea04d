"""Teardown: the memory-release wait of a lease, measured for real, and a holder SIGKILLed mid-test.

Run in file order (``--sgl-reorder off``): each test's worker is torn down, and its lease given back, in the
test's teardown; the driver measures that from the events and its NVML samples. ``test_after_sigkill``
then checks, right after the SIGKILL test's teardown, that the GPU is leasable again with the memory it had.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from inner_helpers import emit, holder_info, read_events, wait_for

from pytest_sglworker.resources.gpus import LeaseManager, load_inventory, parse_gpus_option
from pytest_sglworker.workers.errors import WorkerDied


@pytest.mark.parametrize(("spec", "mode"), [("hold-30g", "free"), ("hold-30g", "exit"), ("hold-big", "exit")],
                         ids=["30g-free", "30g-exit", "big-exit"])
def test_release(spec: str, mode: str, sgl_spawn_worker: Any, record: Any, hold_seconds: float) -> None:
    worker = sgl_spawn_worker(spec, env={"GPU_CHECK_EXIT_MODE": mode})
    info = holder_info(worker)
    record(f"release-{spec}-{mode}", {"worker_pid": worker.pid, "spec": spec, "mode": mode, "holder": info})
    assert info["exit_mode"] == mode
    time.sleep(min(hold_seconds, 0.5))


def test_sigkill(sgl_spawn_worker: Any, record: Any) -> None:
    worker = sgl_spawn_worker("hold-30g")
    info = holder_info(worker)
    emit("kill_sent", target=worker.pid)
    os.kill(worker.pid, signal.SIGKILL)  # our own worker, by its pid
    died = wait_for(lambda: not worker.is_alive(), timeout=15)
    code = worker.returncode
    message = ""
    try:
        worker.check_alive()
    except WorkerDied as exc:
        message = str(exc).splitlines()[0]
    record("sigkill", {"worker_pid": worker.pid, "holder": info, "died": died, "returncode": code,
                       "died_message": message})
    assert died, f"holder pid {worker.pid} still alive 15 s after SIGKILL"
    assert code == -signal.SIGKILL, f"holder exited with {code}, not -9"
    assert "SIGKILL" in message, f"the plugin's death message does not name SIGKILL: {message!r}"


def test_after_sigkill(record: Any) -> None:
    """The killed holder's lease is free again and the memory it held is back: a lease for what was free
    before it is granted at once."""
    killed = [e for e in read_events() if e.get("event") == "kill_sent"]
    assert killed, "test_sigkill did not run"
    pid = int(killed[-1]["target"])
    released = [e for e in read_events() if e.get("event") == "lease_released" and pid in e.get("worker_pids", [])]
    acquired = {e["lease"]: e for e in read_events() if e.get("event") == "lease_acquired"}
    assert released, f"no lease release recorded for the killed holder {pid}"
    before = acquired.get(released[-1]["lease"])
    assert before is not None, "the killed holder's lease acquisition was not recorded"
    need = int(before["free_mib"][0]) - 256
    inventory = load_inventory(parse_gpus_option(os.environ["GPU_CHECK_GPUS"]), os.environ)
    try:
        manager = LeaseManager(Path(os.environ["GPU_CHECK_LOCK_DIR"]), inventory, namespace="nvml")
        started = time.monotonic()
        lease = manager.try_acquire(1, need, holder="gpu-check after-sigkill")
        snapshot = [vars(g) for g in inventory.snapshot()]
        granted = lease is not None
        if lease is not None:
            lease.release(worker_pids=(), wait_timeout=5)
        took = time.monotonic() - started
    finally:
        inventory.close()
    try:
        alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        alive = False
    record("after-sigkill", {"killed_pid": pid, "need_mib": need, "granted": granted, "seconds": took,
                             "snapshot": snapshot, "killed_alive": alive, "release": released[-1]})
    assert not alive, f"the SIGKILLed holder {pid} is still alive"
    assert granted, (f"no lease of {need} MiB (what was free before the killed holder, minus 256 MiB) right after "
                     f"its teardown: {snapshot}")
