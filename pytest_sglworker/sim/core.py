"""The simulated engine's shared pieces: its environment variables, its header and control path, the log, the
event recorder and the main thread's wait (:func:`wait_forever`).

Part of :mod:`pytest_sglworker.sim`; stdlib only. The faults are in :mod:`.faults`, the resolved configuration
(:class:`~.plan.Plan`) in :mod:`.plan`.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

ENV_STARTUP = "SGLSIM_STARTUP_SECONDS"
ENV_WARMUP = "SGLSIM_WARMUP_SECONDS"
ENV_GPU_MEM = "SGLSIM_GPU_MEM_GIB"
ENV_GPU_FREE = "SGLSIM_GPU_FREE_MIB"
ENV_TOKEN = "SGLSIM_TOKEN_SECONDS"
ENV_RECORD = "SGLSIM_RECORD"
ENV_FAULT = "SGLSIM_FAULT"
ENV_PD_WAIT = "SGLSIM_PD_WAIT_SECONDS"
#: Set in the environment of the child that ``escape_child`` leaves behind.
ENV_ESCAPED = "SGLSIM_ESCAPED"

#: Every response carries this header: ``<port>/<pid>`` of the worker that served it.
WORKER_HEADER = "X-SGLSim-Worker"
#: The control endpoint of the request faults.
CONTROL_PATH = "/_sim/faults"

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


# ---------------------------------------------------------------------------------------------- log


class Log:
    """sglang-like log lines on stdout (``[2026-12-02 10:00:00] ...``, ``[... TP1] ...`` on the other ranks of
    a tp>1 server), each flushed at once. Uvicorn's lines carry the same timestamp prefix, as in 0.5.23."""

    def __init__(self, level: str, http_level: str, tp_size: int = 1) -> None:
        self.level = _LEVELS.get(level.lower(), 20)
        self.http_level = _LEVELS.get(http_level.lower(), 20)
        self.tp_size = max(int(tp_size), 1)
        self._lock = threading.Lock()

    def write(self, text: str, stream: Any = None) -> None:
        out = stream if stream is not None else sys.stdout
        with self._lock:
            try:
                out.write(text)
                out.flush()
            except (OSError, ValueError):  # the reader went away: keep serving
                pass

    @staticmethod
    def stamp() -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S")

    def log(self, message: str, *, level: int = 20, tp: bool = False) -> None:
        """One record; ``tp``: a per-rank record, repeated for every rank with ``TPk`` when tp > 1 (with
        ``--tp-size 1`` the real prefix has no rank at all)."""
        if level < self.level:
            return
        stamp = self.stamp()
        if tp and self.tp_size > 1:
            self.write("".join(f"[{stamp} TP{rank}] {message}\n" for rank in range(self.tp_size)))
        else:
            self.write(f"[{stamp}] {message}\n")

    def rank0(self, message: str, *, level: int = 20) -> None:
        """A record of rank 0 only (``[ts TP0]`` when tp > 1)."""
        if level < self.level:
            return
        prefix = " TP0" if self.tp_size > 1 else ""
        self.write(f"[{self.stamp()}{prefix}] {message}\n")

    def info(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=20, tp=tp)

    def warning(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=30, tp=tp)

    def error(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=40, tp=tp)

    def uvicorn(self, level: str, message: str) -> None:
        if _LEVELS[level.lower()] < self.http_level:
            return
        self.write(f"[{self.stamp()}] {level.upper() + ':':<10}{message}\n")


class Recorder:
    """One JSON line per event, appended with a single ``os.write`` on an ``O_APPEND`` descriptor."""

    def __init__(self, path: str | None, fields_: dict[str, Any]) -> None:
        self.path = path
        self.fields = fields_
        self.started = time.time()

    def record(self, event: str, **extra: Any) -> None:
        if not self.path:
            return
        entry: dict[str, Any] = {"event": event, "pid": os.getpid(), **self.fields, "time": time.time()}
        entry.update(extra)
        data = (json.dumps(entry) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            sys.stderr.write(f"{ENV_RECORD}: cannot append to {self.path!r}: {exc}\n")


_wakeup_fd: int | None = None


@contextlib.contextmanager
def signals_wake_main_thread() -> Iterator[None]:
    """Main thread only: while inside, a signal wakes the main thread's :func:`wait_forever` whichever thread the
    kernel hands it to. A process-directed SIGTERM may land on an HTTP thread (right after a SIGCONT, every
    thread of the process may be marked as having a signal pending, and the kernel then picks another), and
    Python runs its handler on the main thread only when that thread next runs: asleep in ``time.sleep``, it
    never would. CPython's C-level handler writes the signal's number to this pipe on any thread; the main
    thread waits on the pipe, wakes, and runs the handler (sglang's uvicorn loop waits the same way). On exit the
    previous wakeup fd is back (the engine may run in-process, in a test)."""
    global _wakeup_fd
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    _wakeup_fd = read_end
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        _wakeup_fd = None
        os.close(read_end)
        os.close(write_end)


def wait_forever() -> NoReturn:
    """Block the calling thread for good; on the main thread inside :func:`signals_wake_main_thread`, a signal's Python
    handler runs as soon as the signal arrives, on whichever thread it landed."""
    while True:
        fd = _wakeup_fd
        if fd is None or threading.current_thread() is not threading.main_thread():
            time.sleep(3600)
            continue
        select.select([fd], [], [])
        os.read(fd, 512)  # the handler runs before the next bytecode; drain for the next wait
