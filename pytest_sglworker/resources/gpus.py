"""GPU inventory (NVML or a declared ``sim:N`` one) and file-locked GPU leases.

Plain Python, no pytest. ``pynvml``, ``filelock`` and ``psutil`` are imported lazily, inside functions,
so importing this module costs nothing in a run that uses no worker. The pytest process only ever
talks to NVML: nothing here initialises CUDA.

Index conventions
-----------------
* ``GpuInfo.index`` of an NVML inventory is the **NVML index** (the number ``nvidia-smi`` shows, in PCI
  bus order). Indices given with ``--sgl-gpus 0,2`` are NVML indices too.
* Index entries of the parent's ``CUDA_VISIBLE_DEVICES`` are read as NVML indices as well. CUDA numbers
  devices the same way when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is set or all GPUs are of one model.
  Parsing follows the CUDA driver's rule: the list ends at the first entry that names no device
  (``-1``, an out-of-range index, an unknown or ambiguous UUID, a ``MIG-`` id, a duplicate), so
  ``CUDA_VISIBLE_DEVICES=-1`` or ``""`` makes no GPU visible; unset makes all visible.
* Workers get ``CUDA_VISIBLE_DEVICES`` as NVML indices plus ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which
  makes CUDA number the GPUs as NVML does. Not UUIDs: sglang 0.5.23 parses the variable as integers in
  places (``srt/utils/cuda_vmm_utils.py``). A declared inventory hands out plain indices too.

Leases
------
One lock file per GPU, ``<lock_dir>/gpu-<namespace>-<index>.lock``, held with ``filelock.FileLock``
(``flock`` on Linux: the kernel drops it when the holder dies, so a dead holder never blocks anyone),
plus a holder record ``<lock_dir>/gpu-<namespace>-<index>.json`` written (atomically) after locking and
removed before unlocking. The lock is the truth; the record only feeds messages, the declared inventory's
free memory (only while its lock is held) and the dead-holder guard. A record whose process is gone (or whose
pid was reused by a younger process) is ignored; so is one that cannot be trusted (not a regular file, not
JSON, a field out of range: see :func:`inspect_holder_record`), which the :class:`LeaseManager` also
removes, with one warning, when its lock is free. A lock or record path that holds something else (a
directory, a symlink) is an :class:`~pytest_sglworker.resources.state.UnusableFile` error naming it.

Why one module of this size: the inventory, the holder records and the leases share the index conventions
above and one lock-file layout, and the lease's memory-release wait reads the inventory it leased from; the
sections below depend one way (holder records <- inventory <- leases), so a split along them is mechanical
when the module grows again. Ray's leases, the other lease surface, are in :mod:`ray_cluster`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from ..errors import InventoryUnavailable, LeaseImpossible, LeaseTimeout
from .processes import PID_MAX, hostname, plausible_pid, process_alive, session_worker_pids
from .waiters import flag_waiting, lease_waiting_prefix, live_waiters, others_waiting_for_ports, unflag_waiting

if TYPE_CHECKING:
    from filelock import BaseFileLock
    from typing_extensions import Self

__all__ = [
    "DEFAULT_SIM_GIB",
    "DeclaredInventory",
    "GpuInfo",
    "GpuSelection",
    "GpuShortfall",
    "HolderRecord",
    "HolderRecordWarning",
    "Inventory",
    "Lease",
    "LeaseManager",
    "NvmlInventory",
    "ReleaseReport",
    "can_ever_fit",
    "inspect_holder_record",
    "load_inventory",
    "lock_is_held",
    "parse_gpus_option",
    "read_holder_record",
    "resolve_visible_devices",
]

MIB = 1024 * 1024
#: Leases not yet released. The strong reference keeps a forgotten lease held until the process exits
#: (then the kernel drops the locks) instead of letting garbage collection unlock GPUs a worker may use.
_HELD_LEASES: set[Lease] = set()
DEFAULT_SIM_GIB = 80
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ACCEPTED_FORMS = (
    "accepted forms: '' or 'auto' (every GPU NVML reports), '0,2' (NVML indices, as nvidia-smi numbers "
    "them), 'GPU-<uuid>,...' (UUIDs or unique UUID prefixes), 'sim:N' or 'sim:NxGiB' (N simulated GPUs "
    f"of GiB each, default {DEFAULT_SIM_GIB}, e.g. sim:4x80)"
)


# --------------------------------------------------------------------------------------------------
# values


@dataclass(frozen=True)
class GpuInfo:
    """One reading of one GPU. Memory in MiB; ``pids`` are the compute and graphics processes on it."""

    index: int
    uuid: str
    name: str
    total_mib: int
    free_mib: int
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GpuSelection:
    """A parsed ``--sgl-gpus`` value (see :func:`parse_gpus_option`)."""

    kind: Literal["auto", "indices", "uuids", "sim"]
    indices: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()
    sim_count: int = 0
    sim_total_mib: int = 0
    raw: str = ""

    @property
    def is_simulated(self) -> bool:
        return self.kind == "sim"

    @property
    def namespace(self) -> str:
        """Lock-file namespace: ``nvml`` for real GPUs, ``sim-<N>x<GiB>`` for a declared inventory."""
        if self.kind != "sim":
            return "nvml"
        return _sim_namespace(self.sim_count, self.sim_total_mib)

    def __str__(self) -> str:
        if self.kind == "auto":
            return "auto"
        if self.kind == "indices":
            return ",".join(str(i) for i in self.indices)
        if self.kind == "uuids":
            return ",".join(self.uuids)
        return f"sim:{self.sim_count}x{_gib_text(self.sim_total_mib)}"


def _gib_text(total_mib: int) -> str:
    return f"{total_mib / 1024:g}"


def _sim_namespace(count: int, total_mib: int) -> str:
    return f"sim-{count}x{_gib_text(total_mib)}"


def parse_gpus_option(value: str) -> GpuSelection:
    """Parse ``--sgl-gpus``: ``''``/``auto``, ``0,2``, ``GPU-<uuid>,...``, ``sim:N``, ``sim:NxGiB``.

    Indices are NVML indices. Raises ``ValueError`` naming the bad value and the accepted forms.
    """
    raw = value
    text = value.strip()

    def bad(why: str) -> ValueError:
        return ValueError(f"invalid GPU selection {raw!r}: {why}; {_ACCEPTED_FORMS}")

    if text == "" or text.lower() == "auto":
        return GpuSelection(kind="auto", raw=raw)
    if text.lower().startswith("sim:"):
        spec = text[4:].strip().lower()
        count_text, sep, gib_text = spec.partition("x")
        try:
            count = int(count_text)
        except ValueError:
            raise bad(f"{count_text!r} is not a whole number of simulated GPUs") from None
        if count < 1:
            raise bad("a simulated inventory needs at least one GPU")
        gib = float(DEFAULT_SIM_GIB)
        if sep:
            try:
                gib = float(gib_text)
            except ValueError:
                raise bad(f"{gib_text!r} is not a GPU size in GiB") from None
            if not 0 < gib < float("inf"):
                raise bad(f"the GPU size must be a positive number of GiB, not {gib_text!r}")
        total_mib = round(gib * 1024)
        if total_mib < 1:
            raise bad(f"{gib_text!r} GiB is less than 1 MiB")
        return GpuSelection(kind="sim", sim_count=count, sim_total_mib=total_mib, raw=raw)
    tokens = [t.strip() for t in text.split(",")]
    if any(t == "" for t in tokens):
        raise bad("empty entry in the list")
    if all(t.isdigit() for t in tokens):
        indices = tuple(int(t) for t in tokens)
        if len(set(indices)) != len(indices):
            raise bad("an index is listed twice")
        return GpuSelection(kind="indices", indices=indices, raw=raw)
    if all(t.upper().startswith("GPU-") and len(t) > 4 for t in tokens):
        uuids = tuple("GPU-" + t[4:] for t in tokens)
        if len({u.lower() for u in uuids}) != len(uuids):
            raise bad("a UUID is listed twice")
        return GpuSelection(kind="uuids", uuids=uuids, raw=raw)
    wrong = [t for t in tokens if not (t.isdigit() or (t.upper().startswith("GPU-") and len(t) > 4))]
    if wrong:
        raise bad(f"{wrong[0]!r} is neither a GPU index nor a GPU UUID")
    raise bad("indices and UUIDs cannot be mixed")


def resolve_visible_devices(value: str | None, uuids: Sequence[str]) -> list[int]:
    """Which NVML indices a ``CUDA_VISIBLE_DEVICES`` value makes visible, given the UUID of each index.

    ``None`` (unset): all. Entries are NVML indices, ``GPU-`` UUIDs or unique UUID prefixes; like the
    CUDA driver, the list ends at the first entry that names no device (``-1``, out of range, unknown,
    ambiguous, ``MIG-...``, repeated). The result is sorted.
    """
    if value is None:
        return list(range(len(uuids)))
    chosen: list[int] = []
    for token in (t.strip() for t in value.split(",")):
        index: int | None = None
        if token.isdigit():
            number = int(token)
            index = number if number < len(uuids) else None
        elif token.upper().startswith("GPU-") and len(token) > 4:
            matches = [i for i, u in enumerate(uuids) if u.lower().startswith(token.lower())]
            index = matches[0] if len(matches) == 1 else None
        if index is None or index in chosen:
            break
        chosen.append(index)
    return sorted(chosen)


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


# --------------------------------------------------------------------------------------------------
# inventories


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
                f"GPU selection {str(selection)!r} names NVML GPU(s) {_join(hidden)} that "
                f"{_visible_text(self._visible)} hides; visible NVML indices: {_join(visible) or 'none'} "
                "(selection indices are NVML indices, as nvidia-smi shows them)"
            )
        return sorted(set(chosen))

    # -- Inventory

    @property
    def indices(self) -> tuple[int, ...]:
        """NVML indices this inventory may use."""
        return tuple(self._indices)

    def describe(self) -> str:
        text = f"NVML GPUs {_join(self._indices) or 'none'} of {len(self._all_uuids)}"
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


def _join(values: Collection[int]) -> str:
    return ",".join(str(v) for v in values)


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
        self.namespace = namespace or _sim_namespace(count, total_mib)
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
        gib = _gib_text(self.total_mib)
        return (
            f"{self.count} simulated GPU(s) of {gib} GiB (sim:{self.count}x{gib}, namespace {self.namespace})"
        )

    def snapshot(self) -> list[GpuInfo]:
        result = []
        for index in range(self.count):
            used = 0
            if self._lock_dir is not None:
                record = read_holder_record(_record_path(self._lock_dir, self.namespace, index))
                # Trust the lock, not the record: a record whose GPU nobody has locked (a live process that
                # left it behind, or a planted one) declares nothing.
                if record is not None and lock_is_held(_lock_path(self._lock_dir, self.namespace, index)):
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


# --------------------------------------------------------------------------------------------------
# holder records


@dataclass(frozen=True)
class HolderRecord:
    """Who holds one GPU lock: written next to the lock, for messages and declared free memory."""

    pid: int
    hostname: str
    holder: str
    since: float
    uuid: str
    memory_mib: int
    index: int
    namespace: str
    gpus: tuple[int, ...] = ()

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        stamp = time.strftime("%H:%M:%S", time.localtime(self.since))
        host = "" if self.hostname == hostname() else f" on {self.hostname}"
        return f"pid {self.pid}{host} for {self.holder!r} since {stamp} ({max(now - self.since, 0):.0f} s)"


def _record_path(lock_dir: Path, namespace: str, index: int) -> Path:
    return lock_dir / f"gpu-{namespace}-{index}.json"


def _lock_path(lock_dir: Path, namespace: str, index: int) -> Path:
    return lock_dir / f"gpu-{namespace}-{index}.lock"


#: A holder record is a few hundred bytes; anything much larger is not one of ours (and is never parsed).
MAX_RECORD_BYTES = 16 * 1024
_MAX_INDEX = 1 << 16
_MAX_MIB = 1 << 40
_RECORD_NAME_RE = re.compile(r"^gpu-(?P<namespace>[A-Za-z0-9][A-Za-z0-9._-]*)-(?P<index>[0-9]{1,6})\.json$")
_PRINTABLE_RE = re.compile(r"^[\x21-\x7e]+$")


class HolderRecordWarning(UserWarning):
    """A GPU holder record in the lock directory that cannot be trusted was ignored (and removed)."""


def _bounded_int(data: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key!r} is {_short(value)}, not a whole number in {low}..{high}")
    return value


def _bounded_str(data: Mapping[str, Any], key: str, limit: int, *, printable: bool = False) -> str:
    value = data[key]
    if not isinstance(value, str) or len(value) > limit or (printable and not _PRINTABLE_RE.match(value)):
        kind = "printable text without spaces" if printable else "text"
        raise ValueError(f"{key!r} is {_short(value)}, not {kind} of at most {limit} characters")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _parse_record(raw: bytes, path: Path) -> HolderRecord:
    """The record in ``raw``, validated field by field; ``ValueError`` says what cannot be trusted."""
    def no_constant(name: str) -> object:
        raise ValueError(f"{name} is not a number a holder record holds")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    try:
        data = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise ValueError("nested too deeply to be a holder record") from None
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    missing = [k for k in ("pid", "hostname", "holder", "since", "uuid", "memory_mib", "index", "namespace")
               if k not in data]
    if missing:
        raise ValueError(f"missing {', '.join(map(repr, missing))}")
    since = data["since"]
    if isinstance(since, bool) or not isinstance(since, (int, float)) or not 0 <= since <= time.time() + 86400:
        raise ValueError(f"'since' is {_short(since)}, not a time stamp")
    gpus = data.get("gpus", [])
    if not isinstance(gpus, list) or len(gpus) > 1024:
        raise ValueError(f"'gpus' is {_short(gpus)}, not a list of GPU indices")
    indices = tuple(_bounded_int({"gpus": g}, "gpus", 0, _MAX_INDEX) for g in gpus)
    namespace = _bounded_str(data, "namespace", 200, printable=True)
    if not _NAMESPACE_RE.match(namespace):
        raise ValueError(f"'namespace' is {_short(namespace)}, not a lease namespace")
    record = HolderRecord(
        pid=_bounded_int(data, "pid", 1, PID_MAX),
        hostname=_bounded_str(data, "hostname", 255, printable=True),
        holder=_bounded_str(data, "holder", 4096),
        since=float(since),
        uuid=_bounded_str(data, "uuid", 256),
        memory_mib=_bounded_int(data, "memory_mib", 0, _MAX_MIB),
        index=_bounded_int(data, "index", 0, _MAX_INDEX),
        namespace=namespace,
        gpus=indices,
    )
    named = _RECORD_NAME_RE.match(path.name)
    if named and (named["namespace"], int(named["index"])) != (record.namespace, record.index):
        raise ValueError(f"it names GPU {record.index} of {record.namespace!r}, not the GPU its file name says")
    return record


def inspect_holder_record(path: Path) -> tuple[HolderRecord | None, str | None]:
    """``(record, None)`` for a record that can be trusted, ``(None, None)`` when there is none, and
    ``(None, why)`` when what lies at ``path`` cannot be trusted: not a regular file (a directory, a symlink,
    a FIFO), larger than :data:`MAX_RECORD_BYTES`, not JSON, nested, or a field out of its range (a pid of
    ``1e999`` or ``-5``, a GPU index of ``1e999``). Never follows a symlink, never blocks on a FIFO, never
    raises for what the file holds."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        from .state import describe_file_problem

        return None, describe_file_problem(path, exc)
    try:
        import stat

        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return None, "is a directory"
        if not stat.S_ISREG(st.st_mode):
            return None, "is not a regular file"
        if st.st_size > MAX_RECORD_BYTES:
            return None, f"is {st.st_size} bytes, far larger than a holder record"
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_RECORD_BYTES:
            chunk = os.read(fd, MAX_RECORD_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_RECORD_BYTES:
            return None, "is far larger than a holder record"
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if not raw.strip():
        return None, "is empty"
    try:
        return _parse_record(raw, path), None
    except (ValueError, TypeError, KeyError) as exc:
        return None, str(exc)


def read_holder_record(path: Path, *, only_live: bool = True) -> HolderRecord | None:
    """The record at ``path``; ``None`` if missing, untrusted (see :func:`inspect_holder_record`), or
    (``only_live``) its process is gone."""
    record, _ = inspect_holder_record(path)
    if record is None:
        return None
    if only_live:
        try:
            alive = process_alive(record.pid, record.since, record.hostname)
        except (ValueError, OverflowError, OSError):
            return None
        if not alive:
            return None
    return record


def lock_is_held(path: Path) -> bool:
    """Whether some process holds the ``flock`` of the lock file ``path`` (our own process included: a lock
    is per open file, so our own leases count as held). A missing or unusable file is not held. The probe
    takes a shared lock for an instant; it never creates the file."""
    import fcntl

    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


_TEMP_RE = re.compile(r"^(?:\.gpu-.+\.json\.(?P<pid>[0-9]{1,7})-[0-9a-f]+|gpu-.+\.json\.(?P<old>[0-9]{1,7}))\.tmp$")


def _remove_dead_temporaries(lock_dir: Path) -> None:
    """Temporary record files whose writer died between creating and renaming them (SIGKILL)."""
    import psutil

    try:
        paths = [p for p in lock_dir.iterdir() if p.name.endswith(".tmp")]
    except OSError:
        return
    for path in paths:
        named = _TEMP_RE.match(path.name)
        if named is None:
            continue
        pid = plausible_pid(named["pid"] or named["old"] or "")
        if pid is not None and psutil.pid_exists(pid) and pid != os.getpid():
            continue
        if pid == os.getpid():
            continue  # ours: being written right now
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                path.unlink()


def _write_record(path: Path, record: HolderRecord) -> None:
    from .state import atomic_write

    payload = {
        "pid": record.pid,
        "hostname": record.hostname,
        "holder": record.holder,
        "since": record.since,
        "uuid": record.uuid,
        "memory_mib": record.memory_mib,
        "index": record.index,
        "namespace": record.namespace,
        "gpus": list(record.gpus),
    }
    # 0644 whatever the umask, never through a planted file or symlink, never seen half-written.
    atomic_write(path, json.dumps(payload, indent=1), mode=0o644)


# --------------------------------------------------------------------------------------------------
# release reports


@dataclass(frozen=True)
class GpuShortfall:
    """A leased GPU whose free memory had not come back at release time."""

    index: int
    free_before_mib: int
    free_after_mib: int

    @property
    def missing_mib(self) -> int:
        return max(self.free_before_mib - self.free_after_mib, 0)


@dataclass(frozen=True)
class ReleaseReport:
    """What :meth:`Lease.release` saw while waiting for the leased GPUs to come back."""

    gpus: tuple[int, ...]
    source: str
    memory_back: bool
    waited_s: float
    lingering_pids: tuple[int, ...] = ()
    shortfalls: tuple[GpuShortfall, ...] = ()
    error: str | None = None

    @property
    def message(self) -> str:
        where = f"GPU(s) {_join(self.gpus)}"
        if self.source == "declared":
            return f"released declared {where}"
        if self.memory_back:
            return f"released {where}; memory came back after {self.waited_s:.1f} s"
        parts = []
        if self.lingering_pids:
            parts.append(f"worker process(es) {_join(self.lingering_pids)} still listed on the GPU(s)")
        for s in self.shortfalls:
            parts.append(
                f"GPU {s.index}: {s.free_after_mib} MiB free, {s.free_before_mib} MiB before the lease "
                f"({s.missing_mib} MiB missing)"
            )
        if self.error:
            parts.append(f"NVML error: {self.error}")
        return (
            f"released {where} after waiting {self.waited_s:.1f} s although the memory did not come back: "
            + "; ".join(parts)
        )

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------------------------------
# leases


class Lease:
    """Exclusive use of some GPUs, held until :meth:`release` (also a context manager)."""

    def __init__(
        self,
        manager: LeaseManager,
        gpus: tuple[GpuInfo, ...],
        locks: list[BaseFileLock],
        *,
        holder: str,
        memory_mib: int,
    ) -> None:
        self._manager = manager
        self.gpus = gpus
        self._locks = locks
        self.holder = holder
        self.memory_mib = memory_mib
        self.namespace = manager.namespace
        self.acquired_at = time.time()
        self.cuda_visible_devices = manager.inventory.visible_devices_value(gpus)
        self._free_before = {g.index: g.free_mib for g in gpus}
        self._release_lock = threading.Lock()
        self._report: ReleaseReport | None = None
        self._unlocked = False
        _HELD_LEASES.add(self)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    @property
    def released(self) -> bool:
        return self._unlocked

    @property
    def report(self) -> ReleaseReport | None:
        """The report of the release, once released."""
        return self._report

    def env(self) -> dict[str, str]:
        """Environment entries that give a worker exactly these GPUs."""
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def release(self, *, worker_pids: Collection[int] = (), wait_timeout: float = 60.0) -> ReleaseReport:
        """Wait (bounded) for the GPUs to come back, then unlock them. Idempotent.

        With NVML: polls until none of ``worker_pids`` is listed on the leased GPUs and each GPU's free
        memory is back to what it was at acquisition (minus the manager's tolerance), or until
        ``wait_timeout``; the locks are released either way and the report says what was seen.
        """
        with self._release_lock:
            if self._report is not None:
                return self._report
            if self._unlocked:  # an earlier release() was interrupted after unlocking
                return ReleaseReport(
                    gpus=self.indices,
                    source=self._manager.inventory.source,
                    memory_back=False,
                    waited_s=0.0,
                    error="an earlier release was interrupted before the memory check finished",
                )
            try:
                report = self._wait_for_gpus(worker_pids, wait_timeout)
            finally:
                # Unlocked even when the wait is interrupted (Ctrl-C): the lease never outlives release().
                self._unlock()
                self._unlocked = True
                _HELD_LEASES.discard(self)
            self._report = report
            return report

    def _wait_for_gpus(self, worker_pids: Collection[int], wait_timeout: float) -> ReleaseReport:
        manager = self._manager
        inventory = manager.inventory
        if inventory.source == "declared":
            return ReleaseReport(gpus=self.indices, source=inventory.source, memory_back=True, waited_s=0.0)
        clock, sleep = manager.clock, manager.sleep
        wanted = set(worker_pids)
        tolerance = manager.release_tolerance_mib
        start = clock()
        lingering: tuple[int, ...] = ()
        shortfalls: tuple[GpuShortfall, ...] = ()
        while True:
            try:
                reading = {g.index: g for g in inventory.snapshot()}
            except InventoryUnavailable as exc:
                return ReleaseReport(
                    gpus=self.indices,
                    source=inventory.source,
                    memory_back=False,
                    waited_s=clock() - start,
                    lingering_pids=lingering,
                    shortfalls=shortfalls,
                    error=str(exc),
                )
            present = [reading[i] for i in self.indices if i in reading]
            lingering = tuple(sorted(wanted.intersection(p for g in present for p in g.pids)))
            shortfalls = tuple(
                GpuShortfall(g.index, self._free_before[g.index], g.free_mib)
                for g in present
                if g.free_mib < self._free_before[g.index] - tolerance
            )
            waited = clock() - start
            if not lingering and not shortfalls:
                return ReleaseReport(
                    gpus=self.indices, source=inventory.source, memory_back=True, waited_s=waited
                )
            if waited >= wait_timeout:
                return ReleaseReport(
                    gpus=self.indices,
                    source=inventory.source,
                    memory_back=False,
                    waited_s=waited,
                    lingering_pids=lingering,
                    shortfalls=shortfalls,
                )
            sleep(max(min(manager.release_poll_interval, wait_timeout - waited), 0.0))

    def _unlock(self) -> None:
        manager = self._manager
        for index in self.indices:
            path = _record_path(manager.lock_dir, manager.namespace, index)
            record = read_holder_record(path, only_live=False)
            if record is not None and record.pid == os.getpid():
                try:
                    path.unlink()
                except OSError:
                    pass
        for lock in self._locks:
            lock.release(force=True)
        self._locks = []

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.namespace} GPUs {_join(self.indices)} for {self.holder!r} ({state})>"


