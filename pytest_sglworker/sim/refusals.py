"""The simulated engine's startup refusals that the real CPU engine shows only once it serves: a flag set it
accepts at launch and then dies of (:func:`triton_on_cpu`), and the log lines such a death writes (the scheduler's
traceback, sglang's ``kill_process_tree`` of itself).

Part of :mod:`pytest_sglworker.sim`; stdlib only. Used by :mod:`.startup` (the warmup request) and by the
generation route (the first request after ``--skip-server-warmup``).
"""

from __future__ import annotations

import os
from typing import NoReturn

from .core import Log
from .plan import Plan
from .state import SITE, Sim, kill_self


def scheduler_traceback(frames: list[tuple[str, int, str, str]], last: str) -> str:
    lines = ["Traceback (most recent call last):"]
    lines += [f'  File "{SITE}/{path}", line {line}, in {func}\n    {code}' for path, line, func, code in frames]
    lines.append(last)
    return "\n".join(lines)


def kill_tree_line(log: Log) -> None:
    pid = os.getpid()
    log.info(f"kill_process_tree called: parent_pid={pid}, include_parent=True, pid={pid}")


def triton_on_cpu(plan: Plan) -> bool:
    """A Triton attention backend on ``--device cpu``: the real CPU engine starts, binds, and its scheduler dies at
    the first forward pass (the warmup request, or the first request with ``--skip-server-warmup``), because Triton
    finds no GPU driver."""
    args = plan.args
    return args.get("device") == "cpu" and "triton" in (args.get("attention_backend"),
                                                         args.get("prefill_attention_backend"),
                                                         args.get("decode_attention_backend"))


_FORWARD_FRAMES = [
    ("sglang/srt/managers/scheduler.py", 6368, "run_scheduler_process", "scheduler.run_event_loop()"),
    ("sglang/srt/managers/scheduler.py", 4704, "run_batch",
     "batch_result = self.model_worker.forward_batch_generation("),
    ("sglang/srt/layers/attention/triton_backend.py", 1081, "init_forward_metadata",
     "kv_indptr = self._fill_kv_indptr_and_indices("),
    ("triton/runtime/driver.py", 20, "_create_driver",
     'raise RuntimeError(f"{len(active_drivers)} active drivers ({active_drivers}). There should only be one.")'),
]


def triton_driver_crash(sim: Sim) -> NoReturn:
    """The real engine's death of :func:`triton_on_cpu`: the scheduler's exception, the SIGQUIT, its own
    ``kill_process_tree`` (SIGKILL of the whole tree, itself included)."""
    sim.log.error("Scheduler hit an exception: " + scheduler_traceback(
        _FORWARD_FRAMES, "RuntimeError: 0 active drivers ([]). There should only be one.") + "\n", tp=True)
    sim.log.error("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    kill_tree_line(sim.log)
    sim.recorder.record("exit", returncode=-9, reason="triton on cpu")
    kill_self()
