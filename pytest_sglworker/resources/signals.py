"""Holding off the signals that interrupt a run (SIGINT, SIGTERM, SIGHUP) while a few seconds of work must end
whole: handing a warm group to its keeper, or ending one (``pytest --sgl-warm stop``), where an interrupt in the
middle would leave a record that says one thing and processes that do another.

Plain Python, no pytest. Python runs signal handlers on the main thread only, so the deferral replaces the main
thread's handlers with one that notes the signal; elsewhere it changes nothing (no other thread is ever
interrupted by one). Every step inside is bounded by its own timeout, so a deferred signal waits seconds, never
forever.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["INTERRUPTS", "signals_deferred"]

INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred(*, reraise: bool = True, on_signal: Callable[[int], None] | None = None,
                     signums: tuple[int, ...] = INTERRUPTS) -> Iterator[list[int]]:
    """Note the interrupting signals that arrive inside the block (the list it yields, in order) instead of acting
    on them; ``on_signal(signum)`` is called for each as it arrives (on the main thread). At the end the previous
    handlers are back and, with ``reraise``, each noted signal is raised again, once, so it has the effect it
    would have had (a KeyboardInterrupt, the session's own handler, or the default action). Without ``reraise``
    the caller decides what the signals mean."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)
        if on_signal is not None:
            on_signal(signum)

    previous: dict[int, Any] = {}
    for signum in signums:
        handler = signal.getsignal(signum)
        if handler is None:  # installed outside Python: it could not be put back, so it is left as it is
            continue
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signum, hold)
            previous[signum] = handler
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signum, handler)
        if reraise:
            for signum in dict.fromkeys(received):
                signal.raise_signal(signum)
