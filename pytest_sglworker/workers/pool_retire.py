"""Retiring a group off the main thread (:class:`PoolRetire`, a part of :class:`~.pool.WorkerPool`).

A group that no later test of this process needs goes as its last test ends (issue 43): its members stopped (sglang's
clean shutdown takes seconds), its lease given back once their memory is (more seconds on a GPU), its records
finished. On the main thread that time came before this process's next test, which most often needs none of it: its
group was launched ahead, or is pooled. So a healthy group is retired on a thread of its own, from what the main
thread handed it (its entry, taken out of the pool: nothing else refers to it). What the retirement has to say waits
for the main thread (:meth:`PoolRetire._flush_retired`, at the pool's next call); nothing of the session is touched.

The main thread waits for the retirements under way (:meth:`PoolRetire._join_retiring`) when it needs GPUs that no
lease can give this moment (they may be the retiring group's: its test would otherwise wait, and say it waits, for
a holder that is this very process), and before the pool closes (every record is finished before the run's report).
Retired this way: a configuration's group after its last test here (:meth:`~.pool.WorkerPool.discard`), and idle
groups the xdist controller says no test needs or another process waits for (``retire_idle``, ``yield_idle``). On the
main thread as before: a fresh group (its test expects it gone after), one that died or served a test that failed (its
death and logs are the test's report), one whose lease a lease manager can pass on as it is (Ray's placement groups),
evictions (the GPUs are wanted at once) and the pool's close. Plain Python: no pytest here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .pool_parts import Entry

if TYPE_CHECKING:
    from ..resources.gpus import LeaseManager

__all__ = ["PoolRetire", "Retiring"]

#: how long the main thread waits for one retirement before it goes on without it (every wait of a retirement has
#: its own deadline: stop 10 + 10 s, memory release ``release_wait``, the keeper's exit 30 s)
JOIN_TIMEOUT_S = 300.0


@dataclass(eq=False)
class Retiring:
    """One retirement under way: its thread, and what it says (read by the main thread once the thread ended)."""

    label: str
    messages: list[str] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None


class PoolRetire:
    """What :class:`~.pool.WorkerPool` does to retire groups off the main thread; it holds the attributes named here."""

    leases: LeaseManager | None
    on_message: Callable[[str], None]
    on_tick: Callable[[], None]
    _lock: threading.RLock
    _closing: str | None
    #: the retirements under way (or ended and not yet flushed), oldest first
    _retiring: list[Retiring]
    #: whether a healthy group is retired off the main thread (the pool's ``retire_in_background``)
    retire_in_background: bool

    if TYPE_CHECKING:
        def _retire(self, entry: Entry, *, failed: bool, hand_over: tuple[Any, str] | None = None,
                    say: Callable[[str], None] | None = None) -> Any: ...

    def _retire_soon(self, entry: Entry, *, failed: bool) -> None:
        """Retire ``entry`` (taken out of the pool by the caller): on a thread of its own when it is healthy and its
        lease is given back (not passed on), else here."""
        if not self._may_retire_later(entry, failed):
            self._retire(entry, failed=failed)
            return
        job = Retiring(entry.config.label)
        asked = time.time()
        for member in entry.group:  # asked now, whenever the thread gets to it
            member.times.setdefault("stop_requested", asked)

        def run() -> None:
            try:
                self._retire(entry, failed=False, say=job.messages.append)
            except BaseException as exc:  # said on the main thread; a retirement never ends a test
                job.error = exc

        job.thread = threading.Thread(target=run, name=f"sglworker-retire-{job.label}", daemon=True)
        with self._lock:
            self._retiring.append(job)
        job.thread.start()

    def _may_retire_later(self, entry: Entry, failed: bool) -> bool:
        passed_on = getattr(self.leases, "hand_over", None) is not None  # Ray's placement groups
        return (self.retire_in_background and not failed and not entry.tainted and entry.poolable
                and self._closing is None and entry.group.is_alive() and not passed_on)

    def _retiring_now(self) -> bool:
        with self._lock:
            return any(job.thread is not None and job.thread.is_alive() for job in self._retiring)

    def _join_retiring(self) -> None:
        """On the main thread: wait for every retirement under way (the terminal's queue written meanwhile), then
        say what they said."""
        with self._lock:
            jobs = list(self._retiring)
        for job in jobs:
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while job.thread is not None and job.thread.is_alive() and time.monotonic() < deadline:
                job.thread.join(0.1)
                self.on_tick()
        self._flush_retired()

    def _flush_retired(self) -> None:
        """On the main thread: what the retirements that ended said, in the order they began."""
        with self._lock:
            done = [job for job in self._retiring if job.thread is None or not job.thread.is_alive()]
            self._retiring = [job for job in self._retiring if job not in done]
        for job in done:
            for message in job.messages:
                self.on_message(message)
            if job.error is not None:
                self.on_message(f"sglworker: {job.label}: retiring it met {type(job.error).__name__}: {job.error}")
