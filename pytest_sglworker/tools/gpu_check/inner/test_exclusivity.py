"""Leases of one physical GPU under ``-n 4``: 30 GiB specs on one card, several xdist workers competing.

Each test takes a fresh 30 GiB holder, checks that the allocation succeeded, and holds it a while. The driver
lines the leases and holders up (events) with its NVML samples: how many ran at once, whether an acquisition
ever saw less free memory than the spec needs, whether any allocation failed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from inner_helpers import emit, holder_info

HOLDS = 6


@pytest.mark.parametrize("k", range(HOLDS))
def test_hold(k: int, sgl_spawn_worker: Any, hold_seconds: float) -> None:
    worker = sgl_spawn_worker("hold-30g")
    info = holder_info(worker)
    emit("holding", test=f"test_hold[{k}]", worker_pid=worker.pid, free_after_alloc_mib=info["free_after_alloc_mib"])
    assert info["allocated_mib"] == 30 * 1024
    time.sleep(hold_seconds)
    assert worker.is_alive(), worker.failure_message("died while holding its memory")
