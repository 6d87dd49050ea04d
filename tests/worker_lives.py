"""The record of simulated worker lifetimes (``SGLSIM_RECORD``), shared by the GPU-budgeting tests under xdist and on
Ray: each simulated worker appends its ``start``/``ready``/``exit`` events to one file; :func:`lifetimes` turns it
into live intervals and :func:`assert_exclusive` checks that no GPU and no port was ever held by two live workers
at once."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Life:
    """One simulated worker, from its ``start`` event to its ``exit`` event (``end`` None: no exit seen)."""

    pid: int
    start: float
    end: float | None
    cuda_visible_devices: str | None
    port: int
    nccl_port: int
    tp_size: int
    fraction: float
    exit_reason: str | None = None

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(e.strip() for e in (self.cuda_visible_devices or "").split(",") if e.strip())

    def overlaps(self, other: Life) -> bool:
        assert self.end is not None and other.end is not None
        return self.start < other.end and other.start < self.end


def lifetimes(record: Path) -> list[Life]:
    """Every worker's life in ``record``, in start order (a reused pid starts a new life)."""
    if not record.exists():
        return []
    lives: list[Life] = []
    current: dict[int, Life] = {}
    for line in record.read_text().splitlines():
        event = json.loads(line)
        pid = event["pid"]
        if event["event"] == "start":
            current[pid] = Life(pid, event["time"], None, event["cuda_visible_devices"], event["port"],
                                event["nccl_port"], event["tp_size"], event["mem_fraction_static"])
            lives.append(current[pid])
        elif event["event"] == "exit" and pid in current:
            current[pid].end = event["time"]
            current[pid].exit_reason = event.get("reason")
            del current[pid]
    return sorted(lives, key=lambda life: life.start)


def assert_exclusive(lives: Sequence[Life], *, gpu_count: int) -> None:
    """Every worker had its own GPUs (CUDA_VISIBLE_DEVICES set, tp_size distinct indices of the inventory)
    and ports; no GPU and no port was held by two live workers at once."""
    assert lives, "no simulated worker was recorded"
    for life in lives:
        assert life.end is not None, f"worker pid {life.pid} has no exit event (killed hard and never timed?)"
        assert life.cuda_visible_devices, f"worker pid {life.pid} started without CUDA_VISIBLE_DEVICES"
        assert len(set(life.gpus)) == len(life.gpus) == life.tp_size, (
            f"worker pid {life.pid} (tp {life.tp_size}) got CUDA_VISIBLE_DEVICES={life.cuda_visible_devices!r}")
        assert all(g.isdigit() and int(g) < gpu_count for g in life.gpus), (
            f"worker pid {life.pid} got GPUs {life.gpus} outside the inventory of {gpu_count}")
        assert life.port != life.nccl_port
    clashes = []
    for i, a in enumerate(lives):
        for b in lives[i + 1:]:
            if not a.overlaps(b):
                continue
            shared_gpus = set(a.gpus) & set(b.gpus)
            shared_ports = {a.port, a.nccl_port} & {b.port, b.nccl_port}
            if shared_gpus or shared_ports:
                clashes.append(f"pid {a.pid} [{a.start:.3f}, {a.end:.3f}] and pid {b.pid} [{b.start:.3f}, "
                               f"{b.end:.3f}] shared GPUs {sorted(shared_gpus)} / ports {sorted(shared_ports)}")
    assert not clashes, "double booking:\n" + "\n".join(clashes)


def max_concurrency(lives: Sequence[Life]) -> int:
    events = sorted([(life.start, 1) for life in lives] + [(life.end or float("inf"), -1) for life in lives])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak
