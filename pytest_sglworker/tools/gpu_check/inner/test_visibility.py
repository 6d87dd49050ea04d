"""A worker sees exactly the GPU it leased: checked from inside the holder (CUDA) against NVML."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from inner_helpers import holder_info, nvml_readings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuda_driver import normalize_bus_id

#: Memory another GPU may lose meanwhile without counting as "the worker used it" (MiB).
TOLERANCE_MIB = 64


def test_visibility(sgl_spawn_worker: Any, record: Any, gpu_index: int) -> None:
    before = nvml_readings()
    worker = sgl_spawn_worker("hold-1g")
    info = holder_info(worker)
    during = nvml_readings()
    leased = before[gpu_index]
    device = info.get("device", {})
    drops = {i: before[i]["free_mib"] - during[i]["free_mib"] for i in before}
    listed = {i: [pid for pid, _ in (during[i]["processes"] or [])] for i in during}
    used_by_holder = next((mib for pid, mib in (during[gpu_index]["processes"] or []) if pid == worker.pid), None)
    data: dict[str, Any] = {
        "gpu": gpu_index, "worker_pid": worker.pid, "holder": info, "nvml_before": before, "nvml_during": during,
        "free_drop_mib": drops, "context_overhead_mib": drops[gpu_index] - int(info.get("allocated_mib", 0)),
        "nvml_pids": listed, "nvml_processes_supported": during[gpu_index]["processes"] is not None,
        "holder_listed_on": [i for i, pids in listed.items() if worker.pid in pids],
        "nvml_used_by_holder_mib": used_by_holder,
        "engine_view_free_mib": info.get("free_after_context_mib"), "nvml_free_before_mib": leased["free_mib"],
    }
    problems: list[str] = []
    if info.get("cuda_visible_devices") != str(gpu_index):
        problems.append(f"worker got CUDA_VISIBLE_DEVICES={info.get('cuda_visible_devices')!r}, leased NVML GPU "
                        f"{gpu_index}")
    if info.get("cuda_device_order") != "PCI_BUS_ID":
        problems.append(f"worker got CUDA_DEVICE_ORDER={info.get('cuda_device_order')!r}, not PCI_BUS_ID")
    if info.get("device_count") != 1:
        problems.append(f"CUDA shows the worker {info.get('device_count')} devices, not exactly 1")
    if normalize_bus_id(device.get("pci_bus_id", "")) != normalize_bus_id(leased["pci_bus_id"]):
        problems.append(f"the worker's CUDA device 0 is at PCI {device.get('pci_bus_id')} ({device.get('uuid')}), "
                        f"the leased NVML GPU {gpu_index} at {leased['pci_bus_id']} ({leased['uuid']})")
    elif str(device.get("uuid", "")).lower() != leased["uuid"].lower():
        problems.append(f"the worker's CUDA device 0 is {device.get('uuid')}, leased NVML GPU is {leased['uuid']}")
    if drops[gpu_index] < int(info.get("allocated_mib", 0)) - TOLERANCE_MIB:
        problems.append(f"NVML GPU {gpu_index} lost only {drops[gpu_index]} MiB while the worker holds "
                        f"{info.get('allocated_mib')} MiB")
    for i, drop in drops.items():
        if i != gpu_index and drop > TOLERANCE_MIB:
            problems.append(f"NVML GPU {i}, not leased, lost {drop} MiB while the worker ran")
    data["problems"] = problems
    record(f"visibility-{gpu_index}", data)
    assert not problems, "; ".join(problems)
