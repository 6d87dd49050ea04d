"""The end of a lease: the bounded wait for the leased GPUs' memory to come back (:func:`wait_for_release`),
and what it saw (:class:`ReleaseReport`, :class:`GpuShortfall`).

After a worker's teardown its processes may still be listed on its GPUs and their memory may take a moment to
come back; :meth:`Lease.release <pytest_sglworker.resources.gpus.leases.Lease.release>` waits here (bounded)
before it unlocks, so that the next lease finds the GPUs free.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from ...errors import InventoryUnavailable
from .inventory import Inventory, join_indices

__all__ = ["GpuShortfall", "ReleaseReport", "ReleaseSettings", "wait_for_release"]


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
        where = f"GPU(s) {join_indices(self.gpus)}"
        if self.source == "declared":
            return f"released declared {where}"
        if self.memory_back:
            return f"released {where}; memory came back after {self.waited_s:.1f} s"
        parts = []
        if self.lingering_pids:
            parts.append(f"worker process(es) {join_indices(self.lingering_pids)} still listed on the GPU(s)")
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


class ReleaseSettings(Protocol):
    """What the wait reads from the lease's manager (a :class:`~pytest_sglworker.resources.gpus.leases.LeaseManager`):
    the inventory, the clock and sleep that drive polling (monotonic seconds), the memory that may stay missing
    (MiB), and the polling interval (seconds)."""

    inventory: Inventory
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    release_tolerance_mib: int
    release_poll_interval: float


def wait_for_release(
    manager: ReleaseSettings,
    indices: tuple[int, ...],
    free_before: Mapping[int, int],
    worker_pids: Collection[int],
    wait_timeout: float,
) -> ReleaseReport:
    """Wait (bounded) for the GPUs ``indices`` of a lease to come back, and say what was seen.

    With NVML: polls ``manager.inventory`` until none of ``worker_pids`` is listed on the GPUs and each GPU's
    free memory is back to ``free_before`` (minus ``manager.release_tolerance_mib``), or until ``wait_timeout``
    seconds (``manager.clock``) have passed. A declared inventory has nothing to wait for.
    """
    inventory = manager.inventory
    if inventory.source == "declared":
        return ReleaseReport(gpus=indices, source=inventory.source, memory_back=True, waited_s=0.0)
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
                gpus=indices,
                source=inventory.source,
                memory_back=False,
                waited_s=clock() - start,
                lingering_pids=lingering,
                shortfalls=shortfalls,
                error=str(exc),
            )
        present = [reading[i] for i in indices if i in reading]
        lingering = tuple(sorted(wanted.intersection(p for g in present for p in g.pids)))
        shortfalls = tuple(
            GpuShortfall(g.index, free_before[g.index], g.free_mib)
            for g in present
            if g.free_mib < free_before[g.index] - tolerance
        )
        waited = clock() - start
        if not lingering and not shortfalls:
            return ReleaseReport(
                gpus=indices, source=inventory.source, memory_back=True, waited_s=waited
            )
        if waited >= wait_timeout:
            return ReleaseReport(
                gpus=indices,
                source=inventory.source,
                memory_back=False,
                waited_s=waited,
                lingering_pids=lingering,
                shortfalls=shortfalls,
            )
        sleep(max(min(manager.release_poll_interval, wait_timeout - waited), 0.0))
