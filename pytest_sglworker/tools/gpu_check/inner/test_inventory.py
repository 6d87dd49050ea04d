"""The NVML inventory as pytest-sglworker reads it, against nvidia-smi and against CUDA's own enumeration."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from inner_helpers import nvml_readings

from pytest_sglworker.resources.gpus import load_inventory, parse_gpus_option

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuda_driver import normalize_bus_id


def _smi() -> tuple[list[dict[str, Any]] | None, str]:
    argv = json.loads(os.environ.get("GPU_CHECK_SMI") or "null")
    if not argv:
        return None, "nvidia-smi not found"
    query = "index,uuid,name,memory.total,memory.free,pci.bus_id"
    try:
        done = subprocess.run([*argv, f"--query-gpu={query}", "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi failed: {exc}"
    if done.returncode != 0:
        return None, f"nvidia-smi exited {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}"
    rows = []
    skipped = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append({"index": int(parts[0]), "uuid": parts[1], "name": parts[2],
                         "total_mib": int(float(parts[3])), "free_mib": int(float(parts[4])), "pci_bus_id": parts[5]})
        except (ValueError, IndexError):  # "[N/A]", an unexpected layout
            skipped.append(line)
    return rows, f"unparsed nvidia-smi line(s): {skipped}" if skipped else ""


def test_inventory(record: Any) -> None:
    inventory = load_inventory(parse_gpus_option(""), os.environ)
    try:
        gpus = inventory.snapshot()
        describe = inventory.describe()
    finally:
        inventory.close()
    nvml = nvml_readings()
    smi, smi_note = _smi()
    probe_path = os.environ.get("GPU_CHECK_PROBE")
    probe = json.loads(Path(probe_path).read_text()) if probe_path and os.path.exists(probe_path) else None
    data: dict[str, Any] = {
        "describe": describe,
        "plugin_inventory": [dataclasses.asdict(g) for g in gpus],
        "nvml": {str(k): v for k, v in nvml.items() if isinstance(k, int)},
        "nvidia_smi": smi, "nvidia_smi_note": smi_note, "cuda_probe": probe,
    }
    problems: list[str] = []
    if not gpus:
        problems.append(f"the plugin's inventory is empty ({describe})")
    for g in gpus:
        raw = nvml.get(g.index)
        if raw is None:
            problems.append(f"GPU {g.index}: not in pynvml's list")
            continue
        if (g.uuid, g.name, g.total_mib) != (raw["uuid"], raw["name"], raw["total_mib"]):
            problems.append(f"GPU {g.index}: plugin reads {g.uuid} {g.name} {g.total_mib} MiB, pynvml "
                            f"{raw['uuid']} {raw['name']} {raw['total_mib']} MiB")
        if not (0 < g.free_mib <= g.total_mib) or not g.uuid.startswith("GPU-") or not g.name:
            problems.append(f"GPU {g.index}: implausible reading {g}")
    indices = sorted(k for k in nvml if isinstance(k, int))
    buses = [normalize_bus_id(nvml[i]["pci_bus_id"]) for i in indices]
    if any(b is None for b in buses):
        problems.append(f"unparsable NVML PCI bus id(s): {[nvml[i]['pci_bus_id'] for i in indices]}")
    elif buses != sorted(buses):  # type: ignore[type-var]
        problems.append(f"NVML index order is not PCI bus order: {[nvml[i]['pci_bus_id'] for i in indices]}")
    if smi is not None:
        for row in smi:
            raw = nvml.get(row["index"])
            if raw is None:
                problems.append(f"nvidia-smi lists GPU {row['index']}, NVML does not")
                continue
            if (row["uuid"], row["name"]) != (raw["uuid"], raw["name"]) or abs(row["total_mib"] - raw["total_mib"]) > 1:
                problems.append(f"GPU {row['index']}: nvidia-smi {row['uuid']} {row['name']} {row['total_mib']} MiB "
                                f"!= NVML {raw['uuid']} {raw['name']} {raw['total_mib']} MiB")
            if normalize_bus_id(row["pci_bus_id"]) != normalize_bus_id(raw["pci_bus_id"]):
                problems.append(f"GPU {row['index']}: nvidia-smi bus {row['pci_bus_id']} != NVML {raw['pci_bus_id']}")
        if len(smi) != len(indices):
            problems.append(f"nvidia-smi lists {len(smi)} GPU(s), NVML {len(indices)}")
    if probe is None:
        problems.append("no CUDA probe result")
    elif not probe.get("ok"):
        problems.append(f"CUDA probe (CUDA_DEVICE_ORDER=PCI_BUS_ID): {probe.get('error')}")
    else:
        cuda_devices = probe["devices"]
        if len(cuda_devices) != len(indices):
            problems.append(f"CUDA shows {len(cuda_devices)} device(s), NVML {len(indices)}")
        for dev in cuda_devices:
            raw = nvml.get(dev["ordinal"])
            if raw is None:
                continue
            if normalize_bus_id(dev["pci_bus_id"]) != normalize_bus_id(raw["pci_bus_id"]):
                problems.append(f"CUDA device {dev['ordinal']} (PCI_BUS_ID order) is at {dev['pci_bus_id']}, "
                                f"NVML index {dev['ordinal']} at {raw['pci_bus_id']}")
            if dev["uuid"].lower() != raw["uuid"].lower():
                problems.append(f"CUDA device {dev['ordinal']} is {dev['uuid']}, NVML index {dev['ordinal']} "
                                f"is {raw['uuid']}")
    data["problems"] = problems
    record("inventory", data)
    assert not problems, "; ".join(problems)
