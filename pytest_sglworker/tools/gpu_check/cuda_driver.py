"""The CUDA driver API through ctypes (``libcuda.so.1``), and the fake of the dry run. Stdlib only.

Only what the holder and the probe need: initialise, enumerate devices (name, PCI bus id, UUID, total
memory), create a context, allocate / touch / free device memory, read free memory. Every call's result
is checked; a failure raises :class:`CudaError` naming the call and the driver's error name, e.g.
``cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2)``.

:class:`FakeCuda` (dry run, ``$GPU_CHECK_FAKE_GPU`` set) numbers devices as the driver does: in PCI bus
order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, else in its "fastest first" default order, then narrowed by
``CUDA_VISIBLE_DEVICES`` (indices into that order, or UUIDs; the list ends at the first entry that names
no device). Its allocations are recorded in the fake GPU state, so the fake NVML sees them.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

MIB = 1024 * 1024
CUDA_LIB_ENV = "GPU_CHECK_CUDA_LIB"


class CudaError(Exception):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name}" + (f" ({code})" if code >= 0 else ""))
        self.call = call
        self.code = code
        self.name = name


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    pci_bus_id: str
    uuid: str
    total_mib: int


def normalize_bus_id(text: str) -> tuple[int, int, int, int] | None:
    """``(domain, bus, device, function)`` of ``0000:1B:00.0`` (CUDA) or ``00000000:1b:00.0`` (NVML)."""
    m = re.fullmatch(r"\s*(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)\s*", text or "")
    if not m:
        return None
    return (int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4), 16))


def format_uuid(raw: bytes) -> str:
    """NVML's ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` form of a 16-byte CUDA UUID."""
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaApi:
    """What the holder uses; :class:`RealCuda` and :class:`FakeCuda` implement it."""

    kind = "abstract"
    library = ""
    context_method = ""

    def init(self) -> None:
        raise NotImplementedError

    def driver_version(self) -> int:
        raise NotImplementedError

    def device_count(self) -> int:
        raise NotImplementedError

    def device_info(self, ordinal: int) -> DeviceInfo:
        raise NotImplementedError

    def create_context(self, ordinal: int) -> None:
        raise NotImplementedError

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes, as the current context sees them."""
        raise NotImplementedError

    def alloc(self, nbytes: int) -> int:
        raise NotImplementedError

    def touch(self, ptr: int, nbytes: int) -> None:
        raise NotImplementedError

    def free(self, ptr: int, nbytes: int) -> None:
        raise NotImplementedError

    def destroy_context(self) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ the real driver


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


class RealCuda(CudaApi):
    kind = "libcuda"

    def __init__(self, library: str | None = None) -> None:
        names = [library] if library else ([os.environ[CUDA_LIB_ENV]] if os.environ.get(CUDA_LIB_ENV) else
                                           ["libcuda.so.1", "libcuda.so"])
        errors = []
        self._lib: Any = None
        for name in names:
            try:
                self._lib = ctypes.CDLL(name)
                self.library = name
                break
            except OSError as exc:
                errors.append(f"{name}: {exc}")
        if self._lib is None:
            raise CudaError("dlopen", -1, "cannot load the CUDA driver library (" + "; ".join(errors) + ")")
        self._ctx = ctypes.c_void_p()
        self._device = ctypes.c_int(-1)

    def _fn(self, *names: str) -> tuple[str, Any]:
        for name in names:
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return name, fn
        raise CudaError(names[0], -1, "symbol not found in " + self.library)

    def _error_name(self, code: int) -> str:
        try:
            _, fn = self._fn("cuGetErrorName")
            text = ctypes.c_char_p()
            if fn(ctypes.c_int(code), ctypes.byref(text)) == 0 and text.value:
                return text.value.decode("ascii", "replace")
        except CudaError:
            pass
        return "CUDA_ERROR_UNKNOWN_CODE"

    def _call(self, names: tuple[str, ...], *args: Any) -> None:
        name, fn = self._fn(*names)
        code = int(fn(*args))
        if code != 0:
            raise CudaError(name, code, self._error_name(code))

    def init(self) -> None:
        self._call(("cuInit",), ctypes.c_uint(0))

    def driver_version(self) -> int:
        version = ctypes.c_int()
        self._call(("cuDriverGetVersion",), ctypes.byref(version))
        return version.value

    def device_count(self) -> int:
        count = ctypes.c_int()
        self._call(("cuDeviceGetCount",), ctypes.byref(count))
        return count.value

    def _device_handle(self, ordinal: int) -> ctypes.c_int:
        dev = ctypes.c_int()
        self._call(("cuDeviceGet",), ctypes.byref(dev), ctypes.c_int(ordinal))
        return dev

    def device_info(self, ordinal: int) -> DeviceInfo:
        dev = self._device_handle(ordinal)
        name = ctypes.create_string_buffer(256)
        self._call(("cuDeviceGetName",), name, ctypes.c_int(256), dev)
        bus = ctypes.create_string_buffer(64)
        self._call(("cuDeviceGetPCIBusId",), bus, ctypes.c_int(64), dev)
        uuid = _CUuuid()
        self._call(("cuDeviceGetUuid_v2", "cuDeviceGetUuid"), ctypes.byref(uuid), dev)
        total = ctypes.c_size_t()
        self._call(("cuDeviceTotalMem_v2", "cuDeviceTotalMem"), ctypes.byref(total), dev)
        return DeviceInfo(ordinal, name.value.decode("utf-8", "replace"), bus.value.decode("ascii", "replace"),
                          format_uuid(bytes(uuid.bytes).ljust(16, b"\0")), total.value // MIB)

    def create_context(self, ordinal: int) -> None:
        """``cuCtxCreate_v2``; where the driver lacks it or refuses it, the primary context (what the CUDA
        runtime, and so torch and sglang, use) made current."""
        dev = self._device_handle(ordinal)
        try:
            self._call(("cuCtxCreate_v2",), ctypes.byref(self._ctx), ctypes.c_uint(0), dev)
            self.context_method = "cuCtxCreate_v2"
        except CudaError as first:
            try:
                self._call(("cuDevicePrimaryCtxRetain",), ctypes.byref(self._ctx), dev)
                self._call(("cuCtxSetCurrent",), self._ctx)
            except CudaError as second:
                raise CudaError(second.call, second.code, f"{second.name} (after {first})") from None
            self.context_method = f"cuDevicePrimaryCtxRetain (cuCtxCreate_v2: {first.name})"
            self._device = dev

    def mem_get_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._call(("cuMemGetInfo_v2", "cuMemGetInfo"), ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._call(("cuMemAlloc_v2",), ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def touch(self, ptr: int, nbytes: int) -> None:
        self._call(("cuMemsetD8_v2",), ctypes.c_uint64(ptr), ctypes.c_ubyte(0), ctypes.c_size_t(nbytes))
        self._call(("cuCtxSynchronize",))

    def free(self, ptr: int, nbytes: int) -> None:
        self._call(("cuMemFree_v2",), ctypes.c_uint64(ptr))

    def destroy_context(self) -> None:
        if not self._ctx.value:
            return
        if self._device.value >= 0:
            self._call(("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"), self._device)
        else:
            self._call(("cuCtxDestroy_v2",), self._ctx)
        self._ctx = ctypes.c_void_p()


# ------------------------------------------------------------------------------------------ the dry run's fake


def _load_fakegpu() -> ModuleType:
    name = "gpu_check_fakegpu"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent / "fakegpu.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class FakeCuda(CudaApi):
    kind = "fake"
    library = "fake (dry run)"

    def __init__(self) -> None:
        self._fake = _load_fakegpu()
        self._gpu: Any = None
        self._order: list[int] = []
        self._current: int | None = None

    def init(self) -> None:
        if "cuda_hangs" in self._fake.faults():
            time.sleep(3600)  # a wedged driver: only the plugin's startup deadline ends this
        try:
            self._gpu = self._fake.FakeGpu()
        except RuntimeError as exc:
            raise CudaError("cuInit", 100, f"CUDA_ERROR_NO_DEVICE: {exc}") from None
        devices = self._gpu.devices
        pci_order = os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
        if "cuda_ignores_device_order" in self._fake.faults():
            pci_order = False
        base = list(range(len(devices))) if pci_order else list(self._gpu.cuda_default_order)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            self._order = base
            return
        chosen: list[int] = []
        for token in (t.strip() for t in visible.split(",")):
            index: int | None = None
            if token.isdigit():
                index = base[int(token)] if int(token) < len(base) else None
            elif token.upper().startswith("GPU-"):
                matches = [d.index for d in devices if d.uuid.lower().startswith(token.lower())]
                index = matches[0] if len(matches) == 1 else None
            if index is None or index in chosen:
                break
            chosen.append(index)
        self._order = chosen

    def _check(self) -> Any:
        if self._gpu is None:
            raise CudaError("cuDeviceGet", 3, "CUDA_ERROR_NOT_INITIALIZED")
        return self._gpu

    def driver_version(self) -> int:
        return int(self._check().cuda_driver_version)

    def device_count(self) -> int:
        self._check()
        return len(self._order)

    def _nvml_index(self, ordinal: int) -> int:
        if not 0 <= ordinal < len(self._order):
            raise CudaError("cuDeviceGet", 101, "CUDA_ERROR_INVALID_DEVICE")
        return self._order[ordinal]

    def device_info(self, ordinal: int) -> DeviceInfo:
        device = self._check().devices[self._nvml_index(ordinal)]
        domain, bus, rest = device.pci_bus_id.split(":")
        return DeviceInfo(ordinal, device.name, f"{int(domain, 16):04x}:{bus}:{rest}", device.uuid,
                          device.total_mib)

    def create_context(self, ordinal: int) -> None:
        index = self._nvml_index(ordinal)
        try:
            self._check().reserve(index, context=True)
        except self._fake.FakeOutOfMemory:
            raise CudaError("cuCtxCreate_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY") from None
        self._current = index
        self.context_method = "cuCtxCreate_v2 (fake)"

    def _index(self, call: str) -> int:
        if self._current is None:
            raise CudaError(call, 201, "CUDA_ERROR_INVALID_CONTEXT")
        return self._current

    def mem_get_info(self) -> tuple[int, int]:
        index = self._index("cuMemGetInfo_v2")
        gpu = self._check()
        return gpu.free_mib(index) * MIB, gpu.devices[index].total_mib * MIB

    def alloc(self, nbytes: int) -> int:
        index = self._index("cuMemAlloc_v2")
        if "cuda_oom" in self._fake.faults():
            raise CudaError("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        try:
            self._check().reserve(index, mib=-(-nbytes // MIB))
        except self._fake.FakeOutOfMemory:
            raise CudaError("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY") from None
        return 0x7F0000000000

    def touch(self, ptr: int, nbytes: int) -> None:
        self._index("cuMemsetD8_v2")

    def free(self, ptr: int, nbytes: int) -> None:
        self._index("cuMemFree_v2")
        self._check().release(mib=-(-nbytes // MIB))

    def destroy_context(self) -> None:
        if self._current is not None:
            self._check().release(context=True)
            self._current = None

    def mark_exiting(self) -> None:
        if self._gpu is not None:
            self._gpu.mark_exiting()


def load_cuda() -> CudaApi:
    """The fake when ``$GPU_CHECK_FAKE_GPU`` is set (dry run), else the real driver."""
    if os.environ.get("GPU_CHECK_FAKE_GPU"):
        return FakeCuda()
    return RealCuda()
