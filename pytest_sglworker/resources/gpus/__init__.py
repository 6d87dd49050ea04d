"""GPU inventory (NVML or a declared ``sim:N`` one) and file-locked GPU leases.

Plain Python, no pytest. ``pynvml``, ``filelock`` and ``psutil`` are imported lazily, inside functions,
so importing this package costs nothing in a run that uses no worker. The pytest process only ever
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

Modules
-------
The package re-exports the names its users import; the code lives in modules that depend one way
(selection and holders <- inventory <- release <- leases):

* :mod:`.selection`: the ``--sgl-gpus`` value and ``CUDA_VISIBLE_DEVICES`` parsing.
* :mod:`.holders`: holder records and the lock-file layout; the dead-holder guard.
* :mod:`.inventory`: :class:`GpuInfo`, the NVML and declared inventories, :func:`load_inventory`.
* :mod:`.release`: the wait for a lease's memory to come back, and its :class:`ReleaseReport`.
* :mod:`.leases`: :class:`Lease` and :class:`LeaseManager`.

Waiting for a lease is flagged in the lock directory through :mod:`pytest_sglworker.resources.waiters`, shared
with the port blocks. Ray's leases, the other lease surface, are in :mod:`pytest_sglworker.workers.ray_cluster`.
"""

from __future__ import annotations

from ..processes import PID_MAX as PID_MAX
from .holders import MAX_RECORD_BYTES as MAX_RECORD_BYTES
from .holders import (
    HolderRecord,
    HolderRecordWarning,
    gpu_lock_path,
    holder_record_path,
    inspect_holder_record,
    lock_is_held,
    read_holder_record,
    write_holder_record,
)
from .inventory import MIB as MIB
from .inventory import (
    DeclaredInventory,
    GpuInfo,
    Inventory,
    NvmlInventory,
    can_ever_fit,
    load_inventory,
)
from .leases import Lease, LeaseManager
from .release import GpuShortfall, ReleaseReport
from .selection import DEFAULT_SIM_GIB, GpuSelection, parse_gpus_option, resolve_visible_devices

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

# The single module this package replaced also had these names; tests plant holder records with the private ones.
_record_path = holder_record_path
_lock_path = gpu_lock_path
_write_record = write_holder_record