@dataclass
class _Attempt:
    """Why one allocation attempt failed: for the wait and timeout messages."""

    gpus: list[GpuInfo]
    locked: set[int] = field(default_factory=set)
    low: set[int] = field(default_factory=set)
    #: GPU index -> (dead holder pid, pids of the workers it left running there)
    orphans: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)


class LeaseManager:
    """Hands out exclusive GPU leases from ``inventory``, coordinated through lock files in ``lock_dir``.

    ``namespace`` keeps lock files of different inventories apart (``nvml``, ``sim-4x80``). ``clock``
    and ``sleep`` drive polling (monotonic seconds); tests pass fakes.
    """

    def __init__(
        self,
        lock_dir: Path,
        inventory: Inventory,
        *,
        namespace: str,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        notice_interval: float = 30.0,
        release_tolerance_mib: int = 256,
        release_poll_interval: float = 0.5,
        on_message: Callable[[str], None] | None = None,
    ) -> None:
        if not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"lease namespace {namespace!r} may only hold letters, digits, '.', '_' and '-'")
        self.lock_dir = Path(lock_dir)
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        self.inventory = inventory
        self.namespace = namespace
        self.clock = clock
        self.sleep = sleep
        self.notice_interval = notice_interval
        self.release_tolerance_mib = release_tolerance_mib
        self.release_poll_interval = release_poll_interval
        self.on_message = on_message
        #: what :meth:`sweep_untrusted_records` said, for callers that show messages their own way
        self.notices: list[str] = []
        self._reported_untrusted: set[tuple[str, str]] = set()
        inventory.bind_leases(self.lock_dir, namespace)
        self.sweep_untrusted_records()

    def lock_path(self, index: int) -> Path:
        return _lock_path(self.lock_dir, self.namespace, index)

    def record_path(self, index: int) -> Path:
        return _record_path(self.lock_dir, self.namespace, index)

    def can_ever_fit(self, tp: int, memory_mib: int) -> str | None:
        """Reason why such a lease can never be granted by this inventory, or ``None``."""
        return self.inventory.can_ever_fit(tp, memory_mib)

    def holders(self) -> dict[int, HolderRecord]:
        """Live holder records of locked GPUs, by GPU index."""
        result = {}
        for gpu in self.inventory.static_gpus():
            record = read_holder_record(self.record_path(gpu.index))
            if record is not None and lock_is_held(self.lock_path(gpu.index)):
                result[gpu.index] = record
        return result

    # -- untrusted records

    def _notify(self, text: str) -> None:
        self.notices.append(text)
        if self.on_message is not None:
            self.on_message(text)
            return
        import warnings

        with contextlib.suppress(HolderRecordWarning):  # -W error must not turn a cleanup into a crash
            warnings.warn(text, HolderRecordWarning, stacklevel=4)  # the LeaseManager(...) call

    def sweep_untrusted_records(self) -> list[str]:
        """Ignore every GPU holder record of the lock directory that cannot be trusted, remove those whose
        lock is free (under that lock), and say so in one message (``on_message``, else a
        :class:`HolderRecordWarning`). Also removes temporary files that dead writers left. Returns the
        names of the records removed. Called when the manager is made; never raises for what it finds."""
        from filelock import FileLock, Timeout

        found: list[str] = []
        removed: list[str] = []
        try:
            paths = sorted(self.lock_dir.glob("gpu-*.json"))
        except OSError:
            return removed
        for path in paths:
            _, problem = inspect_holder_record(path)
            if problem is None:
                continue
            outcome = "kept: its lock is held"
            lock = FileLock(path.with_suffix(".lock"), thread_local=False, mode=0o644)
            try:
                lock.acquire(blocking=False)
            except Timeout:
                pass
            except OSError as exc:
                from .state import describe_file_problem

                outcome = f"kept: its lock file {describe_file_problem(lock.lock_file, exc)}"
            else:
                try:
                    _, problem_now = inspect_holder_record(path)
                    if problem_now is not None:
                        try:
                            path.unlink()
                        except IsADirectoryError:
                            outcome = "kept: a directory is never removed"
                        except OSError as exc:
                            outcome = f"kept: cannot remove it ({exc.strerror or exc})"
                        else:
                            outcome = "removed"
                            removed.append(path.name)
                    else:
                        outcome = "rewritten meanwhile"
                finally:
                    lock.release(force=True)
            key = (path.name, problem)
            if key not in self._reported_untrusted:
                self._reported_untrusted.add(key)
                found.append(f"{path.name} ({problem}; {outcome})")
        _remove_dead_temporaries(self.lock_dir)
        if found:
            self._notify(f"ignored {len(found)} untrusted GPU holder record(s) in {self.lock_dir}: "
                         + "; ".join(found))
        return removed

    # -- acquisition

    def try_acquire(self, tp: int, memory_mib: int, *, holder: str) -> Lease | None:
        """One non-blocking attempt; ``None`` if no fitting GPUs are free now."""
        reason = self.can_ever_fit(tp, memory_mib)
        if reason is not None:
            raise LeaseImpossible(reason)
        lease, _ = self._attempt(tp, memory_mib, holder)
        return lease

    def acquire(
        self,
        tp: int,
        memory_mib: int,
        *,
        holder: str,
        timeout: float,
        poll_interval: float = 0.5,
        on_wait: Callable[[str], None] | None = None,
    ) -> Lease:
        """Lease ``tp`` GPUs with at least ``memory_mib`` MiB free each, waiting up to ``timeout`` s.

        Raises :class:`LeaseImpossible` at once if the request can never be met (:meth:`can_ever_fit`), and
        :class:`LeaseTimeout` naming the holders and the GPUs short of memory when the time is up.
        ``on_wait`` gets a message when the wait starts and then every ``notice_interval`` seconds.
        """
        reason = self.can_ever_fit(tp, memory_mib)
        if reason is not None:
            raise LeaseImpossible(reason)
        start = self.clock()
        next_notice: float | None = None
        waiting_flag: Path | None = None
        try:
            while True:
                lease, attempt = self._attempt(tp, memory_mib, holder)
                if lease is not None:
                    return lease
                if waiting_flag is None:
                    waiting_flag = flag_waiting(self.lock_dir, lease_waiting_prefix(self.namespace))
                now = self.clock()
                waited = now - start
                if waited >= timeout:
                    raise LeaseTimeout(
                        f"no lease of {tp} GPU(s) with {memory_mib} MiB free each for {holder!r} within "
                        f"{timeout:g} s ({self.inventory.describe()}, locks in {self.lock_dir}): "
                        + self._explain(attempt, memory_mib)
                    )
                if on_wait is not None and (next_notice is None or now >= next_notice):
                    on_wait(
                        f"waiting for {tp} GPU(s) with {memory_mib} MiB free each for {holder!r} "
                        f"({waited:.0f} s of {timeout:g} s): " + self._explain(attempt, memory_mib)
                    )
                    next_notice = now + self.notice_interval
                self.sleep(max(min(poll_interval, timeout - waited), 0.0))
        finally:
            unflag_waiting(waiting_flag)

    # -- waiters: a process that waits for a lease says so (resources.waiters), so that holders of idle pooled
    # workers let go

    def others_waiting(self) -> bool:
        """Whether another live process of this machine waits for a lease of this inventory: a pool then
        retires its idle workers instead of keeping their GPUs."""
        return (live_waiters(self.lock_dir, lease_waiting_prefix(self.namespace))
                or others_waiting_for_ports(self.lock_dir))

    def _attempt(self, tp: int, memory_mib: int, holder: str) -> tuple[Lease | None, _Attempt]:
        gpus = self.inventory.snapshot()
        attempt = _Attempt(gpus=gpus)
        eligible = [g.index for g in gpus if g.free_mib >= memory_mib]
        attempt.low = {g.index for g in gpus if g.free_mib < memory_mib}
        for group in _candidate_groups(eligible, tp, attempt):
            locks = self._lock_group(group, attempt)
            if locks is None:
                continue
            orphans = _dead_holder_leftovers(self.lock_dir, self.namespace, group)
            if orphans:  # the GPU is unlocked but its dead holder's engine still runs there: not free yet
                attempt.orphans.update(orphans)
                attempt.locked.update(orphans)
                for lock in locks:
                    lock.release(force=True)
                continue
            # We hold the locks now, so any record still there is stale (a live process that left it behind,
            # a planted one): it must not make the GPU look used. Our own record replaces it below.
            for index in group:
                path = self.record_path(index)
                if path.exists() and not path.is_dir():
                    with contextlib.suppress(OSError):
                        path.unlink()
            # Re-read after locking: someone may have started on a GPU between the reading and the lock.
            try:
                fresh = {g.index: g for g in self.inventory.snapshot()}
            except BaseException:
                for lock in locks:
                    lock.release(force=True)
                raise
            short = [i for i in group if i not in fresh or fresh[i].free_mib < memory_mib]
            if short:
                attempt.low.update(short)
                for lock in locks:
                    lock.release(force=True)
                continue
            chosen = tuple(fresh[i] for i in group)
            try:
                self._write_records(chosen, holder, memory_mib)
            except BaseException:
                for index in group:
                    with contextlib.suppress(OSError):
                        self.record_path(index).unlink(missing_ok=True)
                for lock in locks:
                    lock.release(force=True)
                raise
            return Lease(self, chosen, locks, holder=holder, memory_mib=memory_mib), attempt
        return None, attempt

    def _lock_group(self, group: Sequence[int], attempt: _Attempt) -> list[BaseFileLock] | None:
        from filelock import FileLock, Timeout

        locks: list[BaseFileLock] = []
        for index in group:
            lock = FileLock(self.lock_path(index), thread_local=False, mode=0o644)  # not umask-dependent
            try:
                lock.acquire(blocking=False)
            except Timeout:
                attempt.locked.add(index)
                for held in locks:
                    held.release(force=True)
                return None
            except OSError as exc:  # a directory, a symlink, a file of another user at the lock's path
                for held in locks:
                    held.release(force=True)
                raise self._unusable("GPU lock file", self.lock_path(index), exc) from None
            locks.append(lock)
        return locks

    def _unusable(self, what: str, path: Path, exc: OSError) -> Exception:
        from .state import UnusableFile, describe_file_problem

        problem = describe_file_problem(path, exc)
        if not problem.startswith("is "):  # not something in the way: a full disk, no permission
            return UnusableFile(f"cannot write the {what} {path}: {problem}; free some space or choose another "
                                "--sgl-lock-dir")
        return UnusableFile(
            f"cannot use the {what} {path}: it {problem}; remove it (the lock directory "
            f"{self.lock_dir} holds only files the plugin makes) or choose another --sgl-lock-dir"
        )

    def _write_records(self, gpus: Sequence[GpuInfo], holder: str, memory_mib: int) -> None:
        now = time.time()
        host = hostname()
        indices = tuple(g.index for g in gpus)
        for gpu in gpus:
            path = self.record_path(gpu.index)
            try:
                _write_record(path, HolderRecord(
                    pid=os.getpid(),
                    hostname=host,
                    holder=holder,
                    since=now,
                    uuid=gpu.uuid,
                    memory_mib=memory_mib,
                    index=gpu.index,
                    namespace=self.namespace,
                    gpus=indices,
                ))
            except OSError as exc:
                raise self._unusable("GPU holder record", path, exc) from None

    def _explain(self, attempt: _Attempt, memory_mib: int) -> str:
        now = time.time()
        parts = []
        for gpu in attempt.gpus:
            record = read_holder_record(self.record_path(gpu.index))
            if record is not None and not lock_is_held(self.lock_path(gpu.index)):
                record = None  # trust the lock, not the record
            label = f"GPU {gpu.index}"
            if record is not None:
                parts.append(f"{label} leased by {record.describe(now)}")
            elif gpu.index in attempt.orphans:
                dead, pids = attempt.orphans[gpu.index]
                parts.append(f"{label} still used by worker process(es) {_join(pids)} of pid {dead}, which died "
                             "without releasing its lease (its session watchdog ends them)")
            elif gpu.index in attempt.locked:
                parts.append(f"{label} locked (holder record not written yet or unreadable)")
            elif gpu.index in attempt.low:
                procs = f"; processes on it: {_join(gpu.pids)}" if gpu.pids else ""
                parts.append(
                    f"{label} skipped: {gpu.free_mib} MiB free of {gpu.total_mib} MiB < {memory_mib} MiB "
                    f"needed{procs}"
                )
            else:
                parts.append(f"{label} free")
        return "; ".join(parts) if parts else "the inventory has no GPU"


