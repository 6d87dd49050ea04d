"""GPU inventories: which GPUs leases may use, and how much memory each has free now.

:class:`NvmlInventory` reads real GPUs through NVML (``pynvml``, imported lazily), limited by the parent's
``CUDA_VISIBLE_DEVICES`` and a ``--sgl-gpus`` selection; :class:`DeclaredInventory` is a declared
(``sim:N``) set whose free memory is what the live leases of its lock directory declared (read from their
holder records); :func:`load_inventory` picks one for a parsed selection. The pytest process only ever
talks to NVML: nothing here initialises CUDA. Index conventions: see :mod:`pytest_sglworker.resources.gpus`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InventoryUnavailable
from .holders import gpu_lock_path, holder_record_path, lock_is_held, read_holder_record
from .selection import GpuSelection, gib_text, resolve_visible_devices, sim_namespace

__all__ = [
    "MIB",
    "DeclaredInventory",
    "GpuInfo",
    "Inventory",
    "NvmlInventory",
    "can_ever_fit",
    "join_indices",
    "load_inventory",
]

MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuInfo:
    """One reading of one GPU. Memory in MiB; ``pids`` are the compute and graphics processes on it."""

    index: int
    uuid: str
    name: str
    total_mib: int
    free_mib: int
    pids: tuple[int, ...] = ()


def _text(value: object) -> str:
    """pynvml returns ``bytes`` in old releases and ``str`` in new ones."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def can_ever_fit(gpus: Sequence[GpuInfo], tp: int, memory_mib: int, *, where: str = "") -> str | None:
    """Why ``tp`` GPUs with ``memory_mib`` free each can never be leased from ``gpus`` (or ``None``).

    Judged on the GPUs' total memory: what is free now does not matter here.
    """
    suffix = f" ({where})" if where else ""
    if tp < 1:
        return f"tp={tp}: a lease needs at least one GPU"
    if memory_mib < 0:
        return f"memory_mib={memory_mib}: needed memory cannot be negative"
    if tp > len(gpus):
        return f"tp={tp} needs {tp} GPUs but the inventory has {len(gpus)}{suffix}"
    big_enough = [g for g in gpus if g.total_mib >= memory_mib]
    if len(big_enough) < tp:
        largest = max(g.total_mib for g in gpus)
        return (
            f"{memory_mib} MiB per GPU on {tp} GPU(s) can never fit: {len(big_enough)} GPU(s) of the "
            f"inventory have that much memory in total (largest: {largest} MiB){suffix}"
        )
    return None


def join_indices(values: Collection[int]) -> str:
    """``0,2``: GPU indices (or pids) for messages."""
    return ",".join(str(v) for v in values)


class Inventory(ABC):
    """Where GPUs come from: NVML, or a declared (simulated) set."""

    source: str = ""
    namespace: str = ""
    _totals: tuple[GpuInfo, ...] | None = None

    @abstractmethod
    def snapshot(self) -> list[GpuInfo]:
        """A fresh reading of every GPU this inventory may use, in index order."""

    @abstractmethod
    def visible_devices_value(self, gpus: Sequence[GpuInfo]) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value that gives a worker exactly ``gpus``."""

    @abstractmethod
    def describe(self) -> str:
        """One line for messages, e.g. ``NVML GPUs 0,1 of 8 (CUDA_VISIBLE_DEVICES=0,1)``."""

    def bind_leases(self, lock_dir: Path, namespace: str) -> None:  # noqa: B027 - optional hook
        """Called by :class:`LeaseManager`; a declared inventory reads its leases' records from there."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free what the inventory holds (the NVML handle). Safe to call twice; ``snapshot`` reopens."""

    def static_gpus(self) -> tuple[GpuInfo, ...]:
        """The GPUs as first read (totals, names and UUIDs do not change); read once, then cached."""
        if self._totals is None:
            self._totals = tuple(self.snapshot())
        return self._totals

    def can_ever_fit(self, tp: int, memory_mib: int) -> str | None:
        """Reason why ``tp`` GPUs with ``memory_mib`` each can never be leased here, or ``None``."""
        return can_ever_fit(self.static_gpus(), tp, memory_mib, where=self.describe())


