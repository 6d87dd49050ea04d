"""Unit tests of pytest_sglworker.resources.gpus: selection parsing, inventories (against a fake NVML module),
leases (in one process with a fake clock, and across real processes)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_sglworker.errors import InventoryUnavailable, LeaseTimeout
from pytest_sglworker.resources.gpus import (
    DeclaredInventory,
    GpuInfo,
    GpuSelection,
    Lease,
    LeaseManager,
    NvmlInventory,
    can_ever_fit,
    load_inventory,
    parse_gpus_option,
    read_holder_record,
    resolve_visible_devices,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
H100_MIB = 81559

# --------------------------------------------------------------------------------------------------
# a fake NVML module and a fake clock


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(seconds, 0.001)


class FakeNVMLError(Exception):
    pass


Value = Callable[[float], Any]


class FakeDevice:
    def __init__(
        self,
        uuid: str,
        *,
        name: str = "NVIDIA H100 80GB HBM3",
        total_mib: int = H100_MIB,
        free_mib: int | Value | None = None,
        compute_pids: list[int] | Value = (),  # type: ignore[assignment]
        graphics_pids: list[int] | Value | None = (),  # type: ignore[assignment]
    ) -> None:
        self.uuid = uuid
        self.name = name
        self.total_mib = total_mib
        self.free_mib = total_mib - 500 if free_mib is None else free_mib
        self.compute_pids = compute_pids
        self.graphics_pids = graphics_pids


def _at(value: Any, now: float) -> Any:
    return value(now) if callable(value) else value


class FakeNvml:
    """Stands in for the ``pynvml`` module: the functions and the error type the inventory uses."""

    NVMLError = FakeNVMLError

    def __init__(
        self,
        devices: list[FakeDevice],
        *,
        clock: FakeClock | None = None,
        as_bytes: bool = False,
        init_error: str | None = None,
        count_error: str | None = None,
    ) -> None:
        self.devices = devices
        self.clock = clock or FakeClock()
        self.as_bytes = as_bytes
        self.init_error = init_error
        self.count_error = count_error
        self.inits = 0
        self.shutdowns = 0

    def _s(self, text: str) -> str | bytes:
        return text.encode() if self.as_bytes else text

    def nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error:
            raise FakeNVMLError(self.count_error)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        return self.devices[index]

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str | bytes:
        return self._s(handle.uuid)

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str | bytes:
        return self._s(handle.name)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> SimpleNamespace:
        free = int(_at(handle.free_mib, self.clock.now))
        return SimpleNamespace(
            total=handle.total_mib * MIB, free=free * MIB, used=(handle.total_mib - free) * MIB
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=1) for p in _at(handle.compute_pids, self.clock.now)]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        if handle.graphics_pids is None:
            raise FakeNVMLError("Not Supported")
        return [SimpleNamespace(pid=p, usedGpuMemory=1) for p in _at(handle.graphics_pids, self.clock.now)]


UUIDS = [
    "GPU-0a1b2c3d-0000-0000-0000-000000000000",
    "GPU-1a1b2c3d-0000-0000-0000-000000000001",
    "GPU-2a1b2c3d-0000-0000-0000-000000000002",
    "GPU-2b000000-0000-0000-0000-000000000003",
]


def make_nvml(count: int = 4, **kwargs: Any) -> FakeNvml:
    return FakeNvml([FakeDevice(UUIDS[i]) for i in range(count)], **kwargs)


def make_manager(
    tmp_path: Path, nvml: FakeNvml, *, visible: str | None = None, selection: GpuSelection | None = None
) -> LeaseManager:
    inventory = NvmlInventory(nvml_module=nvml, visible=visible, selection=selection)
    return LeaseManager(
        tmp_path / "locks", inventory, namespace="nvml", clock=nvml.clock, sleep=nvml.clock.sleep
    )


# --------------------------------------------------------------------------------------------------
# parse_gpus_option


@pytest.mark.parametrize("value", ["", "auto", " AUTO "])
def test_parse_auto(value: str) -> None:
    selection = parse_gpus_option(value)
    assert selection.kind == "auto"
    assert selection.namespace == "nvml"
    assert not selection.is_simulated


def test_parse_indices_and_uuids() -> None:
    assert parse_gpus_option("0,2").indices == (0, 2)
    assert parse_gpus_option(" 3 ").indices == (3,)
    selection = parse_gpus_option("GPU-0a1b,gpu-1a1b2c3d")
    assert selection.kind == "uuids"
    assert selection.uuids == ("GPU-0a1b", "GPU-1a1b2c3d")
    assert selection.namespace == "nvml"


@pytest.mark.parametrize(
    ("value", "count", "total_mib", "namespace"),
    [
        ("sim:4", 4, 80 * 1024, "sim-4x80"),
        ("sim:4x80", 4, 80 * 1024, "sim-4x80"),
        ("SIM:2x24", 2, 24 * 1024, "sim-2x24"),
        ("sim:1x0.5", 1, 512, "sim-1x0.5"),
    ],
)
def test_parse_sim(value: str, count: int, total_mib: int, namespace: str) -> None:
    selection = parse_gpus_option(value)
    assert selection.is_simulated
    assert (selection.sim_count, selection.sim_total_mib) == (count, total_mib)
    assert selection.namespace == namespace


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("sim:0", "at least one GPU"),
        ("sim:x", "not a whole number"),
        ("sim:4xbig", "not a GPU size"),
        ("sim:4x-1", "positive"),
        ("sim:4xinf", "positive"),
        ("0,a", "neither a GPU index nor a GPU UUID"),
        ("0,0", "listed twice"),
        ("1,,2", "empty entry"),
        ("0,GPU-abc", "cannot be mixed"),
        ("-1", "neither"),
        ("GPU-", "neither"),
    ],
)
def test_parse_errors_name_value_and_forms(value: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_gpus_option(value)
    message = str(info.value)
    assert repr(value) in message
    assert why in message
    assert "accepted forms" in message and "sim:NxGiB" in message and "'0,2'" in message
    assert "\n" not in message


# --------------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("-1", []),
        ("2,0", [0, 2]),
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("1,1", [1]),
        (UUIDS[3], [3]),
        (f"{UUIDS[1]},{UUIDS[0]}", [0, 1]),
        ("GPU-0a1b", [0]),  # unique prefix
        ("GPU-2,GPU-0", []),  # ambiguous prefix ends the list
        ("GPU-2b,1", [1, 3]),
        ("MIG-abc,0", []),
        ("GPU-ffff", []),
    ],
)
def test_resolve_visible_devices(value: str | None, expected: list[int]) -> None:
    assert resolve_visible_devices(value, UUIDS) == expected


# --------------------------------------------------------------------------------------------------
# NvmlInventory against the fake module


@pytest.mark.parametrize("as_bytes", [False, True])
def test_nvml_snapshot_reads_devices(as_bytes: bool) -> None:
    nvml = make_nvml(2, as_bytes=as_bytes)
    nvml.devices[1].free_mib = 1000
    nvml.devices[1].compute_pids = [42, 7]
    nvml.devices[1].graphics_pids = [7, 99]
    nvml.devices[0].graphics_pids = None  # NotSupported is tolerated
    inventory = NvmlInventory(nvml_module=nvml)
    gpus = inventory.snapshot()
    assert gpus == [
        GpuInfo(0, UUIDS[0], "NVIDIA H100 80GB HBM3", H100_MIB, H100_MIB - 500, ()),
        GpuInfo(1, UUIDS[1], "NVIDIA H100 80GB HBM3", H100_MIB, 1000, (7, 42, 99)),
    ]
    assert inventory.source == "nvml"
    assert inventory.visible_devices_value(gpus) == "0,1"  # NVML indices (sglang parses them as ints)
    inventory.close()
    inventory.close()
    assert nvml.shutdowns == 1
    inventory.snapshot()  # reopens
    assert nvml.inits == 2


def test_nvml_visible_uuids_indices_and_empty() -> None:
    nvml = make_nvml(4)
    assert [g.index for g in NvmlInventory(nvml, visible=f"{UUIDS[3]},{UUIDS[1]}").snapshot()] == [1, 3]
    assert [g.index for g in NvmlInventory(nvml, visible="2,0").snapshot()] == [0, 2]
    empty = NvmlInventory(nvml, visible="")
    assert empty.snapshot() == []
    reason = empty.can_ever_fit(1, 0)
    assert reason is not None and "has 0" in reason and "CUDA_VISIBLE_DEVICES=''" in reason


def test_nvml_selection_limits_visible() -> None:
    nvml = make_nvml(4)
    inventory = NvmlInventory(nvml, visible="0,1,2", selection=parse_gpus_option("2,0"))
    assert inventory.indices == (0, 2)
    assert "selection '2,0'" in inventory.describe()
    by_uuid = NvmlInventory(nvml, selection=parse_gpus_option("GPU-2b"))
    assert by_uuid.indices == (3,)


def test_nvml_selection_errors() -> None:
    nvml = make_nvml(4)
    with pytest.raises(
        ValueError, match=r"names NVML GPU\(s\) 3 that CUDA_VISIBLE_DEVICES='0,1' hides.*NVML indices"
    ):
        NvmlInventory(nvml, visible="0,1", selection=parse_gpus_option("1,3"))
    with pytest.raises(ValueError, match=r"NVML index 9, but NVML reports 4 GPU\(s\)"):
        NvmlInventory(nvml, selection=parse_gpus_option("9"))
    with pytest.raises(ValueError, match="is ambiguous"):
        NvmlInventory(nvml, selection=parse_gpus_option("GPU-2"))
    with pytest.raises(ValueError, match="matches no GPU"):
        NvmlInventory(nvml, selection=parse_gpus_option("GPU-ffff"))
    assert nvml.inits == nvml.shutdowns  # closed after each failure


@pytest.mark.parametrize(
    ("error", "hint"),
    [("NVML Shared Library Not Found", "no NVIDIA driver"), ("Driver Not Loaded", "driver is not loaded")],
)
def test_nvml_init_failure_is_inventory_unavailable(error: str, hint: str) -> None:
    with pytest.raises(InventoryUnavailable) as info:
        NvmlInventory(nvml_module=make_nvml(init_error=error))
    message = str(info.value)
    assert f"NVML is not available ({error})" in message
    assert hint in message and "--sgl-gpus sim:N" in message
    assert "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_nvml_listing_failure_is_inventory_unavailable() -> None:
    nvml = make_nvml(count_error="Unknown Error")
    with pytest.raises(InventoryUnavailable, match=r"NVML failed while listing GPUs \(Unknown Error\)"):
        NvmlInventory(nvml_module=nvml)
    assert nvml.shutdowns == 1


def test_load_inventory_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(InventoryUnavailable, match=r"cannot import pynvml.*--sgl-gpus sim:N"):
        load_inventory(parse_gpus_option("auto"), {})


def test_load_inventory_nvml_uses_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", make_nvml(4))
    inventory = load_inventory(parse_gpus_option("1,3"), {"CUDA_VISIBLE_DEVICES": "3,1,2"})
    assert isinstance(inventory, NvmlInventory)
    assert inventory.indices == (1, 3)
    failing = make_nvml(init_error="NVML Shared Library Not Found")
    monkeypatch.setitem(sys.modules, "pynvml", failing)
    with pytest.raises(InventoryUnavailable, match="Shared Library Not Found"):
        load_inventory(parse_gpus_option(""), {})


def test_load_inventory_sim_ignores_cuda_visible_devices() -> None:
    inventory = load_inventory(parse_gpus_option("sim:3x24"), {"CUDA_VISIBLE_DEVICES": ""})
    assert isinstance(inventory, DeclaredInventory)
    assert inventory.source == "declared"
    assert inventory.namespace == "sim-3x24"
    gpus = inventory.snapshot()
    assert [(g.index, g.name, g.uuid, g.total_mib, g.free_mib) for g in gpus] == [
        (i, f"sim-gpu-{i}", f"GPU-sim-{i:012d}", 24 * 1024, 24 * 1024) for i in range(3)
    ]
    assert inventory.visible_devices_value(gpus[1:]) == "1,2"


# --------------------------------------------------------------------------------------------------
# can_ever_fit


def test_can_ever_fit() -> None:
    gpus = [GpuInfo(i, f"u{i}", "g", total, 0) for i, total in enumerate([40000, 81559, 81559])]
    assert can_ever_fit(gpus, 2, 80000) is None
    assert can_ever_fit(gpus, 3, 30000) is None
    reason = can_ever_fit(gpus, 4, 1, where="sim")
    assert reason is not None and "tp=4 needs 4 GPUs but the inventory has 3 (sim)" in reason
    reason = can_ever_fit(gpus, 3, 50000)
    assert reason is not None and "2 GPU(s)" in reason and "largest: 81559 MiB" in reason
    assert can_ever_fit(gpus, 1, 90000) is not None
    assert can_ever_fit(gpus, 0, 1) is not None


def test_acquire_impossible_raises_at_once(tmp_path: Path) -> None:
    nvml = make_nvml(2)
    manager = make_manager(tmp_path, nvml)
    with pytest.raises(ValueError, match="tp=3 needs 3 GPUs"):
        manager.acquire(3, 100, holder="t", timeout=100)
    with pytest.raises(ValueError, match="can never fit"):
        manager.acquire(1, H100_MIB + 1, holder="t", timeout=100)
    assert nvml.clock.now == 0.0  # no waiting


# --------------------------------------------------------------------------------------------------
# leases with the fake NVML


def test_lease_env_files_and_release(tmp_path: Path) -> None:
    nvml = make_nvml(4)
    manager = make_manager(tmp_path, nvml)
    lease = manager.acquire(2, 20000, holder="tests/test_x.py::test_a", timeout=5)
    assert lease.indices == (0, 1)
    assert lease.env() == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert (tmp_path / "locks" / "gpu-nvml-0.lock").exists()
    record = json.loads((tmp_path / "locks" / "gpu-nvml-1.json").read_text())
    assert record["pid"] == os.getpid()
    assert record["holder"] == "tests/test_x.py::test_a"
    assert record["uuid"] == UUIDS[1] and record["memory_mib"] == 20000 and record["gpus"] == [0, 1]
    assert set(manager.holders()) == {0, 1}
    report = lease.release()
    assert report.memory_back and report.waited_s == 0.0
    assert lease.release() is report  # idempotent
    assert not (tmp_path / "locks" / "gpu-nvml-1.json").exists()
    assert manager.holders() == {}


def test_tp2_gets_adjacent_gpus_and_exclusive(tmp_path: Path) -> None:
    nvml = make_nvml(4)
    manager = make_manager(tmp_path, nvml)
    other = make_manager(tmp_path, nvml)  # a second manager in the same process: same lock files
    single = manager.acquire(1, 1000, holder="one", timeout=1)
    assert single.indices == (0,)
    pair = other.acquire(2, 1000, holder="pair", timeout=1)
    assert pair.indices == (2, 3)  # (1, 2) is adjacent too, but (2, 3) keeps an aligned pair whole
    assert len(set(pair.cuda_visible_devices.split(","))) == 2
    last = manager.acquire(1, 1000, holder="last", timeout=1)
    assert last.indices == (1,)
    with pytest.raises(LeaseTimeout):
        other.acquire(1, 1000, holder="none left", timeout=0)
    for lease in (single, pair, last):
        lease.release()


def test_tp2_falls_back_to_non_adjacent(tmp_path: Path) -> None:
    nvml = make_nvml(4)
    manager = make_manager(tmp_path, nvml)
    a = manager.acquire(1, 0, holder="a", timeout=0)
    b = manager.acquire(1, 0, holder="b", timeout=0)
    c = manager.acquire(1, 0, holder="c", timeout=0)
    b_idx = b.indices
    b.release()
    a.release()
    assert (a.indices, b_idx, c.indices) == ((0,), (1,), (2,))
    d = manager.acquire(1, 0, holder="d", timeout=0)  # takes 0
    with manager.acquire(2, 0, holder="pair", timeout=0) as pair:
        assert pair.indices == (1, 3)  # no adjacent pair is free: any two distinct GPUs
    assert pair.released
    d.release()
    c.release()


def test_gpu_with_low_free_memory_is_skipped(tmp_path: Path) -> None:
    nvml = make_nvml(2)
    nvml.devices[0].free_mib = 3000
    nvml.devices[0].compute_pids = [4242]
    manager = make_manager(tmp_path, nvml)
    with manager.acquire(1, 20000, holder="t", timeout=0) as lease:
        assert lease.indices == (1,)
        with pytest.raises(LeaseTimeout) as info:
            manager.acquire(1, 20000, holder="tests/t.py::second", timeout=0)
    message = str(info.value)
    assert "GPU 0 skipped: 3000 MiB free of 81559 MiB < 20000 MiB needed; processes on it: 4242" in message
    assert f"GPU 1 leased by pid {os.getpid()} for 't'" in message
    assert "tests/t.py::second" in message


def test_wait_until_memory_comes_back(tmp_path: Path) -> None:
    nvml = make_nvml(1)
    nvml.devices[0].free_mib = lambda now: 1000 if now < 12 else H100_MIB - 500
    manager = make_manager(tmp_path, nvml)
    notices: list[str] = []
    lease = manager.acquire(1, 20000, holder="t", timeout=60, poll_interval=1.0, on_wait=notices.append)
    assert 12 <= nvml.clock.now < 14
    assert len(notices) == 1 and "waiting for 1 GPU(s) with 20000 MiB free each" in notices[0]
    assert "GPU 0 skipped: 1000 MiB free" in notices[0]
    lease.release()


def test_timeout_notices_every_30s_and_message(tmp_path: Path) -> None:
    nvml = make_nvml(1)
    nvml.devices[0].free_mib = 100
    manager = make_manager(tmp_path, nvml)
    notices: list[str] = []
    with pytest.raises(LeaseTimeout) as info:
        manager.acquire(
            1, 20000, holder="tests/a.py::b", timeout=70, poll_interval=0.5, on_wait=notices.append
        )
    assert len(notices) == 3  # at 0 s, 30 s, 60 s
    assert 70 <= nvml.clock.now < 70.5
    message = str(info.value)
    assert "no lease of 1 GPU(s) with 20000 MiB free each for 'tests/a.py::b' within 70 s" in message
    assert "GPU 0 skipped: 100 MiB free" in message


def test_release_waits_for_lingering_worker_and_memory(tmp_path: Path) -> None:
    nvml = make_nvml(2)
    manager = make_manager(tmp_path, nvml)
    lease = manager.acquire(2, 1000, holder="t", timeout=0)
    start = nvml.clock.now
    # The worker (pid 555) ran on GPU 1; after teardown its process is listed 3 s more, memory 5 s more.
    nvml.devices[1].compute_pids = lambda now: [555] if now < start + 3 else []
    nvml.devices[1].free_mib = lambda now: 2000 if now < start + 5 else H100_MIB - 500
    report = lease.release(worker_pids=[555, 556], wait_timeout=60)
    assert report.memory_back
    assert 5 <= report.waited_s < 6
    assert "memory came back after 5" in report.message
    assert manager.try_acquire(2, 1000, holder="next") is not None


def test_free_now_probes_the_locks_without_taking_them(tmp_path: Path) -> None:
    """The probe a launch ahead makes before it would start a keeper: locks held by anyone (this process's own leases
    too) count, and probing takes none."""
    manager = make_manager(tmp_path, make_nvml(3))
    assert manager.free_now(3)
    lease = manager.acquire(2, 1000, holder="t", timeout=0)
    assert manager.free_now(1) and not manager.free_now(2)
    assert manager.try_acquire(1, 1000, holder="probe") is not None  # the probe left the free GPU free
    assert not manager.free_now(1)
    lease.release(wait_timeout=0)
    assert manager.free_now(2)


def test_release_gives_up_and_reports(tmp_path: Path) -> None:
    nvml = make_nvml(1)
    manager = make_manager(tmp_path, nvml)
    lease = manager.acquire(1, 1000, holder="t", timeout=0)
    nvml.devices[0].compute_pids = [555, 9]
    nvml.devices[0].free_mib = 30000
    report = lease.release(worker_pids=[555], wait_timeout=10)
    assert not report.memory_back
    assert 10 <= report.waited_s < 11
    assert report.lingering_pids == (555,)
    assert [(s.index, s.free_before_mib, s.free_after_mib) for s in report.shortfalls] == [
        (0, H100_MIB - 500, 30000)
    ]
    assert "worker process(es) 555 still listed" in report.message
    assert f"GPU 0: 30000 MiB free, {H100_MIB - 500} MiB before the lease" in report.message
    # released anyway: the lock is free again (the GPU is now short of memory for a big request only)
    again = manager.try_acquire(1, 1000, holder="again")
    assert again is not None
    again.release(wait_timeout=0)


def test_small_memory_drift_is_tolerated(tmp_path: Path) -> None:
    nvml = make_nvml(1)
    manager = make_manager(tmp_path, nvml)
    lease = manager.acquire(1, 1000, holder="t", timeout=0)
    nvml.devices[0].free_mib = H100_MIB - 500 - 200
    assert lease.release(wait_timeout=5).memory_back


def test_namespaces_do_not_collide(tmp_path: Path) -> None:
    nvml_manager = make_manager(tmp_path, make_nvml(1))
    sim = DeclaredInventory(1, 1024)
    sim_manager = LeaseManager(tmp_path / "locks", sim, namespace=sim.namespace)
    with (
        nvml_manager.acquire(1, 0, holder="real", timeout=0),
        sim_manager.acquire(1, 0, holder="sim", timeout=0),
    ):
        names = sorted(p.name for p in (tmp_path / "locks").iterdir())
    assert names == ["gpu-nvml-0.json", "gpu-nvml-0.lock", "gpu-sim-1x1-0.json", "gpu-sim-1x1-0.lock"]
    with pytest.raises(ValueError, match="namespace"):
        LeaseManager(tmp_path, sim, namespace="bad/name")


def test_declared_inventory_free_memory_follows_leases(tmp_path: Path) -> None:
    inventory = DeclaredInventory(2, 80 * 1024)
    manager = LeaseManager(tmp_path, inventory, namespace=inventory.namespace)
    lease = manager.acquire(1, 30000, holder="t", timeout=0)
    assert lease.env()["CUDA_VISIBLE_DEVICES"] == "0"
    assert [g.free_mib for g in inventory.snapshot()] == [80 * 1024 - 30000, 80 * 1024]
    assert manager.acquire(1, 0, holder="u", timeout=0).indices == (1,)
    report = lease.release(worker_pids=[12345], wait_timeout=30)
    assert report.memory_back and report.source == "declared" and report.waited_s == 0.0  # nothing to wait for
    assert inventory.snapshot()[0].free_mib == 80 * 1024


def test_lease_repr_and_report_str(tmp_path: Path) -> None:
    inventory = DeclaredInventory(1, 1024)
    manager = LeaseManager(tmp_path, inventory, namespace="sim-x")
    lease = manager.acquire(1, 0, holder="h", timeout=0)
    assert "held" in repr(lease) and "sim-x" in repr(lease)
    assert str(lease.release()) == "released declared GPU(s) 0"
    assert "released" in repr(lease)
    assert isinstance(lease, Lease)


# --------------------------------------------------------------------------------------------------
# leases across processes (declared inventory, real locks, real clock)

HOLDER_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from pytest_sglworker.resources.gpus import DeclaredInventory, LeaseManager
    lock_dir, count, holder = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    inventory = DeclaredInventory(count, 81920)
    manager = LeaseManager(lock_dir, inventory, namespace=inventory.namespace)
    lease = manager.acquire(1, 1000, holder=holder, timeout=10)
    print("LEASED", ",".join(map(str, lease.indices)), flush=True)
    sys.stdin.readline()
    lease.release()
    print("RELEASED", flush=True)
    """
)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start holder processes; each one is killed (by pid) and reaped at the end of the test."""
    started: list[subprocess.Popen[str]] = []

    def start(lock_dir: Path, count: int, holder: str) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER_SCRIPT, str(lock_dir), str(count), holder],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO_ROOT,
        )
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("LEASED"), line
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def _sim_manager(lock_dir: Path, count: int = 1) -> LeaseManager:
    inventory = DeclaredInventory(count, 81920)
    return LeaseManager(lock_dir, inventory, namespace=inventory.namespace)


def test_lease_exclusive_across_processes_and_timeout_names_holder(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = spawn(tmp_path, 1, "tests/test_other.py::test_holder")
    manager = _sim_manager(tmp_path)
    with pytest.raises(LeaseTimeout) as info:
        manager.acquire(1, 1000, holder="tests/test_me.py::test_waiter", timeout=0.3, poll_interval=0.05)
    message = str(info.value)
    assert f"GPU 0 leased by pid {proc.pid} for 'tests/test_other.py::test_holder' since " in message
    assert "tests/test_me.py::test_waiter" in message
    # the declared inventory sees the other process's declared memory
    assert manager.inventory.snapshot()[0].free_mib == 81920 - 1000


def test_killed_holder_releases_its_lease(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = spawn(tmp_path, 1, "tests/x.py::killed")
    manager = _sim_manager(tmp_path)
    assert manager.try_acquire(1, 0, holder="me") is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    record_path = manager.record_path(0)
    assert record_path.exists()  # the dead holder's record stays behind ...
    assert read_holder_record(record_path) is None  # ... and is ignored
    assert manager.holders() == {}
    assert manager.inventory.snapshot()[0].free_mib == 81920
    lease = manager.acquire(1, 1000, holder="me", timeout=5, poll_interval=0.05)
    assert lease.indices == (0,)
    assert read_holder_record(record_path) is not None
    lease.release()


def test_waiting_acquire_gets_lease_when_holder_releases(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = spawn(tmp_path, 1, "tests/x.py::holder")
    manager = _sim_manager(tmp_path)
    result: dict[str, Any] = {}
    notices: list[str] = []

    def wait() -> None:
        try:
            result["lease"] = manager.acquire(
                1, 1000, holder="waiter", timeout=10, poll_interval=0.05, on_wait=notices.append
            )
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    assert "lease" not in result
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("release\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "RELEASED"
    thread.join(timeout=10)
    assert "error" not in result, result.get("error")
    lease = result["lease"]
    assert lease.indices == (0,)
    assert len(notices) == 1 and f"pid {proc.pid}" in notices[0] and "tests/x.py::holder" in notices[0]
    lease.release()
    proc.wait(timeout=10)


def test_other_process_gets_another_gpu(tmp_path: Path, spawn: Callable[..., subprocess.Popen[str]]) -> None:
    manager = _sim_manager(tmp_path, count=2)
    mine = manager.acquire(1, 1000, holder="me", timeout=0)
    assert mine.indices == (0,)
    proc = spawn(tmp_path, 2, "tests/x.py::other")
    assert proc.stdout is not None
    assert manager.holders()[1].pid == proc.pid
    assert manager.try_acquire(1, 0, holder="me again") is None
    mine.release()


def test_release_from_another_thread(tmp_path: Path) -> None:
    manager = _sim_manager(tmp_path)
    lease = manager.acquire(1, 0, holder="t", timeout=0)
    thread = threading.Thread(target=lease.release)
    thread.start()
    thread.join(timeout=10)
    assert lease.released
    manager.acquire(1, 0, holder="u", timeout=0).release()


def test_release_when_nvml_fails_meanwhile(tmp_path: Path) -> None:
    nvml = make_nvml(1)
    manager = make_manager(tmp_path, nvml)
    lease = manager.acquire(1, 0, holder="t", timeout=0)

    def broken(handle: FakeDevice) -> None:
        raise FakeNVMLError("GPU is lost")

    nvml.nvmlDeviceGetMemoryInfo = broken  # type: ignore[method-assign,assignment]
    report = lease.release(wait_timeout=10)
    assert not report.memory_back
    assert report.error is not None and "GPU is lost" in report.error
    assert "NVML error" in report.message
    assert lease.released and not manager.record_path(0).exists()


def test_interrupted_release_still_unlocks(tmp_path: Path) -> None:
    nvml = make_nvml(1)
    manager = make_manager(tmp_path, nvml)
    lease = manager.acquire(1, 0, holder="t", timeout=0)
    nvml.devices[0].free_mib = 10

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    manager.sleep = interrupt
    with pytest.raises(KeyboardInterrupt):
        lease.release(wait_timeout=10)
    assert lease.released
    nvml.devices[0].free_mib = H100_MIB - 500
    other = manager.acquire(1, 0, holder="other", timeout=0)
    report = lease.release()  # a second call neither waits nor touches the other lease's record
    assert report.error is not None and "interrupted" in report.error
    assert manager.holders()[0].holder == "other"
    other.release()


def test_forgotten_lease_stays_held(tmp_path: Path) -> None:
    import gc

    manager = _sim_manager(tmp_path)
    manager.acquire(1, 0, holder="forgotten", timeout=0)  # no reference kept
    gc.collect()
    assert manager.try_acquire(1, 0, holder="t") is None
    from pytest_sglworker.resources.gpus import leases

    for lease in [lease for lease in leases._HELD_LEASES if lease.holder == "forgotten"]:
        lease.release()
    again = manager.try_acquire(1, 0, holder="t")
    assert again is not None
    again.release()


def test_a_waiting_process_is_visible_to_holders(tmp_path: Path) -> None:
    """A process waiting for a lease flags itself, so that holders of idle pooled workers let go."""
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    holder = LeaseManager(lock_dir, DeclaredInventory(1, 1024), namespace="sim-1x1")
    lease = holder.acquire(1, 100, holder="holder", timeout=5)
    assert not holder.others_waiting()
    script = textwrap.dedent(f"""
        from pathlib import Path
        from pytest_sglworker.resources.gpus import DeclaredInventory, LeaseManager
        m = LeaseManager(Path({str(lock_dir)!r}), DeclaredInventory(1, 1024), namespace="sim-1x1")
        lease = m.acquire(1, 100, holder="waiter", timeout=30, poll_interval=0.05)
        lease.release()
    """)
    waiter = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 20
        while not holder.others_waiting():
            assert time.monotonic() < deadline, "the waiter never flagged itself"
            time.sleep(0.05)
        lease.release()
        assert waiter.wait(timeout=20) == 0
        assert not holder.others_waiting()  # the flag is gone with the wait
        assert not list(lock_dir.glob("waiting-*"))
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()


# --------------------------------------------------------------------------------------------------
# hostile lock-directory content (issue #12, items 2 and 9): a record that cannot be trusted is ignored,
# removed when its lock is free, with one warning; the lock, not the record, says who holds a GPU

HOSTILE = REPO_ROOT / "tests" / "data" / "hostile"
HOSTILE_RECORDS = sorted(p.name for p in HOSTILE.glob("record-*.json"))


def plant(path: Path, name: str, *, pid: int | None = None) -> None:
    """Write the hostile file ``name`` at ``path``, placeholders filled in (see tests/data/hostile/README.md)."""
    import socket

    raw = (HOSTILE / name).read_bytes()
    for key, value in ((b"@PID@", pid or os.getpid()), (b"@HOSTNAME@", socket.gethostname()),
                       (b"@SINCE@", time.time())):
        raw = raw.replace(key, str(value).encode())
    path.write_bytes(raw)


def _record(pid: int, *, memory_mib: int = 81920, index: int = 0, namespace: str = "sim-1x80") -> str:
    import socket

    return json.dumps({"pid": pid, "hostname": socket.gethostname(), "holder": "someone", "since": time.time(),
                       "uuid": f"GPU-sim-{index:012d}", "memory_mib": memory_mib, "index": index,
                       "namespace": namespace, "gpus": [index]})


def test_every_hostile_file_is_described() -> None:
    readme = (HOSTILE / "README.md").read_text()
    assert len(HOSTILE_RECORDS) >= 15
    assert [n for n in HOSTILE_RECORDS if n not in readme] == []


@pytest.mark.parametrize("name", HOSTILE_RECORDS)
def test_hostile_record_is_ignored_and_removed_with_one_warning(tmp_path: Path, name: str) -> None:
    from pytest_sglworker.resources.gpus import HolderRecordWarning, inspect_holder_record
    from pytest_sglworker.resources.reaper import remove_stale_holder_records

    path = tmp_path / "gpu-sim-1x80-0.json"
    plant(path, name)
    record, problem = inspect_holder_record(path)
    assert record is None and problem, problem
    assert read_holder_record(path) is None and read_holder_record(path, only_live=False) is None
    assert remove_stale_holder_records(tmp_path) == []  # the janitor neither crashes nor trusts it
    inventory = DeclaredInventory(1, 81920)
    with pytest.warns(HolderRecordWarning) as caught:
        manager = LeaseManager(tmp_path, inventory, namespace=inventory.namespace)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message == (f"ignored 1 untrusted GPU holder record(s) in {tmp_path}: gpu-sim-1x80-0.json "
                       f"({problem}; removed)"), message
    assert "\n" not in message and "\x1b" not in message
    assert not path.exists()
    assert inventory.snapshot()[0].free_mib == 81920
    with manager.acquire(1, 81920, holder="me", timeout=0) as lease:
        assert lease.indices == (0,)
    # The next manager on this lock directory finds nothing to warn about.
    notices: list[str] = []
    LeaseManager(tmp_path, inventory, namespace=inventory.namespace, on_message=notices.append)
    assert notices == []


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("record-pid-1e999.json", "'pid' is inf, not a whole number in 1..4194304"),
        ("record-pid-negative.json", "'pid' is -5, not a whole number in 1..4194304"),
        ("record-gpus-1e999.json", "'gpus' is inf, not a whole number in 0..65536"),
        ("record-nested-20000.json", "is 40001 bytes, far larger than a holder record"),
        ("record-nested-5000.json", "nested too deeply to be a holder record"),
        ("record-since-nan.json", "not valid JSON (NaN is not a number a holder record holds)"),
        ("record-wrong-index.json", "it names GPU 7 of 'sim-1x80', not the GPU its file name says"),
        ("record-empty.json", "is empty"),
        ("record-not-utf8.json", "not UTF-8 text"),
        ("record-not-an-object.json", "a JSON list, not an object"),
        ("record-missing-fields.json", "missing 'holder', 'since', 'uuid', 'memory_mib', 'index', 'namespace'"),
    ],
)
def test_hostile_record_reasons(tmp_path: Path, name: str, reason: str) -> None:
    from pytest_sglworker.resources.gpus import inspect_holder_record

    path = tmp_path / "gpu-sim-1x80-0.json"
    plant(path, name)
    assert inspect_holder_record(path) == (None, reason)


def test_record_paths_that_are_not_files_are_never_followed_or_blocked_on(tmp_path: Path) -> None:
    from pytest_sglworker.resources.gpus import inspect_holder_record

    good = tmp_path / "elsewhere.json"
    good.write_text(_record(os.getpid()))
    cases = {"gpu-a-0.json": "is a directory", "gpu-a-1.json": "is a symlink (never followed)",
             "gpu-a-2.json": "is a symlink (never followed)", "gpu-a-3.json": "is not a regular file"}
    (tmp_path / "gpu-a-0.json").mkdir()
    (tmp_path / "gpu-a-1.json").symlink_to("/dev/zero")  # followed, a read would never end
    (tmp_path / "gpu-a-2.json").symlink_to(good)  # a valid record elsewhere: still not ours to trust
    os.mkfifo(tmp_path / "gpu-a-3.json")  # opened without O_NONBLOCK, the read would block forever
    for name, reason in cases.items():
        assert inspect_holder_record(tmp_path / name) == (None, reason), name
    assert inspect_holder_record(tmp_path / "gpu-a-9.json") == (None, None)  # missing: no problem at all
    notices: list[str] = []
    LeaseManager(tmp_path, DeclaredInventory(4, 1024), namespace="a", on_message=notices.append)
    (notice,) = notices
    assert "ignored 4 untrusted GPU holder record(s)" in notice
    assert "gpu-a-0.json (is a directory; kept: a directory is never removed)" in notice
    assert (tmp_path / "gpu-a-0.json").is_dir() and good.exists()
    assert not (tmp_path / "gpu-a-1.json").is_symlink() and not (tmp_path / "gpu-a-3.json").exists()


def test_untrusted_record_of_a_held_lock_is_ignored_but_kept(tmp_path: Path) -> None:
    from filelock import FileLock

    path = tmp_path / "gpu-sim-1x80-0.json"
    plant(path, "record-pid-negative.json")
    lock = FileLock(tmp_path / "gpu-sim-1x80-0.lock", thread_local=False)
    lock.acquire()
    try:
        notices: list[str] = []
        manager = _sim_manager_80(tmp_path, notices)
        assert notices == [f"ignored 1 untrusted GPU holder record(s) in {tmp_path}: gpu-sim-1x80-0.json "
                           "('pid' is -5, not a whole number in 1..4194304; kept: its lock is held)"]
        assert path.exists() and manager.try_acquire(1, 0, holder="me") is None
    finally:
        lock.release()


def _sim_manager_80(lock_dir: Path, notices: list[str]) -> LeaseManager:
    inventory = DeclaredInventory(1, 81920)
    return LeaseManager(lock_dir, inventory, namespace=inventory.namespace, on_message=notices.append)


def test_warning_under_w_error_does_not_crash(tmp_path: Path) -> None:
    import warnings

    plant(tmp_path / "gpu-sim-1x80-0.json", "record-pid-1e999.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager = LeaseManager(tmp_path, DeclaredInventory(1, 81920), namespace="sim-1x80")
    (notice,) = manager.notices
    assert "gpu-sim-1x80-0.json ('pid' is inf, not a whole number" in notice


def test_record_of_a_live_process_holding_no_lock_does_not_stall_leases(tmp_path: Path) -> None:
    """Item 9: trust the lock, not the record. A live process (here: this one) left a record but holds no lock."""
    (tmp_path / "gpu-sim-1x80-0.json").write_text(_record(os.getpid()))
    notices: list[str] = []
    manager = _sim_manager_80(tmp_path, notices)
    assert notices == []  # a well-formed record: nothing to warn about, it is simply not believed
    assert manager.inventory.snapshot()[0].free_mib == 81920
    assert manager.holders() == {}
    with manager.acquire(1, 81920, holder="me", timeout=0) as lease:
        assert lease.indices == (0,)
        record = read_holder_record(manager.record_path(0))
        assert record is not None and record.holder == "me" and record.memory_mib == 81920
        assert manager.inventory.snapshot()[0].free_mib == 0  # our own record, under our lock, counts
    assert not manager.record_path(0).exists()


def test_timeout_message_does_not_blame_a_record_without_a_lock(tmp_path: Path) -> None:
    from filelock import FileLock

    (tmp_path / "gpu-sim-1x80-0.json").write_text(_record(os.getpid(), memory_mib=10))
    other = FileLock(tmp_path / "gpu-sim-1x80-0.lock", thread_local=False)
    other.acquire()  # held, but by "someone" whose record is not written yet
    try:
        manager = _sim_manager_80(tmp_path, [])
        with pytest.raises(LeaseTimeout) as info:
            manager.acquire(1, 100, holder="me", timeout=0)
        assert f"GPU 0 leased by pid {os.getpid()} for 'someone'" in str(info.value)
    finally:
        other.release()
    manager = _sim_manager_80(tmp_path, [])
    assert manager.holders() == {}


def test_lock_is_held() -> None:
    import tempfile

    from filelock import FileLock

    from pytest_sglworker.resources.gpus import lock_is_held

    with tempfile.TemporaryDirectory() as name:
        path = Path(name) / "x.lock"
        assert not lock_is_held(path)  # missing
        lock = FileLock(path, thread_local=False)
        lock.acquire()
        assert lock_is_held(path)  # ours counts: flock is per open file
        lock.release()
        assert not lock_is_held(path)
        (Path(name) / "d.lock").mkdir()
        assert not lock_is_held(Path(name) / "d.lock")


@pytest.mark.parametrize("which", ["lock", "record"])
def test_lock_or_record_path_that_is_a_directory_is_a_clear_error(tmp_path: Path, which: str) -> None:
    from pytest_sglworker.resources.state import UnusableFile

    manager = _sim_manager_80(tmp_path, [])
    path = manager.lock_path(0) if which == "lock" else manager.record_path(0)
    path.mkdir()
    what = "GPU lock file" if which == "lock" else "GPU holder record"
    with pytest.raises(UnusableFile) as info:
        manager.acquire(1, 100, holder="me", timeout=5)
    assert str(info.value) == (f"cannot use the {what} {path}: it is a directory; remove it (the lock directory "
                               f"{tmp_path} holds only files the plugin makes) or choose another --sgl-lock-dir")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
    path.rmdir()
    with manager.acquire(1, 100, holder="me", timeout=0) as lease:  # and the lock was not kept
        assert lease.indices == (0,)


def test_dead_writers_temporary_files_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = [tmp_path / f".gpu-sim-1x80-0.json.{pid}-0a1b2c3d.tmp", tmp_path / f"gpu-sim-1x80-0.json.{pid}.tmp"]
    live = tmp_path / f".gpu-sim-1x80-0.json.{os.getppid()}-0a1b2c3d.tmp"
    other = tmp_path / "unrelated.tmp"
    for path in [*stale, live, other]:
        path.write_text("{")
    _sim_manager_80(tmp_path, [])
    assert [p.exists() for p in stale] == [False, False]
    assert live.exists() and other.exists()


def test_absurd_waiting_flags_are_ignored(tmp_path: Path) -> None:
    manager = _sim_manager_80(tmp_path, [])
    for name in ("waiting-sim-1x80-99999999999999999999999", "waiting-sim-1x80--5", "waiting-sim-1x80-0",
                 "waiting-sim-1x80-1e999", "waiting-ports-99999999999999999999"):
        (tmp_path / name).write_text("")
    assert not manager.others_waiting()
    (tmp_path / f"waiting-ports-{os.getppid()}").write_text("")  # a live process waits for a port block
    assert manager.others_waiting()


# --------------------------------------------------------------------------------------------------
# an attempt that fails after locking gives its locks back at once (not when its traceback is collected)


class ScriptedInventory(DeclaredInventory):
    """A declared inventory whose ``n``-th reading is changed by ``script[n]`` (1-based): raise, or edit."""

    def __init__(self, count: int, script: dict[int, Callable[[list[GpuInfo]], list[GpuInfo]]]) -> None:
        super().__init__(count, 81920)
        self.script = script
        self.readings = 0

    def snapshot(self) -> list[GpuInfo]:
        self.readings += 1
        gpus = super().snapshot()
        edit = self.script.get(self.readings)
        return edit(gpus) if edit is not None else gpus


def _free_again(lock_dir: Path, count: int, index: int) -> None:
    """GPU ``index`` can be leased by another manager now."""
    other = _sim_manager(lock_dir, count)
    lease = other.try_acquire(1, 1000, holder="other")
    assert lease is not None and lease.indices == (index,)
    lease.release()


def test_a_reading_that_fails_after_locking_unlocks_at_once(tmp_path: Path) -> None:
    def fail(gpus: list[GpuInfo]) -> list[GpuInfo]:
        raise RuntimeError("NVML went away")

    inventory = ScriptedInventory(1, {3: fail})  # the re-reading after the lock (1: the totals, 2: the first)
    manager = LeaseManager(tmp_path, inventory, namespace=inventory.namespace)
    with pytest.raises(RuntimeError, match="NVML went away") as info:
        manager.try_acquire(1, 1000, holder="t")
    _free_again(tmp_path, 1, 0)
    assert info.traceback  # held still, with the attempt's frame


def test_records_that_fail_to_be_written_are_removed_and_unlocked_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = _sim_manager(tmp_path)

    def half_written(gpus: Any, holder: str, memory_mib: int, workers: Any) -> None:
        manager.record_path(0).write_text("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manager, "_write_records", half_written)
    with pytest.raises(OSError, match="No space left") as info:
        manager.try_acquire(1, 1000, holder="t")
    assert not manager.record_path(0).exists()
    _free_again(tmp_path, 1, 0)
    assert info.traceback


def test_an_unusable_lock_file_in_a_group_unlocks_the_rest_at_once(tmp_path: Path) -> None:
    manager = _sim_manager(tmp_path, 2)
    manager.lock_path(1).mkdir(parents=True)
    with pytest.raises(Exception, match="GPU lock file") as info:
        manager.try_acquire(2, 1000, holder="t")
    _free_again(tmp_path, 2, 0)
    assert info.traceback


def test_a_gpu_found_short_after_locking_is_passed_over(tmp_path: Path) -> None:
    """Someone started on GPU 0 between the reading and the lock: the next GPU is leased, GPU 0 left alone."""
    def taken(gpus: list[GpuInfo]) -> list[GpuInfo]:
        return [dataclasses.replace(g, free_mib=0) if g.index == 0 else g for g in gpus]

    inventory = ScriptedInventory(2, {3: taken})  # the re-reading after locking GPU 0
    manager = LeaseManager(tmp_path, inventory, namespace=inventory.namespace)
    lease = manager.try_acquire(1, 1000, holder="t")
    try:
        assert lease is not None and lease.indices == (1,)
        _free_again(tmp_path, 2, 0)
    finally:
        if lease is not None:
            lease.release()


def test_a_lease_taken_on_one_thread_is_released_on_another_even_while_its_locks_are_referenced(
        tmp_path: Path) -> None:
    manager = _sim_manager(tmp_path)
    lease = manager.acquire(1, 0, holder="t", timeout=0)
    locks = lease.held_locks()
    thread = threading.Thread(target=lease.release)
    thread.start()
    thread.join(timeout=30)
    manager.acquire(1, 0, holder="u", timeout=0).release()
    assert locks


def test_a_gpu_lock_file_is_never_writable_by_others_whatever_the_umask(tmp_path: Path) -> None:
    manager = _sim_manager(tmp_path)
    old = os.umask(0)
    try:
        lease = manager.acquire(1, 0, holder="t", timeout=0)
    finally:
        os.umask(old)
    lease.release()
    assert oct(manager.lock_path(0).stat().st_mode & 0o777) == "0o644"


def test_a_group_found_short_after_locking_frees_its_gpus_for_the_next_group_at_once(tmp_path: Path) -> None:
    """tp=2 over 3 GPUs: the run 0-1 is found short on GPU 0 after locking; the run 1-2 is leased, GPU 1 included
    (the first run's lock of it given back before the next run is locked, not when the attempt ends)."""
    def taken(gpus: list[GpuInfo]) -> list[GpuInfo]:
        return [dataclasses.replace(g, free_mib=0) if g.index == 0 else g for g in gpus]

    inventory = ScriptedInventory(3, {3: taken})
    manager = LeaseManager(tmp_path, inventory, namespace=inventory.namespace)
    lease = manager.try_acquire(2, 1000, holder="t")
    try:
        assert lease is not None and lease.indices == (1, 2)
    finally:
        if lease is not None:
            lease.release()
