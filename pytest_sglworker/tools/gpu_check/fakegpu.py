"""The simulated GPUs of ``sglworker gpu-check --dry-run``: one state directory shared by every fake.

Stdlib only. Three fakes read and write it, each in its own processes:

- ``fake_nvml/pynvml.py``, put first on ``PYTHONPATH`` of the inner pytest sessions (and imported by the check
  driver), stands in for NVML: memory, processes, UUIDs, names, PCI bus ids;
- :class:`cuda_driver.FakeCuda`, used by the holder instead of ``libcuda.so``: it enumerates the devices as
  the CUDA driver does (``CUDA_DEVICE_ORDER``, then ``CUDA_VISIBLE_DEVICES``) and records what the holder
  "allocates";
- ``fake_nvml/nvidia_smi.py``, the ``nvidia-smi --query-gpu`` the inventory check compares with.

Layout of the state directory (``$GPU_CHECK_FAKE_GPU``)::

    devices.json        the cards, the driver's release delay, the context size, CUDA's default order
    allocs/<pid>.json   what one process holds: NVML index, MiB allocated, MiB of its context, exit time
    alloc.lock          flock taken around allocations, so that two holders never over-commit a card

Like the real driver: memory freed with ``cuMemFree`` / a destroyed context comes back at once; memory of a
process that exits (or is SIGKILLed) while holding it stays in use, and the process stays listed, for
``release_delay_s`` after its death, which the first reader to see the process dead stamps in its record.
A zombie is dead: the driver tears a context down when the process exits, not when it is reaped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_ENV = "GPU_CHECK_FAKE_GPU"
#: Comma-separated faults of the fakes, for the check's own negative tests:
#: ``cuda_ignores_device_order`` (the fake CUDA numbers devices in its default order whatever
#: ``CUDA_DEVICE_ORDER`` says), ``nvml_hides_pids`` (NVML lists no process, as in a container whose PID
#: namespace the driver cannot map), ``cuda_oom`` (every ``cuMemAlloc`` of the fake CUDA fails),
#: ``cuda_hangs`` (``cuInit`` never returns).
FAULT_ENV = "GPU_CHECK_FAKE_FAULT"
H200_MIB = 143771


@dataclass(frozen=True)
class FakeDevice:
    index: int  # NVML index: position in PCI bus order
    uuid: str
    name: str
    total_mib: int
    reserved_mib: int  # used by nobody in particular (what a real idle card shows as used)
    pci_bus_id: str  # NVML's form: 00000000:19:00.0


def faults() -> set[str]:
    return {f.strip() for f in os.environ.get(FAULT_ENV, "").split(",") if f.strip()}


def write_state(
    state_dir: Path,
    *,
    count: int = 2,
    total_mib: int = H200_MIB,
    name: str = "NVIDIA H200",
    reserved_mib: int = 530,
    release_delay_s: float = 0.3,
    context_mib: int = 512,
) -> Path:
    """Create a state directory of ``count`` cards. CUDA's default (fastest first) order is the reverse of
    the PCI order, so that a worker started without ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` sees the wrong card."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "allocs").mkdir(exist_ok=True)
    buses = [0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB]
    devices = [
        {
            "index": i,
            "uuid": f"GPU-{0xFA4E0000 + i:08x}-0000-4000-8000-{0xC0FFEE000000 + i:012x}",
            "name": name,
            "total_mib": total_mib,
            "reserved_mib": reserved_mib,
            "pci_bus_id": f"00000000:{buses[i % len(buses)]:02X}:00.0",
        }
        for i in range(count)
    ]
    data = {
        "devices": devices,
        "release_delay_s": release_delay_s,
        "context_mib": context_mib,
        "cuda_default_order": list(reversed(range(count))),
        "driver_version": "580.00.00-fake",
        "cuda_driver_version": 13000,
    }
    (state_dir / "devices.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    return state_dir


def _proc_start(pid: int) -> str | None:
    """The start time (clock ticks since boot) of a live, non-zombie process; None if gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    if not fields or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19] if len(fields) > 19 else None


def own_start() -> str:
    return _proc_start(os.getpid()) or ""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


class FakeOutOfMemory(Exception):
    pass


class FakeGpu:
    """One reading of the state directory; every query re-reads the allocation records."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        raw = state_dir if state_dir is not None else os.environ.get(STATE_ENV, "")
        if not raw:
            raise RuntimeError(f"{STATE_ENV} is not set: the fake GPU has no state directory")
        self.dir = Path(raw)
        try:
            data = json.loads((self.dir / "devices.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"fake GPU state {self.dir} is unreadable: {exc}") from None
        self.devices = [FakeDevice(**d) for d in data["devices"]]
        self.release_delay_s = float(data["release_delay_s"])
        self.context_mib = int(data["context_mib"])
        self.cuda_default_order: list[int] = [int(i) for i in data["cuda_default_order"]]
        self.driver_version = str(data["driver_version"])
        self.cuda_driver_version = int(data["cuda_driver_version"])
        self.allocs = self.dir / "allocs"

    # -- records

    def _records(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        try:
            paths = sorted(self.allocs.glob("*.json"))
        except OSError:
            return
        for path in paths:
            try:
                yield path, json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # removed meanwhile

    def present(self) -> list[dict[str, Any]]:
        """Records of processes the driver still accounts for (alive with a context, or dead for less than
        the release delay), each with ``used_mib``."""
        now = time.time()
        result = []
        for path, rec in self._records():
            alive = _proc_start(int(rec["pid"])) == rec.get("start")
            if not rec.get("context"):  # context destroyed, memory freed: the driver no longer lists it
                if not alive:
                    with contextlib.suppress(OSError):
                        path.unlink()
                continue
            exited_at = rec.get("exited_at")
            if not alive and exited_at is None:
                rec["exited_at"] = exited_at = now  # the first reader to see it dead stamps its death
                with contextlib.suppress(OSError):
                    _write_json(path, rec)
            if exited_at is not None and now >= float(exited_at) + self.release_delay_s:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            rec["used_mib"] = int(rec.get("mib", 0)) + int(rec.get("context_mib", 0))
            result.append(rec)
        return result

    def used_mib(self, index: int, present: Sequence[dict[str, Any]] | None = None) -> int:
        records = self.present() if present is None else present
        device = self.devices[index]
        return device.reserved_mib + sum(int(r["used_mib"]) for r in records if int(r["index"]) == index)

    def free_mib(self, index: int, present: Sequence[dict[str, Any]] | None = None) -> int:
        return max(self.devices[index].total_mib - self.used_mib(index, present), 0)

    def processes(self, index: int) -> list[tuple[int, int]]:
        """``(pid, used MiB)`` of the processes listed on a card."""
        if "nvml_hides_pids" in faults():
            return []
        return [(int(r["pid"]), r["used_mib"]) for r in self.present() if int(r["index"]) == index]

    # -- the holder's side (FakeCuda)

    def _own_path(self) -> Path:
        return self.allocs / f"{os.getpid()}.json"

    def _own(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self._own_path().read_text(encoding="utf-8"))
            return data
        except (OSError, ValueError):
            return None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.dir / "alloc.lock", "a+b") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def reserve(self, index: int, *, mib: int = 0, context: bool = False) -> None:
        """Add ``mib`` (and a context) to this process's record on ``index``; FakeOutOfMemory if it does not fit."""
        with self._locked():
            rec = self._own() or {"pid": os.getpid(), "start": own_start(), "index": index, "mib": 0,
                                  "context_mib": 0, "context": False, "exited_at": None}
            need = mib + (self.context_mib if context and not rec["context"] else 0)
            if need > self.free_mib(index):
                raise FakeOutOfMemory(f"{need} MiB requested, {self.free_mib(index)} MiB free")
            rec["mib"] = int(rec["mib"]) + mib
            if context:
                rec["context"] = True
                rec["context_mib"] = self.context_mib
            _write_json(self._own_path(), rec)

    def release(self, *, mib: int = 0, context: bool = False) -> None:
        """``cuMemFree`` of ``mib`` / ``cuCtxDestroy``: the memory is back at once."""
        with self._locked():
            rec = self._own()
            if rec is None:
                return
            rec["mib"] = max(int(rec["mib"]) - mib, 0)
            if context:
                rec["context"] = False
                rec["context_mib"] = 0
            _write_json(self._own_path(), rec)

    def mark_exiting(self) -> None:
        """The process exits now, holding what it holds: the driver frees it after the release delay."""
        rec = self._own()
        if rec is not None and rec.get("context"):
            rec["exited_at"] = time.time()
            _write_json(self._own_path(), rec)