class NvmlInventory(Inventory):
    """Real GPUs read through NVML (``pynvml``), limited by ``CUDA_VISIBLE_DEVICES`` and a selection.

    ``nvml_module`` replaces ``pynvml`` (tests pass a fake). ``visible`` is the parent's
    ``CUDA_VISIBLE_DEVICES`` (``None`` = unset = all). ``selection`` (indices or UUIDs) narrows it further;
    its indices are NVML indices and each must be visible, else ``ValueError``. NVML is initialised here
    (``InventoryUnavailable`` if it cannot be) and stays initialised until :meth:`close`.
    """

    source = "nvml"
    namespace = "nvml"

    def __init__(
        self,
        nvml_module: Any = None,
        visible: str | None = None,
        selection: GpuSelection | None = None,
    ) -> None:
        if nvml_module is None:
            try:
                import pynvml  # lazy: keeps the plugin import cheap
            except ImportError as exc:
                raise InventoryUnavailable(
                    f"NVML is not available (cannot import pynvml: {exc}); install nvidia-ml-py, or declare "
                    "a simulated inventory with --sgl-gpus sim:N"
                ) from None
            nvml_module = pynvml
        self._nvml: Any = nvml_module
        self._initialised = False
        self._lock = threading.Lock()
        self._visible = visible
        self._selection = selection
        self._init()
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
            self._all_uuids: list[str] = []
            self._names: dict[int, str] = {}
            for index in range(count):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                self._all_uuids.append(_text(self._nvml.nvmlDeviceGetUUID(handle)))
                self._names[index] = _text(self._nvml.nvmlDeviceGetName(handle))
        except self._nvml.NVMLError as exc:
            self.close()
            raise InventoryUnavailable(f"NVML failed while listing GPUs ({_text(exc)})") from None
        try:
            self._visible_indices = resolve_visible_devices(visible, self._all_uuids)
            self._indices = self._apply_selection(selection)
        except ValueError:
            self.close()
            raise

    # -- NVML session

    def _init(self) -> None:
        with self._lock:
            if self._initialised:
                return
            try:
                self._nvml.nvmlInit()
            except self._nvml.NVMLError as exc:
                reason = _text(exc)
                raise InventoryUnavailable(
                    f"NVML is not available ({reason}): {_nvml_hint(reason)}; declare a simulated inventory "
                    "with --sgl-gpus sim:N"
                ) from None
            self._initialised = True

    def close(self) -> None:
        with self._lock:
            if not self._initialised:
                return
            self._initialised = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    # -- selection

    def _apply_selection(self, selection: GpuSelection | None) -> list[int]:
        visible = self._visible_indices
        if selection is None or selection.kind == "auto":
            return list(visible)
        if selection.kind == "sim":
            raise ValueError(
                "a simulated selection (sim:N) cannot limit an NVML inventory; use DeclaredInventory"
            )
        count = len(self._all_uuids)
        chosen: list[int] = []
        if selection.kind == "indices":
            for index in selection.indices:
                if index >= count:
                    raise ValueError(
                        f"GPU selection {str(selection)!r} names NVML index {index}, but NVML reports "
                        f"{count} GPU(s) (indices 0..{count - 1}); selection indices are NVML indices as "
                        "nvidia-smi shows them"
                    )
                chosen.append(index)
        else:
            for prefix in selection.uuids:
                matches = [i for i, u in enumerate(self._all_uuids) if u.lower().startswith(prefix.lower())]
                if len(matches) != 1:
                    what = "matches no GPU" if not matches else f"is ambiguous ({len(matches)} GPUs match)"
                    raise ValueError(
                        f"GPU selection {str(selection)!r}: {prefix} {what}; NVML reports "
                        + ", ".join(f"{i}={u}" for i, u in enumerate(self._all_uuids))
                    )
                chosen.append(matches[0])
        hidden = [i for i in chosen if i not in visible]
        if hidden:
            raise ValueError(
                f"GPU selection {str(selection)!r} names NVML GPU(s) {join_indices(hidden)} that "
                f"{_visible_text(self._visible)} hides; visible NVML indices: {join_indices(visible) or 'none'} "
                "(selection indices are NVML indices, as nvidia-smi shows them)"
            )
        return sorted(set(chosen))

    # -- Inventory

    @property
    def indices(self) -> tuple[int, ...]:
        """NVML indices this inventory may use."""
        return tuple(self._indices)

    def describe(self) -> str:
        text = f"NVML GPUs {join_indices(self._indices) or 'none'} of {len(self._all_uuids)}"
        extras = []
        if self._visible is not None:
            extras.append(f"CUDA_VISIBLE_DEVICES={self._visible!r}")
        if self._selection is not None and self._selection.kind != "auto":
            extras.append(f"selection {str(self._selection)!r}")
        return text + (f" ({', '.join(extras)})" if extras else "")

    def snapshot(self) -> list[GpuInfo]:
        self._init()
        nvml = self._nvml
        result: list[GpuInfo] = []
        for index in self._indices:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                total, free = int(memory.total), int(memory.free)
            except nvml.NVMLError as exc:
                raise InventoryUnavailable(f"NVML failed to read GPU {index} ({_text(exc)})") from None
            pids: set[int] = set()
            for getter in (
                nvml.nvmlDeviceGetComputeRunningProcesses,
                nvml.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                try:
                    processes = getter(handle)
                except nvml.NVMLError:
                    continue  # e.g. NotSupported for graphics processes on some boards
                pids.update(int(p.pid) for p in processes)
            result.append(
                GpuInfo(
                    index=index,
                    uuid=self._all_uuids[index],
                    name=self._names[index],
                    total_mib=total // MIB,
                    free_mib=free // MIB,
                    pids=tuple(sorted(pids)),
                )
            )
        return result

    def visible_devices_value(self, gpus: Sequence[GpuInfo]) -> str:
        # NVML indices, not UUIDs: with CUDA_DEVICE_ORDER=PCI_BUS_ID (set by Lease.env) CUDA numbers the
        # GPUs as NVML does, and sglang 0.5.23 parses CUDA_VISIBLE_DEVICES as integers in places
        # (srt/utils/cuda_vmm_utils.py: ``map(int, cuda_visible_devices.split(","))``), so UUIDs would
        # crash it. The UUIDs are in the lease record and in messages.
        return ",".join(str(g.index) for g in gpus)


def _nvml_hint(reason: str) -> str:
    lowered = reason.lower()
    if "library not found" in lowered:
        return "no NVIDIA driver (libnvidia-ml.so.1) on this machine"
    if "driver not loaded" in lowered:
        return "the NVIDIA kernel driver is not loaded"
    if "insufficient permissions" in lowered or "no permission" in lowered:
        return "this user may not open the NVIDIA devices"
    return "NVML could not be initialised"


def _visible_text(value: str | None) -> str:
    return "nothing" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"




class DeclaredInventory(Inventory):
    """``count`` simulated GPUs of ``total_mib`` each: ``sim-gpu-<i>``, UUID ``GPU-sim-000...<i>``.

    Free memory is the total minus what a live lease on the GPU declared (read from the holder records
    in the lock directory the :class:`LeaseManager` binds), so the allocator behaves as with NVML.
    """

    source = "declared"

    def __init__(
        self,
        count: int,
        total_mib: int,
        *,
        lock_dir: Path | None = None,
        namespace: str | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"a declared inventory needs at least one GPU, not {count}")
        if total_mib < 1:
            raise ValueError(f"a declared GPU needs a positive memory size, not {total_mib} MiB")
        self.count = count
        self.total_mib = total_mib
        self.namespace = namespace or sim_namespace(count, total_mib)
        self._lock_dir = lock_dir

    @classmethod
    def from_selection(cls, selection: GpuSelection) -> DeclaredInventory:
        if selection.kind != "sim":
            raise ValueError(f"{str(selection)!r} is not a simulated inventory (sim:N)")
        return cls(selection.sim_count, selection.sim_total_mib, namespace=selection.namespace)

    def bind_leases(self, lock_dir: Path, namespace: str) -> None:
        self._lock_dir = lock_dir
        self.namespace = namespace

    def describe(self) -> str:
        gib = gib_text(self.total_mib)
        return (
            f"{self.count} simulated GPU(s) of {gib} GiB (sim:{self.count}x{gib}, namespace {self.namespace})"
        )

    def snapshot(self) -> list[GpuInfo]:
        result = []
        for index in range(self.count):
            used = 0
            if self._lock_dir is not None:
                record = read_holder_record(holder_record_path(self._lock_dir, self.namespace, index))
                # Trust the lock, not the record: a record whose GPU nobody has locked (a live process that
                # left it behind, or a planted one) declares nothing.
                if record is not None and lock_is_held(gpu_lock_path(self._lock_dir, self.namespace, index)):
                    used = record.memory_mib
            result.append(
                GpuInfo(
                    index=index,
                    uuid=f"GPU-sim-{index:012d}",
                    name=f"sim-gpu-{index}",
                    total_mib=self.total_mib,
                    free_mib=max(self.total_mib - used, 0),
                    pids=(),
                )
            )
        return result

    def visible_devices_value(self, gpus: Sequence[GpuInfo]) -> str:
        return ",".join(str(g.index) for g in gpus)


def load_inventory(selection: GpuSelection, env: Mapping[str, str]) -> Inventory:
    """The inventory for a parsed ``--sgl-gpus`` value.

    ``sim:...`` gives a :class:`DeclaredInventory` (``CUDA_VISIBLE_DEVICES`` is ignored); anything else an
    :class:`NvmlInventory` limited by ``env['CUDA_VISIBLE_DEVICES']``. NVML missing or failing raises
    :class:`InventoryUnavailable` with a one-line reason; a selection naming hidden GPUs, ``ValueError``.
    """
    if selection.kind == "sim":
        return DeclaredInventory.from_selection(selection)
    return NvmlInventory(visible=env.get("CUDA_VISIBLE_DEVICES"), selection=selection)
