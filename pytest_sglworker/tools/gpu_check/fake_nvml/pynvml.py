"""A fake ``pynvml`` for ``sglworker gpu-check --dry-run``, backed by the shared fake-GPU state (``fakegpu.py``).

Put first on ``PYTHONPATH``; it answers the NVML calls pytest-sglworker and the check make, from the state
directory named by ``$GPU_CHECK_FAKE_GPU``, so that the memory the holders "allocate" through the fake CUDA
driver shows up here, in every process, as real NVML would show it. Modelled on the fake of
``tests/resources/test_gpus.py`` (``make_nvml``), with the same shapes as nvidia-ml-py (``str`` results, objects with
``total``/``free``/``used``, ``pid``/``usedGpuMemory``, ``busId``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

__version__ = "0.0-gpu-check-fake"
IS_FAKE = True
MIB = 1024 * 1024
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_UNKNOWN = 999


class NVMLError(Exception):
    def __init__(self, value: int, text: str | None = None) -> None:
        super().__init__(value)
        self.value = value
        self.text = text

    def __str__(self) -> str:
        names = {1: "Uninitialized", 2: "Invalid Argument", 3: "Not Supported"}
        return self.text or names.get(self.value, "Unknown Error")


def _load_fakegpu() -> ModuleType:
    name = "gpu_check_fakegpu"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent.parent / "fakegpu.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NVMLError(NVML_ERROR_UNKNOWN, f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_gpu: Any = None
_refs = 0


def nvmlInit() -> None:
    global _gpu, _refs
    try:
        _gpu = _load_fakegpu().FakeGpu()
    except RuntimeError as exc:
        raise NVMLError(NVML_ERROR_UNKNOWN, f"fake NVML: {exc}") from None
    _refs += 1


def nvmlShutdown() -> None:
    global _refs
    if _refs <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _refs -= 1


def _state() -> Any:
    if _refs <= 0 or _gpu is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return _gpu


def nvmlSystemGetDriverVersion() -> str:
    return str(_state().driver_version)


def nvmlSystemGetCudaDriverVersion() -> int:
    return int(_state().cuda_driver_version)


def nvmlDeviceGetCount() -> int:
    return len(_state().devices)


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= int(index) < len(_state().devices):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(index)


def nvmlDeviceGetIndex(handle: int) -> int:
    return int(handle)


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_state().devices[handle].uuid)


def nvmlDeviceGetName(handle: int) -> str:
    return str(_state().devices[handle].name)


def nvmlDeviceGetPciInfo(handle: int) -> SimpleNamespace:
    bus_id = str(_state().devices[handle].pci_bus_id)
    domain, bus, rest = bus_id.split(":")
    device = rest.split(".")[0]
    return SimpleNamespace(busId=bus_id, busIdLegacy=bus_id[4:], domain=int(domain, 16), bus=int(bus, 16),
                           device=int(device, 16), pciDeviceId=0x233010DE)


def nvmlDeviceGetMemoryInfo(handle: int, version: Any = None) -> SimpleNamespace:
    gpu = _state()
    present = gpu.present()
    total = gpu.devices[handle].total_mib
    free = gpu.free_mib(handle, present)
    return SimpleNamespace(total=total * MIB, free=free * MIB, used=(total - free) * MIB)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(pid=pid, usedGpuMemory=mib * MIB) for pid, mib in _state().processes(handle)]


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[SimpleNamespace]:
    _state()
    return []
