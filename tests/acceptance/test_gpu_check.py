"""``sglworker gpu-check --dry-run`` (fake NVML, fake CUDA, real pytest sessions of the plugin), so that the
one-command GPU check cannot rot before a GPU machine runs it for real.

The autouse guard of conftest.py checks that nothing the check started (inner sessions, holders) is left:
they inherit this test's ``SGLWORKER_TEST_MARK``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
#: The command as the package installs it (``sglworker``), run with this Python.
COMMAND = [sys.executable, "-m", "pytest_sglworker.tools", "gpu-check"]
#: The checkout's wrapper of it (docs/GPU_CHECK.md's command in a clone).
WRAPPER = REPO / "scripts" / "gpu-check"
PROGRAM = REPO / "pytest_sglworker" / "tools" / "gpu_check"
HOLDER = PROGRAM / "holder.py"
STUB_SOURCE = PROGRAM / "testing" / "libcuda_stub.c"
CHECKS = [
    "environment", "nvml_inventory", "lease_visibility", "nvml_process_ids", "ledger_input", "lease_exclusivity",
    "release_wait", "sigkill_teardown", "torch_view", "sglang_launch", "leftovers",
]
#: The fake driver frees the memory of a process this long after it dies (fakegpu.write_state).
FAKE_RELEASE_DELAY_S = 0.3


#: The check's own ``--budget`` (its default): it stops its inner sessions and reports within it.
CHECK_BUDGET_S = 270
#: What the check needs beyond its budget to stop the session that ran out, sweep its leftovers and write its
#: report (the inner sessions' SIGINT-then-SIGKILL grace and the leftovers scan, about 20 s, doubled).
CHECK_EXIT_MARGIN_S = 40


def run_check(*args: str, env: dict[str, str] | None = None, command: list[str] = COMMAND,
              timeout: float = CHECK_BUDGET_S + CHECK_EXIT_MARGIN_S) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([*command, *args], env=full_env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=str(REPO))


def rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["check"]: row for row in doc["checks"]}


def test_dry_run_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_check("--dry-run", env={"OUT": str(out)})  # $OUT is where results go without --out
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    doc = json.loads((out / "gpu-check.json").read_text())
    assert doc["schema"] == "pytest-sglworker/gpu-check/v1"
    assert doc["mode"] == "dry-run" and doc["ok"] and doc["failed"] == []
    assert [row["check"] for row in doc["checks"]] == CHECKS
    # no wall-clock bound here: the check bounds itself by its budget (a loaded CI machine took 72 s where an
    # idle one takes 23 s); bench/ is where speed is measured
    assert doc["duration_s"] < CHECK_BUDGET_S, done.stdout[-3000:]
    by = rows(doc)
    why = done.stdout[-6000:]  # the table, for any assertion below
    statuses = {name: row["status"] for name, row in by.items()}
    assert statuses == {
        "environment": "info", "nvml_inventory": "pass", "lease_visibility": "pass", "nvml_process_ids": "pass",
        "ledger_input": "pass", "lease_exclusivity": "pass", "release_wait": "pass", "sigkill_teardown": "pass",
        "torch_view": "skip", "sglang_launch": "skip", "leftovers": "pass",
    }, {n: r["detail"] for n, r in by.items()}

    # the table and the files
    table = (out / "gpu-check.txt").read_text()
    for name in CHECKS:
        assert name in table and name in done.stdout
    assert "11 checks, 0 failed" in done.stdout
    assert (out / "logs" / "events.jsonl").stat().st_size > 0

    # the plugin ran from this tree; CUDA was the fake
    env = by["environment"]["data"]
    assert Path(env["plugin_file"]).resolve().is_relative_to(REPO)
    assert env["cuda_probe"]["pci_bus_id"]["kind"] == "fake"

    # inventory: two fake H200s in PCI order, nvidia-smi and CUDA agree
    inventory = by["nvml_inventory"]["data"]
    assert [g["index"] for g in inventory["plugin_inventory"]] == [0, 1]
    assert {g["name"] for g in inventory["plugin_inventory"]} == {"NVIDIA H200"}
    assert len(inventory["nvidia_smi"]) == 2 and inventory["problems"] == []

    # each worker saw exactly its GPU (the fake CUDA orders devices in reverse without PCI_BUS_ID)
    visibility = by["lease_visibility"]["data"]
    for index in ("0", "1"):
        seen = visibility[index]
        assert seen["holder"]["cuda_visible_devices"] == index
        assert seen["holder"]["device_count"] == 1
        assert seen["holder"]["device"]["uuid"] == seen["nvml_before"][index]["uuid"]
        assert seen["holder_listed_on"] == [int(index)]
        assert seen["free_drop_mib"][index] == 1024 + 512  # held + the fake context

    # exclusivity under -n 4: one lease of the GPU at a time although memory would fit four; no over-commit
    excl = by["lease_exclusivity"]["data"]
    assert excl["holders"] == 6 and excl["leases"] >= 6, (excl, why)
    assert excl["max_concurrent_leases"] == 1 and excl["max_concurrent_holders"] == 1
    assert excl["memory_would_fit"] == 4
    assert excl["short_acquisitions"] == [] and excl["holder_errors"] == [] and excl["observer_errors"] == []
    assert excl["lease_wait_seconds_total"] > 0  # the other xdist workers queued

    # release waits: memory held until exit comes back after the fake driver's delay, and the lease only then
    cases = {c["case"]: c for c in by["release_wait"]["data"]["cases"]}
    assert set(cases) == {"hold-30g-free", "hold-30g-exit", "hold-big-exit"}
    for case in cases.values():
        assert "problem" not in case, (case, why)
        assert case["memory_back"] is True
        assert case["lease_back_after_exit_s"] >= case["nvml_last_busy_after_exit_s"], (case, why)
    # freed by cuMemFree before the exit: NVML last saw the memory in use no later than the holder's exit. The
    # free and the exit event are microseconds apart and the figure is rounded to the millisecond, so a poll just
    # before the free reads -0.0; a holder that kept the memory to its exit reads the fake driver's delay instead
    assert cases["hold-30g-free"]["nvml_last_busy_after_exit_s"] <= 0, (cases["hold-30g-free"], why)
    for name in ("hold-30g-exit", "hold-big-exit"):
        case = cases[name]
        # held until the exit, and back only after the fake driver's delay (a lower bound: load only adds to it)
        assert case["nvml_last_busy_after_exit_s"] >= 0, (case, why)
        assert case["nvml_free_after_exit_s"] >= FAKE_RELEASE_DELAY_S - 0.05, (case, why)
        if case["release_started_after_exit_s"] < FAKE_RELEASE_DELAY_S - 0.1:  # (not when this box is slow)
            assert case["lease_waited_s"] > 0, (case, why)  # Lease.release polled until the memory was back

    # SIGKILL mid-test: reported as -9, lease back only after the memory, GPU leasable at once afterwards
    kill = by["sigkill_teardown"]["data"]
    assert kill["sigkill"]["returncode"] == -9 and "SIGKILL" in kill["sigkill"]["died_message"], why
    assert kill["release"]["memory_back"] is True
    assert kill["release"]["lease_back_after_exit_s"] >= kill["release"]["nvml_free_after_exit_s"] - 0.05
    assert kill["after"]["granted"] is True and kill["after"]["killed_alive"] is False, why

    # ledger input: NVML's numbers, the card table's H200
    ledger = by["ledger_input"]["data"]
    assert ledger["ledger_total_mib"] == ledger["nvml_total_mib"] == 143771
    assert ledger["card"] == "H200"
    assert ledger["context_overhead_mib"] == 512

    assert "sglang not installed" in by["sglang_launch"]["detail"] or "dry run" in by["sglang_launch"]["detail"]
    assert by["leftovers"]["data"]["left_running"] == []


def test_dry_run_catches_a_wrong_device_order_and_hidden_pids(tmp_path: Path) -> None:
    """Faults of the fakes: CUDA numbering devices in its own order, NVML listing no process. The check must
    fail the visibility with a clear line (and warn about the pids), not pass and not hang."""
    out = tmp_path / "out"
    done = run_check("--dry-run", "--out", str(out), "--only", "lease_visibility,nvml_process_ids",
                     "--fake-fault", "cuda_ignores_device_order,nvml_hides_pids")
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    doc = json.loads((out / "gpu-check.json").read_text())
    by = rows(doc)
    assert [row["check"] for row in doc["checks"]] == ["environment", "lease_visibility", "nvml_process_ids",
                                                       "leftovers"]
    visibility = by["lease_visibility"]
    assert visibility["status"] == "fail"
    assert "the worker's CUDA device 0 is at PCI 0000:3B:00.0" in visibility["detail"]
    assert "the leased NVML GPU 0 at 00000000:19:00.0" in visibility["detail"]
    assert by["nvml_process_ids"]["status"] == "warn"
    assert "Lease.release cannot see a worker" in by["nvml_process_ids"]["detail"]
    assert by["leftovers"]["status"] == "pass"
    assert doc["failed"] == ["lease_visibility"]


def test_dry_run_reports_a_holder_that_cannot_allocate(tmp_path: Path) -> None:
    """A CUDA error in the holder is one clear line in the table, and the failed launch gives its lease back."""
    out = tmp_path / "out"
    done = run_check("--dry-run", "--out", str(out), "--only", "lease_visibility", "--fake-gpus", "1",
                     "--fake-fault", "cuda_oom")
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    by = rows(json.loads((out / "gpu-check.json").read_text()))
    assert by["lease_visibility"]["status"] == "fail", done.stdout[-3000:]
    assert "holder: cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2)" in by["lease_visibility"]["detail"]
    assert by["leftovers"]["status"] == "pass", by["leftovers"]["detail"]  # no lease, lock or process left


@pytest.mark.parametrize("command", [COMMAND, [str(WRAPPER)]], ids=["sglworker", "clone-wrapper"])
def test_usage_errors(command: list[str]) -> None:
    """The package's command and the checkout's wrapper run the same check (its own argument parser)."""
    done = run_check("--only", "nope", command=command, timeout=30)
    assert done.returncode != 0 and "unknown check(s) in --only: nope" in (done.stdout + done.stderr)
    done = run_check("--fake-fault", "x", command=command, timeout=30)
    assert done.returncode == 2 and "need --dry-run" in done.stderr
    assert done.stderr.startswith("usage: sglworker gpu-check"), done.stderr


# ------------------------------------------------------------------------------------------------------------
# The real CUDA path (ctypes over libcuda) against a stub libcuda.so: what the dry run's fake cannot check.


@pytest.fixture
def stub_libcuda(tmp_path: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stub libcuda.so")
    lib = tmp_path / "libcuda_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(STUB_SOURCE)], check=True,
                   capture_output=True, timeout=60)
    return lib


def _holder_env(lib: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update({"GPU_CHECK_CUDA_LIB": str(lib), "GPU_CHECK_EVENTS": str(tmp_path / "events.jsonl"),
                "GPU_CHECK_MAX_LIFETIME_S": "60", **extra})
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _gpu_check_info(port: int, proc: subprocess.Popen[str], timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"holder exited with {proc.returncode}: {proc.communicate()[0]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/gpu_check", timeout=2) as resp:
                data: dict[str, Any] = json.loads(resp.read())
                return data
        except OSError:
            assert time.monotonic() < deadline, "the holder did not serve /gpu_check in time"
            time.sleep(0.05)


def test_real_cuda_path_against_a_stub_libcuda(stub_libcuda: Path, tmp_path: Path) -> None:
    probe = subprocess.run([sys.executable, str(HOLDER), "--probe"], env=_holder_env(stub_libcuda, tmp_path),
                           capture_output=True, text=True, timeout=30)
    found = json.loads(probe.stdout)
    assert probe.returncode == 0 and found["ok"] and found["kind"] == "libcuda", probe.stdout + probe.stderr
    assert found["driver_version"] == 13000
    assert found["devices"] == [{"ordinal": 0, "name": "NVIDIA H200 (stub)", "pci_bus_id": "0000:19:00.0",
                                 "uuid": "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf", "total_mib": 143771}]

    for fault, method in (("", "cuCtxCreate_v2"),
                          ("ctxcreate", "cuDevicePrimaryCtxRetain (cuCtxCreate_v2: CUDA_ERROR_NOT_SUPPORTED)")):
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, str(HOLDER), "--model-path", "m", "--host", "127.0.0.1", "--port", str(port),
             "--tp-size", "1", "--mem-fraction-static=0.6", "--some-future-flag", "x"],
            env=_holder_env(stub_libcuda, tmp_path, GPU_CHECK_HOLD_MIB="2048", STUB_CUDA_FAIL=fault),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            info = _gpu_check_info(port, proc)
            assert info["cuda"] == "libcuda" and info["context_method"] == method
            assert info["allocated_mib"] == 2048
            assert info["free_after_context_mib"] == 143771 - 1042
            assert info["free_after_alloc_mib"] == 143771 - 1042 - 2048  # the size went through as size_t
            proc.send_signal(signal.SIGTERM)  # our own holder, by its pid
            out, _ = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # cuMemsetD8 and cuMemFree got back the pointer and size cuMemAlloc gave, or the stub would refuse
        assert proc.returncode == 0, out
        assert "SIGTERM: freed 2048 MiB and the context" in out and "ignored args: --mem-fraction-static=0.6" in out

    failed = subprocess.run([sys.executable, str(HOLDER), "--port", str(_free_port())],
                            env=_holder_env(stub_libcuda, tmp_path, STUB_CUDA_FAIL="alloc"), capture_output=True,
                            text=True, timeout=30)
    assert failed.returncode == 3
    assert "[gpu-check holder] ERROR: cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2)" in failed.stdout