def _dead_holder_leftovers(
    lock_dir: Path, namespace: str, group: Sequence[int]
) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Workers still running on GPUs of ``group`` whose lease holder died without releasing the lease.

    The kernel drops a dead holder's ``flock`` at once, but the engine it launched lives on until the
    holder's session watchdog (or the next session's janitor) ends it, which may take the engine's whole
    SIGTERM grace: the GPU must not be handed out meanwhile. Only a clean release removes the holder record,
    so a record whose process is gone names the dead holder; its workers carry ``SGLWORKER_OWNER=<pid>-...``.
    Cheap when nobody died: the process table is scanned only for such stale records.
    """
    result: dict[int, tuple[int, tuple[int, ...]]] = {}
    for index in group:
        record = read_holder_record(_record_path(lock_dir, namespace, index), only_live=False)
        if record is None or record.hostname != hostname():
            continue
        if process_alive(record.pid, record.since, record.hostname):
            continue
        pids = session_worker_pids(record.pid, record.since)
        if pids:
            result[index] = (record.pid, pids)
    return result


def _candidate_groups(eligible: Sequence[int], tp: int, attempt: _Attempt) -> Iterator[list[int]]:
    """Groups of ``tp`` GPUs to try, best first: runs of consecutive indices (aligned runs first), then
    any ``tp`` GPUs not known to be locked, lowest indices first. Skips GPUs found locked meanwhile."""
    ordered = sorted(eligible)
    present = set(ordered)
    if tp > 1:
        runs = [
            list(range(start, start + tp))
            for start in ordered
            if all(start + k in present for k in range(tp))
        ]
        runs.sort(key=lambda run: (run[0] % tp != 0, run[0]))
        for run in runs:
            if not attempt.locked.intersection(run) and not attempt.low.intersection(run):
                yield run
    tried: set[tuple[int, ...]] = set()
    while True:
        free = [i for i in ordered if i not in attempt.locked and i not in attempt.low]
        if len(free) < tp:
            return
        group = free[:tp]
        key = tuple(group)
        if key in tried:
            return
        tried.add(key)
        yield group
