"""Helpers shared by the inner tests of sglworker gpu-check and their conftest (events, NVML readings)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any


def emit(event: str, **fields: Any) -> None:
    path = os.environ.get("GPU_CHECK_EVENTS")
    if not path:
        return
    record = {"t": time.time(), "event": event, "source": "pytest", "pid": os.getpid(),
              "xdist": os.environ.get("PYTEST_XDIST_WORKER", ""), **fields}
    data = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_events() -> list[dict[str, Any]]:
    path = os.environ.get("GPU_CHECK_EVENTS")
    if not path or not os.path.exists(path):
        return []
    events = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def nvml_readings() -> dict[int, dict[str, Any]]:
    """Every NVML device, straight from pynvml: free/total MiB, PCI bus id, UUID, name, processes."""
    import pynvml

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    pynvml.nvmlInit()
    try:
        result = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            procs: list[tuple[int, int | None]] | None
            try:
                procs = [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory) // (1 << 20))
                         for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            except pynvml.NVMLError:
                procs = None  # not supported here: the check says so
            result[index] = {
                "index": index,
                "name": text(pynvml.nvmlDeviceGetName(handle)),
                "uuid": text(pynvml.nvmlDeviceGetUUID(handle)),
                "pci_bus_id": text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                "total_mib": int(memory.total) // (1 << 20),
                "free_mib": int(memory.free) // (1 << 20),
                "processes": procs,
            }
        return result
    finally:
        pynvml.nvmlShutdown()


def holder_info(worker: Any) -> dict[str, Any]:
    resp = worker.client.get("/gpu_check")
    assert resp.status_code == 200, f"holder /gpu_check answered {resp.status_code}"
    data: dict[str, Any] = resp.json()
    return data


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
