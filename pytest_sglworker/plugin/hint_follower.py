"""An xdist worker's follower of the controller's word (issue 43): a thread that reads this worker's launch hint
(:mod:`.launch_hints`) while a test runs, starts the launches ahead it names at once, and hands over to the run the
ready groups launched ahead here whose tests the controller sent to another xdist worker.

Without it, an xdist worker reads the hint only between its tests and while it waits for a launch of its own: a GPU
the controller planned for a configuration of this worker stood idle for the rest of whatever test the worker was
running (a second with the generated box suites' tests; with real models' tests, tens of seconds), and so did the
xdist worker waiting to adopt a group launched ahead here (its hand-over waited for this worker's test to end).

The thread works from what the main thread handed it, nothing else: the hint file's place, and for each
configuration a launch worked out on the main thread (the source's ``ahead_kit``: the kind hook asked there, the
environment read there). It calls the source's ``launch_kit``, which asks nothing of the session and leaves alone a
configuration that is already there, launching, acquired by the main thread, or handed over, and its
``hand_over_ready`` (the plain case only: one ready group idle here; the rest stays the main thread's). A source that
cannot launch that way hands no kits (a plugin hook shapes the workers' env, Ray), and nothing changes there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .launch_hints import read_follow_words

if TYPE_CHECKING:
    from ..workers.config import WorkerConfig
    from ..workers.sources.base import WorkerSource

#: how often the thread reads the hint (and retries a launch ahead that found no free GPUs)
POLL_S = 0.05


class HintFollower:
    """The thread, started by :meth:`start` and ended by :meth:`stop` (before the source closes)."""

    def __init__(self, directory: Path, worker: str, launch: Callable[[Any], bool],
                 on_error: Callable[[str], None] | None = None, poll: float = POLL_S,
                 hand_over: Callable[[tuple[str, ...]], None] | None = None) -> None:
        self._directory = directory
        self._worker = worker
        self._launch = launch
        self._hand_over = hand_over
        self._on_error = on_error
        self._poll = poll
        self._kits: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failed: set[str] = set()
        #: how many times the thread has read the hint (for a caller that waits until it has looked)
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name=f"sglworker-follow-{worker}", daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def hand(self, kits: Mapping[str, Any]) -> None:
        """On the main thread: the launches the thread may start, by configuration key (replacing the last)."""
        with self._lock:
            self._kits = dict(kits)

    def stop(self) -> None:
        """On the main thread: no launch starts after this returns (one begun is registered with the pool, which
        stops it at its close)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            keys, hand = read_follow_words(self._directory, self._worker)
            self.rounds += 1
            if hand and self._hand_over is not None:
                try:
                    self._hand_over(hand)
                except Exception as exc:  # an optimisation: the main thread hands it over between tests
                    if "hand over" not in self._failed and self._on_error is not None:
                        self._failed.add("hand over")
                        self._on_error(f"handing a group over while a test runs failed: {exc!r}")
            if not keys:
                continue
            with self._lock:
                kits = [(key, self._kits[key]) for key in keys if key in self._kits]
            for key, kit in kits:
                if self._stop.is_set():
                    return
                try:
                    self._launch(kit)
                except Exception as exc:  # launching ahead is an optimisation: the test launches its own
                    if key not in self._failed and self._on_error is not None:
                        self._failed.add(key)
                        self._on_error(f"launch ahead of {key} failed to start: {exc!r}")


def hand_follower(follower: HintFollower | None, place: tuple[Path, str], configs: Mapping[str, WorkerConfig],
                  source: WorkerSource, basis: tuple[Mapping[str, str], bool], holder: str,
                  note: Callable[[str], None]) -> HintFollower | None:
    """On the main thread: each configuration's launch worked out from ``basis`` (the environment snapshot, and
    whether a plugin hook shapes the workers' env: then none is), handed to ``follower``, or to a new one started now
    (none while there is nothing to launch). Returns the follower."""
    environ, hooked = basis
    kits = {}
    if not hooked:
        for key, config in configs.items():
            kit = source.ahead_kit(config, holder=holder, environ=environ)
            if kit is not None:  # None: this source launches it ahead between tests only
                kits[key] = kit
    if follower is None and kits:
        follower = HintFollower(place[0], place[1], source.launch_kit, on_error=note, hand_over=source.hand_over_ready)
        follower.hand(kits)
        follower.start()
    elif follower is not None:
        follower.hand(kits)
    return follower
